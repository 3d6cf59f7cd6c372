#!/usr/bin/env bash
# radixlang's GPU check, in one command, on a machine without network (an H200 with Python 3.12, torch, triton
# and transformers). Everything else travels in the bundle folder that bench/prepare_gpu_bundle.py builds:
#
#   bash bench/gpu_check.sh [BUNDLE=gpu_bundle] [OUT=gpu_check_out]     # ~8 minutes; prints a summary,
#                                                                      # writes OUT/gpu_check.json
#   bash bench/gpu_check.sh gpu_bundle /tmp/out --dry-run              # files, imports, FlashInfer signatures
#   bash bench/gpu_check.sh gpu_bundle /tmp/out --device cpu           # the phases on the CPU, small configs
#
# The phases, their caps and what they measure are described in bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=$(realpath "${1:-gpu_bundle}")
OUT=$(realpath -m "${2:-gpu_check_out}")
shift $(( $# > 2 ? 2 : $# ))
PY=${PYTHON:-python3}
mkdir -p "$OUT"
start=$(date +%s)

# the missing packages, into a folder of our own (no network: only the bundle's wheels, built for cp312;
# another Python, e.g. a CPU dry run elsewhere, uses what it has installed)
if [ "$("$PY" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" != True ]; then
  echo "note: $("$PY" -V) is not 3.12: the bundle's wheels are not installed; using this environment's packages" >&2
elif [ ! -f "$OUT/site/.installed" ]; then
  "$PY" -m pip install -q --no-index --no-deps --target "$OUT/site" "$BUNDLE"/wheels/*.whl
  touch "$OUT/site/.installed"
fi
# FlashInfer: the trimmed wheel unpacked; its JIT writes its kernels under OUT/flashinfer_cache
if [ ! -f "$OUT/flashinfer_site/flashinfer/__init__.py" ]; then
  "$PY" -m zipfile -e "$BUNDLE/flashinfer_site.zip" "$OUT/flashinfer_site"
fi
export PYTHONPATH="$PWD:$OUT/site:$OUT/flashinfer_site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$OUT/site/bin:$PATH"  # ninja, for FlashInfer's JIT
export FLASHINFER_WORKSPACE_BASE="$OUT/flashinfer_cache"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  echo "note: no nvcc on this machine: FlashInfer cannot JIT-compile its kernels; its rows will fail" >&2
fi
echo "setup: $(( $(date +%s) - start )) s"
# the whole check stays under 8 minutes: each phase has its own cap inside, this is the backstop
timeout 470 "$PY" -m bench.gpu_check --bundle "$BUNDLE" --out "$OUT" "$@"
