#!/usr/bin/env bash
# radixlang's GPU check, in one command, on a machine without network (Python 3.12 with torch, triton,
# transformers, nvcc, ninja and pytest). Everything else travels in the bundle folder that
# bench/prepare_gpu_bundle.py builds (under 64 MiB):
#
#   bash bench/gpu_check.sh [BUNDLE=gpu_bundle] [OUT=gpu_check_out]   # at most 5 minutes, setup included;
#                                                                    # PASS/FAIL per phase, OUT/gpu_check.json
#   bash bench/gpu_check.sh --device cpu                              # every phase on small shapes (< 3 min)
#   bash bench/gpu_check.sh gpu_bundle /tmp/out --dry-run             # files, imports, FlashInfer signatures
#
# Five minutes so that the check runs twice within 15 minutes of GPU time, machine starts included. The phases,
# their caps and what they measure are described in bench/gpu_check.py; each runs in a process group of its
# own, killed as a group at its cap, and the figures are written as each phase ends.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu_bundle OUT=gpu_check_out
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then BUNDLE=$1; shift; fi
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then OUT=$1; shift; fi
BUNDLE=$(realpath -m "$BUNDLE")
OUT=$(realpath -m "$OUT")
DEVICE=cuda
prev=
for a in "$@"; do
  if [ "$prev" = --device ]; then DEVICE=$a; fi
  case $a in --device=*) DEVICE=${a#--device=} ;; esac
  prev=$a
done
TOTAL=${GPU_CHECK_SECONDS:-$([ "$DEVICE" = cpu ] && echo 180 || echo 300)}
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$OUT"
start=$(date +%s)

if [ -d "$BUNDLE" ]; then
  # the missing packages, into a folder of our own (no network: only the bundle's wheels, built for cp312;
  # another Python, e.g. a CPU run elsewhere, uses what it has installed)
  if [ "$("$PY" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" != True ]; then
    echo "note: $("$PY" -V) is not 3.12: the bundle's wheels are not installed; using this environment's packages" >&2
  elif [ ! -f "$OUT/site/.installed" ]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$OUT/site" "$BUNDLE"/wheels/*.whl
    touch "$OUT/site/.installed"
  fi
  # FlashInfer: the trimmed wheel unpacked; its JIT writes its kernels under OUT/flashinfer_cache
  if [ -f "$BUNDLE/flashinfer_site.zip" ] && [ ! -f "$OUT/flashinfer_site/flashinfer/__init__.py" ]; then
    "$PY" -m zipfile -e "$BUNDLE/flashinfer_site.zip" "$OUT/flashinfer_site"
  fi
  export PYTHONPATH="$PWD:$OUT/site:$OUT/flashinfer_site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$OUT/site/bin:$PATH"  # ninja, for FlashInfer's JIT, where the machine has none
elif [ "$DEVICE" = cuda ]; then
  echo "no bundle at $BUNDLE (python -m bench.prepare_gpu_bundle builds it)" >&2
  exit 2
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export FLASHINFER_WORKSPACE_BASE="$OUT/flashinfer_cache"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$DEVICE" = cpu ]; then export TRITON_INTERPRET=1; fi  # the Triton kernels run interpreted on the CPU
setup=$(( $(date +%s) - start ))
echo "setup: $setup s"
# the driver keeps its own budget (phases killed at their caps); this is the backstop: TERM makes it kill its
# phases' groups and write what it has
left=$(( TOTAL - setup ))
timeout -k 10 "$left" "$PY" -m bench.gpu_check --bundle "$BUNDLE" --out "$OUT" --budget $(( left - 15 )) "$@"
