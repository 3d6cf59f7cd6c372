"""A GGUF file's tensors as a Hugging Face checkpoint: (HF name, tensor) pairs read from the file at load
time, one tensor at a time, for ``load_weights`` (no converted copy of the weights is ever written).

Architectures (``general.architecture``): llama (Llama, Mistral, SmolLM; Mixtral when it has experts),
qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3 (text), phi3, deepseek2 (DeepSeek-V2 / V3), gpt-oss. Per tensor:
``hf_tensor_name`` (llama.cpp's name -> the HF checkpoint name, per architecture), ``dequantize_tensor``
(the `gguf` package, to float32 whatever the stored type; ``load_weights`` copies it into a parameter of
the model's dtype), ``restore_layout`` (llama.cpp's permuted Q/K rows on llama back to rotate_half's).
Per architecture besides: Gemma's norms are stored by llama.cpp as 1 + w (the offset is taken off
again); stacked expert tensors (``ffn_gate_exps`` [experts, inter, hidden]) are read one expert at a
time, as one HF tensor each; DeepSeek's ``attn_k_b`` [heads, rank, nope] and ``attn_v_b``
[heads, v, rank] (newer llama.cpp files split ``kv_b_proj`` so) are joined back into ``kv_b_proj``.
llama.cpp keeps DeepSeek's interleaved rope rows as the HF checkpoint has them (ggml's "normal" rope
turns adjacent pairs), so MLA de-interleaves them at load as for a HF folder (layers/mla.py). Phi-3's
longrope factor tensors belong to the config (gguf_convert.py), not to the weights. GPT-OSS keeps its
experts stacked as its checkpoint does: llama.cpp's ``ffn_gate_exps`` and ``ffn_up_exps`` (and their biases)
are interleaved back into ``gate_up_proj`` [experts, hidden, 2 * inter] (gate columns even, up odd), and
``ffn_down_exps`` [experts, hidden, inter] is transposed back into ``down_proj`` [experts, inter, hidden].
The file's header is read by gguf_file.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch

from radixlang.runtime.models.loader.gguf_file import GGUFFile, TensorInfo

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# "{e}": a stacked tensor [experts, ...] that becomes one HF tensor per expert
_EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
            "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_MOE_MAP = {
    **_LAYER_MAP, **_EXPERTS, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_MIXTRAL_MAP = {
    **_LAYER_MAP, "ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3", "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP
_GEMMA_MAP = {**_LAYER_MAP, "post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps q/k/v fused, and gate/up fused in ffn_up (gate rows first), as its HF checkpoint does
_PHI3_MAP = {**_LAYER_MAP, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# DeepSeek-V2/V3: MLA (attn_q without q_lora_rank, else attn_q_a / attn_q_a_norm / attn_q_b), the dense
# first layers as Llama's, MoE layers with shared experts and (V3) the selection bias; "kind.leaf" keys
# name a whole tensor
_DEEPSEEK_MAP = {
    **_LAYER_MAP, **_EXPERTS, "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj", "attn_v_b": "self_attn.kv_b_proj",  # joined: see _kv_b_piece
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# GPT-OSS: biased q/k/v/o and router, a sink logit per head, stacked experts with biases (joined and
# transposed back: _gpt_oss_piece); llama.cpp's post_attention_norm is the norm before the MoE
_GPT_OSS_MAP = {
    **_LAYER_MAP, "post_attention_norm": "post_attention_layernorm", "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router", "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj", "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias", "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope factors


@dataclass(frozen=True)
class GGUFArch:
    model_type: str  # transformers' model_type
    hf_arch: str  # the HF architecture (the registry's key)
    layer_map: dict[str, str]
    norm_offset: float = 0.0  # llama.cpp stores Gemma's norm weights w as 1 + w


GGUF_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", _LAYER_MAP),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", _LAYER_MAP),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", _LAYER_MAP),
    "qwen2moe": GGUFArch("qwen2_moe", "Qwen2MoeForCausalLM", _MOE_MAP),
    "qwen3moe": GGUFArch("qwen3_moe", "Qwen3MoeForCausalLM", _MOE_MAP),
    "gemma2": GGUFArch("gemma2", "Gemma2ForCausalLM", _GEMMA_MAP, norm_offset=1.0),
    "gemma3": GGUFArch("gemma3_text", "Gemma3ForCausalLM", _GEMMA_MAP, norm_offset=1.0),
    "phi3": GGUFArch("phi3", "Phi3ForCausalLM", _PHI3_MAP),
    "deepseek2": GGUFArch("deepseek_v2", "DeepseekV2ForCausalLM", _DEEPSEEK_MAP),
    "gpt-oss": GGUFArch("gpt_oss", "GptOssForCausalLM", _GPT_OSS_MAP),
}
MIXTRAL = GGUFArch("mixtral", "MixtralForCausalLM", _MIXTRAL_MAP)  # llama with experts
DEEPSEEK_V3 = GGUFArch("deepseek_v3", "DeepseekV3ForCausalLM", _DEEPSEEK_MAP)  # deepseek2, sigmoid routing
SIGMOID_GATING = 2  # llama.cpp's expert_gating_func: 1 softmax (V2, and the default), 2 sigmoid (V3)


def gguf_arch(arch: str, expert_count: int = 0, gating_func: int = 0) -> GGUFArch:
    """How a GGUF architecture maps to ours; a ValueError naming it and the supported ones."""
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    if arch == "llama" and expert_count > 0:
        return MIXTRAL
    if arch == "deepseek2" and gating_func == SIGMOID_GATING:
        return DEEPSEEK_V3
    return GGUF_ARCHS[arch]


def file_arch(fields: dict[str, Any]) -> tuple[str, GGUFArch]:
    """(general.architecture, how it maps) of a GGUF file's metadata."""
    arch = str(fields.get("general.architecture"))
    experts = int(fields.get(f"{arch}.expert_count", 0) or 0)
    return arch, gguf_arch(arch, experts, int(fields.get(f"{arch}.expert_gating_func", 0) or 0))


