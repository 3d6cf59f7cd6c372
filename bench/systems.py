"""System adapters for bench.run_all: each opens a DSL backend and reports token counters.

A system is what a user would pick instead of radixlang, driven by the same DSL programs,
prompts and token budgets. Counters (prompt, cached, completion tokens) are read per run so
the runner can report tokens/s and the prompt-token cache hit rate.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from radixlang.lang.backends.base import Backend, GenParams, check_choices
from radixlang.lang.backends.engine import EngineBackend
from radixlang.lang.backends.runtime import Runtime
from radixlang.lang.chat_template import ChatTemplate, from_jinja, match_chat_template
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, decide


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class CountingEngineBackend(EngineBackend):
    """EngineBackend that sums completion tokens; prompt/cached tokens come from the engine's own counters."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self._count_lock = threading.Lock()
        self.completion_tokens = 0

    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        text, meta = super().generate(state_text, sampling, messages=messages)
        with self._count_lock:
            self.completion_tokens += int(meta.get("completion_tokens", 0))
        return text, meta

    def counters(self) -> Counters:
        info = self.engine.get_server_info()
        return Counters(int(info.get("prompt_tokens", 0)), int(info.get("cached_tokens", 0)), self.completion_tokens)


class TransformersBackend(Backend):
    """The naive baseline: HF generate for gen and one forward pass per choice for select, no KV reuse.

    Constrained decoding is not part of plain transformers, so a json_schema/regex gen raises ValueError
    (the runner reports that workload as an error row for this system)."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        from bench.common import load_hf
        self.folder = folder
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = load_hf(folder)
        self._lock = threading.Lock()  # one forward at a time: the baseline serves one request at a time
        self._counters = Counters()

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, state_text: str, sampling: GenParams, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        params = sampling.sampling_params
        if params.get("json_schema") or params.get("regex"):
            raise ValueError("the transformers baseline has no constrained decoding")
        ids = self._encode(state_text)
        stop = params.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        new = int(params.get("max_new_tokens", 16))
        with self._lock, torch.no_grad():
            kw: dict[str, Any] = {"stop_strings": stop, "tokenizer": self.tokenizer} if stop else {}
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                      pad_token_id=self.tokenizer.eos_token_id, **kw)
        gen_ids = out[0, len(ids):].tolist()
        text = self.tokenizer.decode(gen_ids, skip_special_tokens=True)
        for s in stop:  # generate stops after the stop string; the DSL contract drops it
            if s in text:
                text = text[:text.index(s)]
        with self._lock:
            self._counters.prompt_tokens += len(ids)
            self._counters.completion_tokens += len(gen_ids)
        return text, {"prompt_tokens": len(ids), "completion_tokens": len(gen_ids), "cached_tokens": 0,
                      "finish_reason": {"type": "length"}}

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        choices = check_choices(choices)
        prefix_len = len(self._encode(state_text))
        rows = []
        for c in choices:  # SGLang paper's baseline: a full forward pass per choice
            ids = self._encode(state_text + c)
            start = min(max(prefix_len, 1), len(ids) - 1)
            with self._lock, torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0].float()
                self._counters.prompt_tokens += len(ids)
            logp = torch.log_softmax(logits[start - 1:-1], dim=-1)
            target = ids[start:]
            rows.append([(float(logp[i, t]), t, None) for i, t in enumerate(target)])
        return decide(choices_method, choices, rows, None)

    @property
    def chat_template(self) -> ChatTemplate:
        source = getattr(self.tokenizer, "chat_template", None)
        derived = from_jinja(source, bos_token=self.tokenizer.bos_token or "",
                             eos_token=self.tokenizer.eos_token or "") if isinstance(source, str) else None
        return derived or match_chat_template(self.folder)

    def counters(self) -> Counters:
        with self._lock:
            return Counters(**vars(self._counters))


class CountingRuntime(Runtime):
    """The radixlang HTTP server launched by the DSL's Runtime; counters from its /get_server_info."""

    def counters(self) -> Counters:
        info = self.get_server_info()
        return Counters(int(info.get("prompt_tokens", 0)), int(info.get("cached_tokens", 0)),
                        int(info.get("generated_tokens", 0)))


