"""Compile csrc/cpu_ops.c (and the other csrc/ sources) with the machine's C compiler once, and cache the library.

The library is built for the CPU it runs on (``-march=native``), so the cache key covers the source,
the compiler and its version, the flags and the CPU's feature flags. It lives under the user cache
(``$RADIXLANG_CACHE``, default ``~/.cache/radixlang``) in ``kernels/``; a build goes to a temporary
file that is renamed into place, so processes that build at the same time never load a half-written
library. Compiling takes about a second; no PyTorch headers are involved.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
QUANT_SOURCE = Path(__file__).parent / "csrc" / "quant_ops.c"
QUANT_VNNI_SOURCE = Path(__file__).parent / "csrc" / "quant_vnni.c"
DECODE_STACK_SOURCE = Path(__file__).parent / "csrc" / "decode_stack.c"
MOE_SOURCE = Path(__file__).parent / "csrc" / "moe.c"
# included by the sources: part of every cache key
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("vec.h", "moe_pairs.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


class BuildError(RuntimeError):
    """The kernels could not be compiled here (no compiler, or it failed); the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXLANG_CACHE", Path.home() / ".cache" / "radixlang")) / "kernels"


def find_compiler() -> str:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    raise BuildError("no C compiler found (set CC, or install gcc)")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def library_path(source: Path | None = None, extra: tuple[Path, ...] = ()) -> Path:
    """The built library of ``source`` (default cpu_ops.c) linked with the ``extra`` sources (each its own
    translation unit), compiling it first when these sources, compiler and CPU have none cached."""
    source = SOURCE if source is None else source
    cc = find_compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} --version failed: {e}") from e
    texts = [source.read_text(), *(p.read_text() for p in (*extra, *HEADERS))]
    key = hashlib.sha256("\0".join([*texts, cc, version, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(source), *map(str, extra), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise BuildError(f"compiling {source.name} failed ({cc}):\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"compiling {source.name} failed ({cc}): {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_library(signatures: dict[str, tuple], source: Path | None = None,
                 extra: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """Build (if needed) and load ``source`` (with ``extra``), setting each named function's restype and argtypes.

    Raises BuildError, OSError or AttributeError (a symbol missing); callers cache the outcome.
    """
    lib = ctypes.CDLL(str(library_path(source, extra)))
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
