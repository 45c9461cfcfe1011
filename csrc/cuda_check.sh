#!/usr/bin/env bash
# `make cuda-check`: compile every csrc/cuda/*.cu with standalone nvcc for Ampere (sm_80) and Hopper
# (sm_90a), all warnings as errors. Needs no GPU and no CUDA torch. Skips (exit 0) without nvcc.
set -euo pipefail
cd "$(dirname "$0")/cuda"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "cuda-check skipped: nvcc not found (install the CUDA toolkit or set NVCC=/path/to/nvcc)."
  exit 0
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
FLAGS=(-c -O3 -std=c++17 -Xcompiler -fPIC -Werror all-warnings -lineinfo
       -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a)
echo "cuda-check: $("$NVCC" --version | tail -1)"
status=0
for cu in *.cu; do
  t0=$(date +%s)
  if "$NVCC" "${FLAGS[@]}" -Xptxas -warn-spills "$cu" -o "$OUT/${cu%.cu}.o"; then
    echo "  ok   $cu ($(( $(date +%s) - t0 )) s, sm_80 + sm_90a)"
  else
    echo "  FAIL $cu"
    status=1
  fi
done
exit $status