def hf_tensor_name(gguf_name: str, arch: str = "llama", expert_count: int = 0) -> str:
    """llama.cpp's tensor name (blk.3.attn_q.weight) -> the HF checkpoint's (model.layers.3.self_attn.q_proj.weight).

    A stacked expert tensor's name holds ``{e}`` where the expert index goes."""
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        if parts[0] not in _TOP_MAP:
            raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here (architecture {arch})")
        return f"{_TOP_MAP[parts[0]]}.{parts[-1]}"
    table = gguf_arch(arch, expert_count).layer_map
    whole = f"{parts[2]}.{parts[-1]}"
    if whole in table:
        return f"model.layers.{parts[1]}.{table[whole]}"
    if parts[2] not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here (architecture {arch})")
    return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[-1]}"


def restore_layout(arch: str, gguf_name: str, arr: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """llama.cpp permutes Q and K rows (weights and biases) of ``llama`` only; other archs keep HF's layout."""
    if arch != "llama":
        return arr
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if kind == "attn_q":
        return _unpermute(arr, n_head)
    if kind == "attn_k":
        return _unpermute(arr, n_kv)
    return arr


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the rotary halves of each head; restore HF's rotate_half layout
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: Any, data: np.ndarray | None = None) -> np.ndarray:
    """A GGUF tensor (gguf_file.TensorInfo, or a GGUFReader's) or ``data``, a slice of its stored rows, as a
    new float32 array whatever the stored type; its shape is the stored rows', [..., row length]."""
    import gguf

    raw = t.data if data is None else data
    try:
        arr = gguf.quants.dequantize(raw, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be read "
                         f"(no dequantization for it in the gguf package)") from e
    if arr.dtype == np.float32 and arr.flags.writeable and arr.flags.c_contiguous:
        return arr  # already a new array (not a view of the read-only file)
    return np.array(arr, dtype=np.float32)


def hf_shape(t: Any) -> list[int]:
    """A GGUF tensor's shape in HF's order ([out, in]; ggml lists the row length first)."""
    return [int(d) for d in reversed(t.shape)]


def check_readable(tensors: list[TensorInfo]) -> None:
    """Refuse a file holding a tensor type the gguf package cannot dequantize (one row of each tried)."""
    for t in tensors:
        dequantize_tensor(t, t.data.reshape(-1, t.data.shape[-1])[:1])


class _Piece(NamedTuple):
    """One HF tensor of a GGUF file: its name, shape, and how to read it (float32)."""
    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]


class _Layout(NamedTuple):
    """What reading a tensor needs beyond the tensor: the architecture and its head counts."""
    arch: str
    spec: GGUFArch
    n_head: int
    n_kv: int
    n_experts: int


def _layout(fields: dict[str, Any]) -> _Layout:
    arch, spec = file_arch(fields)
    n_head = int(fields[f"{arch}.attention.head_count"])
    n_kv = int(fields.get(f"{arch}.attention.head_count_kv", n_head))
    return _Layout(arch, spec, n_head, n_kv, int(fields.get(f"{arch}.expert_count", 0) or 0))


def _plain_piece(t: Any, name: str, lay: _Layout) -> _Piece:
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else t.name.split(".")[0]
    offset = np.float32(lay.spec.norm_offset if kind.endswith("norm") else 0.0)
    shape = tuple(hf_shape(t))

    def load() -> np.ndarray:
        arr = restore_layout(lay.arch, t.name, dequantize_tensor(t).reshape(shape), lay.n_head, lay.n_kv)
        return arr - offset if offset else arr

    return _Piece(name, shape, load)


def _expert_pieces(t: Any, name: str) -> list[_Piece]:
    """One piece per expert of a stacked tensor, each dequantized from its own rows of the file."""
    shape = tuple(hf_shape(t))

    def piece(e: int) -> _Piece:
        return _Piece(name.format(e=e), shape[1:], lambda: dequantize_tensor(t, t.data[e]).reshape(shape[1:]))

    return [piece(e) for e in range(shape[0])]


