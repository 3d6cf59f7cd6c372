"""GGUF files at the published shapes of the models people serve on CPUs, with random weights, quantized by
llama.cpp's own ``llama-quantize`` (issue #44 item 1).

Speed depends on shapes and on the quantization mix, not on the weights' values, so a benchmark may use
random weights as long as both servers read the same file. Each shape is written once as F16 with the
``gguf`` package (one tensor at a time: the 8B file never sits in memory), then quantized by
``llama-quantize`` built from the same llama.cpp tree as ``llama-server`` (``bench.llama_server``), so a
``Q4_K_M`` file carries exactly llama.cpp's mix (Q4_K beside Q6_K ``attn_v`` / half the ``ffn_down``,
Q5_0 where rows do not fit 256-blocks). Files go under ``$RADIXLANG_CACHE/shapes/`` (default
``~/.cache/radixlang/shapes/``) and are reused::

    python -m bench.real_shapes --shapes llama-3.2-1b gemma-3-270m --types Q4_K_M Q8_0

The tokenizer is the embedded SmolLM2's byte-level BPE, its vocabulary padded with plain tokens up to the
shape's vocabulary size (unreachable by its merges, so tokenization is SmolLM2's while the embedding and the
logits have the real size). An 8B file is skipped with a message when free memory or disk cannot hold it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    context: int
    qk_norm: bool = False
    window: int = 0  # gemma3: sliding window of the local layers, every ``global_every``-th layer is global
    global_every: int = 0
    rope_theta_local: float = 10000.0

    def weight_count(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (attn + mlp) + self.vocab * self.hidden * (1 if self.tied else 2)


# published configs (hidden size, layers, heads, kv heads, head dim, intermediate size, vocabulary, tying)
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 131072),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, 131072),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1000000.0, 40960, qk_norm=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 131072),
    "gemma-3-270m": Shape("gemma3", 640, 18, 4, 1, 256, 2048, 262144, True, 1000000.0, 32768, qk_norm=True,
                          window=512, global_every=6),
}
TYPES = ("Q4_K_M", "Q8_0")


def shapes_dir() -> Path:
    return Path(os.environ.get("RADIXLANG_CACHE", Path.home() / ".cache" / "radixlang")) / "shapes"


def _log(msg: str) -> None:
    print(f"[real_shapes] {msg}", file=sys.stderr, flush=True)


def _embedded_tokenizer() -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array item type) of the embedded SmolLM2 GGUF's tokenizer fields."""
    import gguf

    from radixlang.runtime.models.loader.model_loader import default_model_path
    reader = gguf.GGUFReader(default_model_path())
    return [(key, field.contents(), field.types[0], field.types[-1]) for key, field in reader.fields.items()
            if key.startswith("tokenizer.")]


def _add_tokenizer(w: Any, vocab: int) -> None:
    import gguf
    for key, value, kind, item in _embedded_tokenizer():
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [f"<pad{i}>" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [int(gguf.TokenType.NORMAL)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * (vocab - len(value))
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=item)
        else:
            w.add_key_value(key, value, kind)


def _tensors(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape: rows = output features) of every tensor of the shape."""
    out = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (s.heads * s.head_dim, s.hidden)),
                (b + "attn_k.weight", (s.kv_heads * s.head_dim, s.hidden)),
                (b + "attn_v.weight", (s.kv_heads * s.head_dim, s.hidden)),
                (b + "attn_output.weight", (s.hidden, s.heads * s.head_dim)), (b + "ffn_norm.weight", (s.hidden,)),
                (b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden)),
                (b + "ffn_down.weight", (s.hidden, s.ffn))]
        if s.qk_norm:
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,))]
        if s.arch == "gemma3":
            out += [(b + "post_attention_norm.weight", (s.hidden,)), (b + "post_ffw_norm.weight", (s.hidden,))]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden)))
    return out


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:  # norms: near one (gemma's GGUF norms hold 1 + w, llama.cpp adds nothing)
        return (1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32)
    # scaled so activations stay in range through the layers: std 1/sqrt(fan_in)
    return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(np.float16)


def write_f16(name: str, path: Path, *, seed: int = 0) -> None:
    """The shape ``name`` as an F16 GGUF (norms F32), streamed one tensor at a time."""
    import gguf
    s = SHAPES[name]
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"random {name}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-6 if s.arch != "llama" else 1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if s.arch == "gemma3":
        w.add_sliding_window(s.window)
        w.add_rope_freq_base_swa(s.rope_theta_local)
        w.add_sliding_window_pattern([(i + 1) % s.global_every != 0 for i in range(s.layers)])
    _add_tokenizer(w, s.vocab)
    specs = _tensors(s)
    for tname, shape in specs:
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, shape in specs:
        w.write_tensor_data(_values(tname, shape, rng))
    w.close()


def quantize_binary() -> Path:
    from bench.llama_server import cache_dir
    return cache_dir() / "bin" / "llama-quantize"


def _fits(s: Shape, folder: Path) -> str | None:
    """Why the shape's files cannot be made here, or None."""
    f16 = 2 * s.weight_count()
    free_disk = shutil.disk_usage(folder).free
    if free_disk < 2 * f16:
        return f"needs {2 * f16 / 2**30:.1f} GiB of disk for F16 + quantized, {free_disk / 2**30:.1f} GiB free"
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if avail < 0.75 * f16:  # serving its Q8_0 needs ~half the F16 size, twice (one per server)
        return f"needs ~{0.75 * f16 / 2**30:.1f} GiB of free memory to serve, {avail / 2**30:.1f} GiB available"
    return None


def make(name: str, qtype: str, *, seed: int = 0) -> Path | None:
    """The shape's file in ``qtype`` (``F16`` or a llama-quantize type), made if missing; None (with a
    message) when this machine cannot hold it."""
    folder = shapes_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.{qtype}.gguf"
    if out.exists():
        return out
    why = _fits(SHAPES[name], folder)
    if why is not None:
        _log(f"skipping {name}: {why}")
        return None
    f16 = folder / f"{name}.F16.gguf"
    if not f16.exists():
        _log(f"writing {f16.name}")
        part = f16.with_suffix(".part")
        write_f16(name, part, seed=seed)
        part.rename(f16)
    if qtype == "F16":
        return f16
    binary = quantize_binary()
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: build it with `python -m bench.llama_server --build`")
    _log(f"quantizing {f16.name} to {qtype}")
    part = out.with_suffix(".part")
    subprocess.run([str(binary), str(f16), str(part), qtype, str(os.cpu_count() or 1)], check=True,
                   stdout=subprocess.DEVNULL)
    part.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--types", nargs="*", default=list(TYPES), help="F16 or llama-quantize types")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 files after quantizing")
    args = ap.parse_args(argv)
    for name in args.shapes:
        for qtype in args.types:
            path = make(name, qtype)
            if path is not None:
                print(f"{name} {qtype} {path} {path.stat().st_size / 2**20:.0f} MiB", flush=True)
        f16 = shapes_dir() / f"{name}.F16.gguf"
        if not args.keep_f16 and "F16" not in args.types and f16.exists():
            f16.unlink()


if __name__ == "__main__":
    main()