@dataclass(frozen=True)
class System:
    """name, how many programs run at once, and how to open/close its backend.

    ``workloads``: the only workloads it runs (None: all); ``missing()`` says why it cannot run here."""
    name: str
    concurrency: int
    workloads: tuple[str, ...] | None = None

    def open(self, model_dir: str) -> Any:
        raise NotImplementedError

    def missing(self) -> str | None:
        return None

    def runs(self, workload: str) -> bool:
        return self.workloads is None or workload in self.workloads


@dataclass(frozen=True)
class RadixSystem(System):
    """``gguf``: open the embedded GGUF file itself, so the Engine serves its quantized blocks
    (--quantization gguf, the default for a quantized GGUF); otherwise the dequantized float32 folder."""
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    gguf: bool = False

    def open(self, model_dir: str) -> CountingEngineBackend:
        from bench.common import threads
        from radixlang import Engine
        from radixlang.runtime.models.loader.model_loader import default_model_path
        kwargs = {"max_total_tokens": 65536, "num_threads": threads(), **dict(self.engine_kwargs)}
        engine = Engine(model_path=default_model_path() if self.gguf else model_dir, **kwargs)
        return CountingEngineBackend(engine)


@dataclass(frozen=True)
class ServerSystem(System):
    def open(self, model_dir: str) -> CountingRuntime:
        from bench.common import threads
        return CountingRuntime(model_path=model_dir, max_total_tokens=65536, num_threads=threads(), log_level="warning")


@dataclass(frozen=True)
class TransformersSystem(System):
    def open(self, model_dir: str) -> TransformersBackend:
        return TransformersBackend(model_dir)


def _missing(module: str, how: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{module} does not import ({e}); {how}"
    return None


@dataclass(frozen=True)
class LlamaCppSystem(System):
    def open(self, model_dir: str) -> Any:
        from bench.common import threads
        from bench.peers import LlamaCppBackend
        from radixlang.runtime.models.loader.model_loader import default_model_path
        return LlamaCppBackend(default_model_path(), model_dir, n_threads=threads())

    def missing(self) -> str | None:
        return _missing("llama_cpp", "pip install llama-cpp-python to add it")


@dataclass(frozen=True)
class LlamaServerSystem(System):
    """llama.cpp's C++ llama-server (bench/llama_server.py) on the same GGUF, ``concurrency`` parallel slots
    with continuous batching and per-slot prompt caching, driven over HTTP."""

    def open(self, model_dir: str) -> Any:
        from bench.common import threads
        from bench.llama_server import LlamaServer, LlamaServerBackend
        from radixlang.runtime.models.loader.model_loader import default_model_path
        server = LlamaServer(default_model_path(), parallel=self.concurrency, threads=threads())
        return LlamaServerBackend(server, model_dir)

    def missing(self) -> str | None:
        from bench.llama_server import binary_path
        if not binary_path().exists():
            return f"no llama-server at {binary_path()}; python -m bench.llama_server --build to add it"
        return None


@dataclass(frozen=True)
class OutlinesSystem(System):
    def open(self, model_dir: str) -> Any:
        from bench.peers import OutlinesBackend
        return OutlinesBackend(model_dir)

    def missing(self) -> str | None:
        return _missing("outlines", "pip install outlines to add it")


def close(backend: Any) -> None:
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.shutdown()
    else:
        backend.shutdown()


def default_systems(concurrency: int) -> list[System]:
    """Every system that can run here; the others are skipped with a message."""
    systems = [RadixSystem("radixlang", concurrency),
               # weights and activations in bfloat16 (KV and attention stay float32 on the CPU): lossy, and
               # only fast on CPUs with native bf16 dot products (AVX512-BF16, AMX)
               RadixSystem("radixlang_bf16", concurrency, engine_kwargs=(("dtype", "bfloat16"),)),
               RadixSystem("radixlang_no_cache", concurrency, engine_kwargs=(("disable_radix_cache", True),)),
               ServerSystem("radixlang_server", concurrency),
               TransformersSystem("transformers", 1),
               # the GGUF's own Q4_1 / Q8_0 blocks on the quantized kernels (the default for that file)
               RadixSystem("radixlang_gguf", concurrency, gguf=True),
               # llama.cpp's own server, as its users serve: parallel slots batched continuously
               LlamaServerSystem("llama-server", concurrency),
               # the Python binding, one program at a time (a second, labelled column)
               LlamaCppSystem("llama.cpp", 1),
               OutlinesSystem("outlines", 1, workloads=("json_extraction",))]
    for system in systems:
        if system.missing():
            print(f"skipping {system.name}: {system.missing()}")
    return [system for system in systems if not system.missing()]
