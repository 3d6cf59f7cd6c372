"""ServerArgs: the one configuration dataclass. The CLI is generated from its fields."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


REDACTED = "<redacted>"


def _f(default: Any, help: str, choices: tuple | None = None, *, secret: bool = False) -> Any:
    meta: dict[str, Any] = {"help": help, "secret": secret}
    if choices is not None:
        meta["choices"] = choices
    # a secret stays out of repr: a logged or raised ServerArgs must not carry it
    return field(default=default, metadata=meta, repr=not secret)


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    # model
    model_path: str | None = _f(None, "HF folder, GGUF file, or config folder (with --load-format dummy); "
                                      "absent: the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = _f(None, "tokenizer folder; defaults to the model's")
    load_format: str = _f("auto", "how to read weights", ("auto", "safetensors", "gguf", "dummy"))
    served_model_name: str | None = _f(None, "the model id the OpenAI API lists and accepts (with \"default\"); "
                                             "defaults to the model's own name: a hub id, a folder's name, a "
                                             "GGUF file's stem")
    is_embedding: bool = _f(False, "serve an embedding model: /v1/embeddings and /v1/rerank, pooled as the "
                                   "folder's sentence-transformers config says (docs/embeddings.md); "
                                   "generation routes are refused")
    context_length: int | None = _f(None, "max tokens per request (prompt + output); defaults to the model's")
    dtype: str = _f("auto", "model dtype; auto = float32 on CPU, bfloat16 on CUDA (on the CPU the KV pool and "
                                  "attention stay float32)",
                    ("auto", "float32", "float16", "bfloat16"))
    device: str = _f("auto", "auto, cpu or cuda", ("auto", "cpu", "cuda"))
    quantization: str | None = _f(None, "weight-only quantized linears on the CPU. int8 / int4: quantize a float "
                                        "checkpoint (lossy; int4 in groups of 32 with a scale and minimum each); "
                                        "gguf: serve a GGUF file's own quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, "
                                        "Q8_0, Q4_K, Q5_K, Q6_K). Absent with --dtype auto on the CPU: gguf for a "
                                        "GGUF file (the embedded model is Q4_1; tensors of other types load as "
                                        "float32); --dtype float32 dequantizes it all",
                                  (None, "int8", "int4", "gguf"))
    random_seed: int = _f(0, "seed for random weights and default sampling")
    num_threads: int | None = _f(None, "torch CPU threads per process; defaults to the cores available, "
                                          "divided among a node's processes (dp replicas x tensor-parallel ranks)")
    # memory and scheduling
    max_total_tokens: int | None = _f(None, "KV pool size in tokens; defaults from mem_fraction_static (a larger "
                                            "pool than the memory available is kept, with a warning)")
    mem_fraction_static: float | None = _f(None, "share of the device's total memory for the weights and the KV "
                                                 "pool together (SGLang's meaning) when max_total_tokens is unset; "
                                                 "auto: 0.88 on CUDA; on the CPU the pool gets a tenth of the host "
                                                 "memory the weights leave, split between the node's processes. "
                                                 "Never more than is available without a warning")
    max_running_requests: int = _f(256, "max requests decoding at once")
    max_prefill_tokens: int = _f(8192, "max new prompt tokens in one prefill batch")
    chunked_prefill_size: int = _f(2048, "split prompts longer than this into chunks (-1 disables)")
    swa_full_tokens_ratio: float = _f(0.8, "sliding-window models: KV slots of the window layers per slot of the "
                                           "full-attention layers (window layers drop the KV of tokens no query "
                                           "can see any more, so they need fewer)")
    disable_hybrid_swa_memory: bool = _f(False, "sliding-window models: keep every layer's KV for every token "
                                                "(one slot space, as for a model without windows)")
    schedule_policy: str = _f("lpm", "waiting-queue order", ("lpm", "dfs-weight", "fcfs"))
    disable_radix_cache: bool = _f(False, "turn off prefix sharing across requests")
    page_size: int = _f(1, "tokens per radix-tree page; only 1 is supported (the KV pool is token-granular)")
    # constrained decoding
    grammar_backend: str = _f("llguidance", "grammar engine: outlines (regex, json_schema), xgrammar and "
                                            "llguidance (regex, json_schema, ebnf, structural_tag); JSON-Schema "
                                            "keywords a backend does not enforce are refused (llguidance enforces "
                                            "the most: bench/constrained.py)",
                              ("outlines", "xgrammar", "llguidance"))
    disable_jump_forward: bool = _f(False, "decode forced grammar continuations token by token")
    constrained_json_whitespace_pattern: str | None = _f(None, "regex for the whitespace allowed between JSON tokens "
                                                               "(outlines, llguidance: any regex; xgrammar: '', "
                                                               "[ \\t\\n\\r]* or [ \\t\\n\\r]{0,N})")
    grammar_compile_timeout: float = _f(30.0, "seconds a grammar may take to check and compile (in a "
                                                  "worker process, killed past it) before its request fails")
    # speculative decoding
    speculative_algorithm: str | None = _f(None, "draft tokens and check them in one forward: ngram drafts the "
                                                 "tokens that followed the latest earlier occurrence of the "
                                                 "sequence's last n tokens (its own prompt and output), "
                                                 "standalone a draft model. Greedy output is unchanged; sampled "
                                                 "output keeps its distribution",
                                           (None, "ngram", "standalone"))
    speculative_num_draft_tokens: int | None = _f(None, "tokens drafted per request per step (default 4)")
    speculative_draft_model_path: str | None = _f(None, "the draft model of --speculative-algorithm standalone: a "
                                                        "smaller model with the target's vocabulary, drafting "
                                                        "greedily with its own KV pool")
    speculative_ngram_min_match_window_size: int = _f(1, "shortest suffix n-gram ngram drafting matches")
    speculative_ngram_max_match_window_size: int = _f(3, "longest suffix n-gram ngram drafting matches (tried first)")
    # LoRA adapters (docs/lora.md)
    enable_lora: bool = _f(False, "serve LoRA adapters (implied by --lora-paths); without it a request naming an "
                                  "adapter is a 400")
    lora_paths: tuple[str, ...] = _f((), "PEFT adapter folders to serve, as name=path (or a path: named after its "
                                         "folder); more can be loaded at run time (/load_lora_adapter)")
    max_loras_per_batch: int = _f(8, "most distinct adapters one batch runs (requests of others wait a step)")
    max_loaded_loras: int | None = _f(None, "most adapters holding weights at once; the least recently used one "
                                            "not running is evicted (read again from its folder when needed); "
                                            "default: no limit")
    # chat (OpenAI routes)
    chat_template: str | None = _f(None, "a Jinja chat template file, or a built-in one (chatml, gemma, llama-3), "
                                         "replacing the tokenizer's (a base model has none)")
    generation_config: str = _f("auto", "where a request's unset sampling fields (temperature, top_p, top_k, min_p, "
                                        "repetition_penalty) come from: auto (the model's generation_config.json), "
                                        "vllm (none: the built-in defaults) or a folder holding a "
                                        "generation_config.json")
    tool_call_parser: str = _f("auto", "tool-call format of the model's replies (auto: from the chat template's "
                                       "markers, else hermes)",
                               ("auto", "hermes", "qwen25", "qwen3", "llama3", "mistral", "deepseekv3", "pythonic",
                                "gpt-oss"))
    reasoning_parser: str | None = _f(None, "split the reply's reasoning into reasoning_content",
                                      (None, "deepseek-r1", "qwen3", "gpt-oss"))
    disable_tool_call_constraint: bool = _f(False, "with tool_choice auto, parse the model's tool calls as "
                                                   "written instead of holding each call, once its start marker "
                                                   "is written, to its tool's schema by a structural tag")
    # kernels
    attention_backend: str = _f("auto", "attention kernels (auto on CUDA: flashinfer where its kernels are prebuilt "
                                        "or its JIT finds nvcc and ninja, else triton; on the CPU, cpu when "
                                        "radixlang's CPU kernels build, else torch; the start log says why)",
                                ("auto", "torch", "cpu", "triton", "flashinfer"))
    disable_cpu_kernels: bool = _f(False, "use PyTorch ops instead of radixlang's compiled CPU kernels (fused "
                                          "norms, rotary, SwiGLU; paged decode attention)")
    disable_weight_packing: bool = _f(False, "keep plain float weights on the CPU instead of packing the linears "
                                             "into oneDNN's blocked layout (packed is faster: docs/cpu.md)")
    flashinfer_backend: str = _f("auto", "FlashInfer's prefill kernels (auto: the ragged prefill on fa3 on Hopper, "
                                         "fa2 elsewhere; the paged prefix prefill and decode on fa2; fa2 / fa3: "
                                         "both prefills on it)", ("auto", "fa2", "fa3"))
    disable_cuda_graph: bool = _f(False, "run decode eagerly on CUDA (graphs are captured at start for batch "
                                         "sizes 1, 2, 4, 8 and multiples of 8 up to cuda_graph_max_bs)")
    cuda_graph_max_bs: int = _f(160, "largest decode batch captured as a CUDA graph; larger ones run eagerly")
    # server
    host: str = _f("127.0.0.1", "HTTP bind address")
    port: int = _f(30000, "HTTP port")
    api_key: str | None = _f(None, "require 'Authorization: Bearer KEY' on every route but /health", secret=True)
    enable_metrics: bool = _f(True, "expose Prometheus /metrics")
    max_request_body_bytes: int = _f(16 * 1024 * 1024, "reject larger request bodies with 413")
    log_level: str = _f("info", "logging level", ("debug", "info", "warning", "error"))
    graceful_shutdown_timeout: float = _f(30.0, "on SIGTERM, seconds running requests may take before they "
                                                "are aborted (new requests get 503 meanwhile)")
    # scale out
    tp_size: int = _f(1, "tensor-parallel ranks: one process each, every layer split across them "
                         "(gloo on the CPU, nccl on CUDA with one GPU per rank)")
    nnodes: int = _f(1, "machines the tensor-parallel ranks span; tp_size ranks are split evenly over them")
    node_rank: int = _f(0, "this machine's index among nnodes; node 0 runs the scheduler and rank 0, the "
                           "others run only their ranks' forwards")
    dist_init_addr: str | None = _f(None, "host:port where rank 0 hosts torch.distributed's rendezvous; "
                                          "required with nnodes > 1; default: 127.0.0.1 and a free port")
    dp_size: int = _f(1, "data-parallel replicas: each loads its own weights and has its own KV pool and radix cache")
    base_gpu_id: int = _f(0, "CUDA: the first GPU this server uses; dp replica i runs its tensor-parallel ranks on "
                             "the GPUs from base_gpu_id + i x (tp_size / nnodes) on")
    load_balance_method: str = _f("cache_aware", "how requests are spread over dp replicas: cache_aware (the replica "
                                                 "whose prefix tree matches the prompt longest, unless that match is "
                                                 "short or the replica is overloaded) or round_robin",
                                  ("cache_aware", "round_robin"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        for name in ("max_running_requests", "max_prefill_tokens", "page_size", "tp_size", "dp_size",
                     "cuda_graph_max_bs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.page_size != 1:
            raise ValueError(f"page_size must be 1 (the KV pool is token-granular; paged KV is not implemented), "
                             f"got {self.page_size}")
        self._check_parallel()
        self._check_speculative()
        self._check_lora()
        if self.constrained_json_whitespace_pattern is not None:  # refused at start if the backend can't write it
            from radixlang.constrained.schema_policy import check_whitespace_pattern
            check_whitespace_pattern(self.grammar_backend, self.constrained_json_whitespace_pattern)
        if self.chat_template is not None:
            from radixlang.runtime.tokenizer_source import check_chat_template
            check_chat_template(self.chat_template)
        from radixlang.runtime.generation_config import check_generation_config
        check_generation_config(self.generation_config)
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be -1 or >= 1, got {self.chunked_prefill_size}")

    def _check_parallel(self) -> None:
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got node_rank {self.node_rank}, nnodes {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size must be a multiple of nnodes, got tp_size {self.tp_size}, nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0, reachable from every node)")
        if self.dist_init_addr is not None and not self.dist_init_addr.rpartition(":")[2].isdigit():
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.tp_size > 1 and self.quantization in ("int8", "int4"):  # gguf splits its blocks per rank
            raise ValueError(f"quantization {self.quantization!r} is not supported with tp_size > 1, "
                             f"got tp_size {self.tp_size}")

    def _check_lora(self) -> None:
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths))  # a list from JSON or a caller
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"max_loaded_loras must be >= max_loras_per_batch ({self.max_loras_per_batch}), got "
                             f"{self.max_loaded_loras}")
        named = lora_path_names(self.lora_paths)
        if len(set(named)) != len(named):
            raise ValueError(f"lora_paths names must be unique, got {', '.join(named)}")
        if not self.enable_lora:
            return
        for what, bad in (("tp_size > 1", self.tp_size > 1), ("--is-embedding", self.is_embedding),
                          ("speculative decoding", self.speculative_algorithm is not None)):
            if bad:
                raise ValueError(f"LoRA adapters (enable_lora / lora_paths) are not supported with {what}")

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is None:
            for name in ("speculative_num_draft_tokens", "speculative_draft_model_path"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs speculative_algorithm (ngram or standalone)")
            return
        draft = self.speculative_draft_model_path
        if self.speculative_algorithm == "standalone" and draft is None:
            raise ValueError("speculative_algorithm standalone needs speculative_draft_model_path")
        if self.speculative_algorithm == "ngram" and draft is not None:
            raise ValueError("speculative_draft_model_path is for speculative_algorithm standalone; ngram drafts "
                             "from the request's own tokens")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative n-gram windows must satisfy 1 <= min <= max, got min {lo}, max {hi}")

    def resolve(self) -> ServerArgs:
        """Resolve every "auto" once and log the choice."""
        import torch  # runtime-only dependency

        changes: dict[str, Any] = {}
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            changes["device"] = device
        if self.dtype == "auto":
            changes["dtype"] = "bfloat16" if device == "cuda" else "float32"
            if (device == "cpu" and self.quantization is None
                    and self.load_format in ("auto", "gguf") and _is_gguf_model(self.model_path, self.load_format)):
                changes["quantization"] = "gguf"
        dtype = changes.get("dtype", self.dtype)
        if self.attention_backend == "auto":
            backend, why = _pick_attention_backend(device, self.disable_cpu_kernels, dtype)
            changes["attention_backend"] = backend
            logger.info("attention backend auto -> %s: %s", backend, why)
        if self.mem_fraction_static is None and device == "cuda":  # the CPU's default depends on the model
            from radixlang.runtime.model_executor.kv_sizing import CUDA_MEM_FRACTION
            changes["mem_fraction_static"] = CUDA_MEM_FRACTION
        if self.num_threads is None and device == "cpu":
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            # every process of the node shares its cores: each dp replica's tensor-parallel ranks on this node
            changes["num_threads"] = max(1, cores // (self.dp_size * (self.tp_size // self.nnodes)))
        if self.served_model_name is None:
            changes["served_model_name"] = _own_model_name(self.model_path)
        if changes:
            logger.info("resolved: %s", ", ".join(f"{k}={v}" for k, v in changes.items()))
        return dataclasses.replace(self, **changes)

    def for_replica(self, index: int) -> ServerArgs:
        """The args dp replica ``index`` runs with: on CUDA, its GPUs start after the earlier replicas' ones."""
        if not 0 <= index < self.dp_size:
            raise ValueError(f"dp replica index must be in [0, {self.dp_size}), got {index}")
        if index == 0:
            return self
        return dataclasses.replace(self, base_gpu_id=self.base_gpu_id + index * (self.tp_size // self.nnodes))

    def to_dict(self) -> dict[str, Any]:
        """Every field, secrets included: for the server's own processes, never for a reply or a log."""
        return dataclasses.asdict(self)

    def to_public_dict(self) -> dict[str, Any]:
        """``to_dict`` with each secret that is set replaced by REDACTED: what info routes report."""
        out = self.to_dict()
        for f in dataclasses.fields(self):
            if f.metadata.get("secret") and out[f.name] is not None:
                out[f.name] = REDACTED
        return out

    # -- CLI generated from the fields -------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            help_text = f.metadata.get("help", "")
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            elif kind is tuple:
                parser.add_argument(flag, nargs="*", default=f.default, help=help_text)
            else:
                parser.add_argument(flag, type=kind, default=f.default, choices=f.metadata.get("choices"),
                                    help=f"{help_text} (default: {f.default})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _base_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return typing.get_origin(hint) or hint


def lora_path_names(lora_paths: tuple[str, ...]) -> list[str]:
    """The adapter names of --lora-paths entries (name=path, or a path named after its folder)."""
    return [split_lora_path(entry)[0] for entry in lora_paths]


def split_lora_path(entry: str) -> tuple[str, str]:
    """A --lora-paths entry -> (name, path)."""
    name, sep, path = entry.partition("=")
    if not sep:
        path = entry
        name = os.path.basename(entry.rstrip("/" + os.sep))
    if not name or not path:
        raise ValueError(f"lora_paths entries must be name=path or a folder, got {entry!r}")
    return name, path


def _own_model_name(model_path: str | None) -> str:
    """A model's own name, never a path of this machine: a hub id as given, a folder's name, a GGUF
    file's stem (the embedded model's when no path is given)."""
    if model_path is None:
        from radixlang.runtime.models.loader.model_loader import default_model_path
        try:
            model_path = default_model_path()
        except FileNotFoundError:  # the scheduler reports the missing model; the name is moot
            return "default"
    path = model_path.rstrip("/" + os.sep)
    if not os.path.exists(path) and path.count("/") == 1:  # a hub id: org/name
        return path
    name = os.path.basename(path) or "default"
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def _is_gguf_model(model_path: str | None, load_format: str) -> bool:
    """Whether the model is a GGUF file, whose tensors stored in native block types are then served from
    their blocks (--quantization gguf). Decided from the path alone: the file is opened once per start, by
    the loader, whose header read picks each linear's method (a file of float tensors only serves them as
    floats)."""
    from radixlang.runtime.models.loader.model_loader import gguf_source

    try:
        return gguf_source(model_path, load_format) is not None
    except (OSError, ValueError):  # a missing model: the loader reports it with its own message
        return False


def _pick_attention_backend(device: str, disable_cpu_kernels: bool = False,
                            dtype: str = "bfloat16") -> tuple[str, str]:
    """The backend "auto" stands for, and why (for the start log)."""
    if device != "cuda":
        if device == "cpu" and not disable_cpu_kernels:
            from radixlang.kernels import cpu as cpu_ops
            if cpu_ops.available():
                return "cpu", "radixlang's CPU kernels build here"
        return "torch", "the CPU kernels are disabled or do not build" if device == "cpu" else f"device {device}"
    if dtype == "float32":  # FlashInfer runs float16 / bfloat16 only; triton and torch run float32 too
        why = "FlashInfer runs float16 / bfloat16 only, the dtype is float32"
    else:
        from radixlang.kernels.attention.flashinfer_probe import flashinfer_status
        status = flashinfer_status()
        if status.usable:
            return "flashinfer", f"FlashInfer can run: {status.reason}"
        why = f"FlashInfer cannot run: {status.reason}"
    try:
        import triton  # noqa: F401
        return "triton", why
    except ImportError:
        return "torch", f"{why}; triton is not installed"
