"""Small tokenizer sources of the vocabulary types the families use, each written the way real ones
are: GGUF files by the ``gguf`` package (llama.cpp's metadata keys, add-BOS/EOS flags both ways) and
HF folders by transformers' own tokenizer classes (``save_pretrained``), with ``generation_config.json``
EOS lists. The vocabularies are a few hundred tokens, so a model over them is tiny and fast."""
from __future__ import annotations

import json
import os

import numpy as np

# SentencePiece style (Llama, Gemma): "▁" marks a word start; bytes outside the vocabulary fall back to
# <0xNN> tokens
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PAD_ID, EOS_ID, BOS_ID, UNK_ID, END_OF_TURN_ID = 0, 1, 2, 3, 6
_SPM_WORDS = ["the", "capital", "of", "France", "is", "Hello", "world", "user", "model", "hi", "Paris", "name"]
# byte-level BPE (GPT-2, Qwen2, Llama 3: tiktoken style): every byte is a token, merges build words
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["The capital of France is", "Hello world", " the  capital\nof", "Héllo wörld ✓ 日本", "hi"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

GEMMA_TEMPLATE_NAME = "gemma"  # a template that writes {{ bos_token }} itself


def _letters() -> list[str]:
    return sorted(set("".join(_SPM_WORDS)) | set("abcdefghijklmnopqrstuvwxyz?!.,\n"))


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, GGUF token types): specials (control), the 256 byte tokens, "▁", letters, then
    pieces of the words, scored so that longer pieces merge first."""
    pieces: list[str] = ["\u2581"] + [c for c in _letters() if c != "\n"]
    for w in _SPM_WORDS:
        word = "\u2581" + w
        for end in range(2, len(word) + 1):
            if word[:end] not in pieces:
                pieces.append(word[:end])
    tokens = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * (len(SPM_SPECIALS) + 256) + [-float(i) for i in range(len(pieces))]
    types = [3] * len(SPM_SPECIALS) + [6] * 256 + [1] * len(pieces)
    types[UNK_ID] = 2
    return tokens, scores, types


def bpe_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE: the specials, the 256 byte characters, then merged words."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = list(BPE_SPECIALS) + list(bytes_to_unicode().values())
    merges: list[str] = []
    for w in _SPM_WORDS:
        for word in ("\u0120" + w, w):  # "Ġ": GPT-2's spelling of a leading space
            left = word[0]
            for c in word[1:]:
                if left + c not in tokens:
                    merges.append(f"{left} {c}")
                    tokens.append(left + c)
                left += c
    return tokens, merges


def _add_field(w, key: str, value, kind, item=None) -> None:
    if item is None:
        w.add_key_value(key, value, kind)
    else:
        w.add_key_value(key, value, kind, sub_type=item)


def add_gguf_tokenizer(w, kind: str, *, add_bos: bool, add_eos: bool = False, chat_template: str | None = None,
                       add_space_prefix: bool | None = None) -> int:
    """The tokenizer fields of a ``kind`` ("spm" or "bpe") vocabulary into a GGUFWriter; its size."""
    import gguf
    t = gguf.GGUFValueType
    if kind == "spm":
        tokens, scores, types = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(BOS_ID)
        w.add_eos_token_id(EOS_ID)
        w.add_unk_token_id(UNK_ID)
        w.add_pad_token_id(PAD_ID)
    else:
        tokens, merges = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3] * len(BPE_SPECIALS) + [1] * (len(tokens) - len(BPE_SPECIALS)))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    _add_field(w, "tokenizer.ggml.add_bos_token", add_bos, t.BOOL)
    _add_field(w, "tokenizer.ggml.add_eos_token", add_eos, t.BOOL)
    if add_space_prefix is not None:
        _add_field(w, "tokenizer.ggml.add_space_prefix", add_space_prefix, t.BOOL)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    return len(tokens)


def write_llama_gguf(path: str, kind: str, *, hidden: int = 32, seed: int = 0, **tokenizer_flags) -> str:
    """A one-layer random Llama GGUF over a ``kind`` vocabulary (see ``add_gguf_tokenizer`` for the flags)."""
    import gguf
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    vocab = add_gguf_tokenizer(w, kind, **tokenizer_flags)
    head = hidden // 2
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (2 * head, hidden), "blk.0.attn_k.weight": (head, hidden),
              "blk.0.attn_v.weight": (head, hidden), "blk.0.attn_output.weight": (hidden, 2 * head),
              "blk.0.ffn_gate.weight": (2 * hidden, hidden), "blk.0.ffn_up.weight": (2 * hidden, hidden),
              "blk.0.ffn_down.weight": (hidden, 2 * hidden)}
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        w.add_tensor(name, (np.ones(shape) if len(shape) == 1 else 0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_hf_tokenizer(path: str, kind: str, *, add_bos: bool, add_eos: bool = False,
                      chat_template: str | None = None, eos_ids: list[int] | None = None) -> int:
    """A tokenizer saved by transformers' own class into ``path``: "spm" -> LlamaTokenizer (BPE with byte
    fallback), "bpe" -> Qwen2Tokenizer (byte-level, tiktoken-style split); a tiny Llama config for
    random weights (--load-format dummy) and, with ``eos_ids``, a generation_config.json listing them.
    Returns the vocabulary size."""
    from transformers import LlamaTokenizer, Qwen2Tokenizer
    from transformers.tokenization_utils_base import generate_merges
    os.makedirs(path, exist_ok=True)
    if kind == "spm":
        tokens, scores, _ = spm_vocab()
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = generate_merges(vocab, dict(zip(tokens, scores)))
        tok = LlamaTokenizer(vocab=vocab, merges=merges, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                             pad_token="<pad>", add_bos_token=add_bos, add_eos_token=add_eos)
        tok.add_special_tokens({"additional_special_tokens": SPM_SPECIALS[4:]})
        bos, eos = BOS_ID, EOS_ID
    else:
        tokens, merges = bpe_vocab()
        tok = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges],
                             bos_token=BPE_SPECIALS[1],
                             eos_token=BPE_SPECIALS[2], add_bos_token=add_bos, add_eos_token=add_eos)
        bos, eos = 1, 2
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tokens),
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if eos_ids is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": bos, "eos_token_id": eos_ids}, f)
    return len(tokens)