def _kv_b_piece(k_b: Any, v_b: Any, name: str) -> _Piece:
    """kv_b_proj [heads * (nope + v), rank] from llama.cpp's k_b [heads, rank, nope] and v_b [heads, v, rank]."""
    (heads, rank, nope), v = hf_shape(k_b), hf_shape(v_b)[1]

    def load() -> np.ndarray:
        k = dequantize_tensor(k_b).reshape(heads, rank, nope).transpose(0, 2, 1)
        joined = np.concatenate([k, dequantize_tensor(v_b).reshape(heads, v, rank)], axis=1)
        return joined.reshape(heads * (nope + v), rank)

    return _Piece(name, (heads * (nope + v), rank), load)


def _gpt_oss_piece(t: Any, name: str, by_name: dict[str, Any]) -> _Piece | None:
    """GPT-OSS's stacked expert tensors in its checkpoint's layout: gate_up_proj(_bias) from llama.cpp's
    gate and up halves (None for the up half: it comes with the gate's piece), down_proj transposed."""
    layer, kind, leaf = t.name.split(".")[1], t.name.split(".")[2], t.name.split(".")[-1]
    if kind == "ffn_up_exps":
        return None
    if kind == "ffn_down_exps":
        e, hidden, inter = hf_shape(t)
        return _Piece(name, (e, inter, hidden),
                      lambda: np.ascontiguousarray(dequantize_tensor(t).reshape(e, hidden, inter).transpose(0, 2, 1)))
    up = by_name.get(f"blk.{layer}.ffn_up_exps.{leaf}")
    if up is None:
        raise ValueError(f"GGUF tensor {t.name} has no blk.{layer}.ffn_up_exps.{leaf} beside it")
    shape = hf_shape(t)  # weight [experts, inter, hidden]; bias [experts, inter]

    def load() -> np.ndarray:
        gate, ups = (dequantize_tensor(x).reshape(shape) for x in (t, up))
        if leaf == "weight":  # [experts, hidden, 2 * inter]: gate columns even, up odd
            gate, ups = gate.transpose(0, 2, 1), ups.transpose(0, 2, 1)
        out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), np.float32)
        out[..., 0::2], out[..., 1::2] = gate, ups
        return out

    joined = (shape[0], shape[2], 2 * shape[1]) if leaf == "weight" else (shape[0], 2 * shape[1])
    return _Piece(name, joined, load)


def _pieces(gguf_file: GGUFFile, raw: set[str]) -> list[_Piece]:
    """The float pieces of every tensor but the config's and those in ``raw`` (streamed as blocks)."""
    lay = _layout(gguf_file.fields)
    by_name = {t.name: t for t in gguf_file.tensors}
    pieces = []
    for t in gguf_file.tensors:
        if t.name in CONFIG_TENSORS or t.name in raw:
            continue
        name = hf_tensor_name(t.name, lay.arch, lay.n_experts)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if lay.arch == "gpt-oss" and (kind in ("ffn_gate_exps", "ffn_up_exps") or
                                      t.name.endswith("ffn_down_exps.weight")):
            piece = _gpt_oss_piece(t, name, by_name)
            if piece is not None:
                pieces.append(piece)
        elif kind in ("attn_k_b", "attn_v_b"):
            layer = t.name.split(".")[1]
            if kind == "attn_k_b" and f"blk.{layer}.attn_kv_b.weight" not in by_name:
                pieces.append(_kv_b_piece(t, _pair(by_name, layer), name))
        elif "{e}" in name:
            pieces.extend(_expert_pieces(t, name))
        else:
            pieces.append(_plain_piece(t, name, lay))
    seen: set[str] = set()
    for p in pieces:
        if p.name in seen:
            raise ValueError(f"GGUF file holds tensor {p.name!r} twice")
        seen.add(p.name)
    return pieces


def _pair(by_name: dict[str, Any], layer: str) -> Any:
    v_b = by_name.get(f"blk.{layer}.attn_v_b.weight")
    if v_b is None:
        raise ValueError(f"GGUF tensor blk.{layer}.attn_k_b.weight has no blk.{layer}.attn_v_b.weight beside it")
    return v_b


class RawRoutes(NamedTuple):
    """Where a GGUF file's tensors go raw (a quantized model's block weights: models/gguf_quant.py):
    ``loaders`` {tensor name: the weight loaders its raw blocks are streamed into}; ``dequantized_too``: of
    those, the ones the float model loads as well (a tied head's embedding table, also the lookups')."""
    loaders: dict[str, list[Callable[[TensorInfo], None]]]
    dequantized_too: frozenset[str] = frozenset()


def gguf_weights(gguf_file: GGUFFile, *, routes: RawRoutes | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of a GGUF file (its header read by ``read_gguf``), read
    one at a time: only the tensor being copied is ever dequantized in memory. A tensor ``routes`` names is
    streamed raw into its loaders instead (first, in the file's order), and dequantized too only where
    ``routes.dequantized_too`` says so."""
    raw: set[str] = set()
    if routes is not None:
        for t in gguf_file.tensors:
            for load in routes.loaders.get(t.name, ()):
                load(t)
        raw = set(routes.loaders) - routes.dequantized_too
    for piece in _pieces(gguf_file, raw):
        yield piece.name, torch.from_numpy(piece.load())
