#!/usr/bin/env bash
# One command for a lent GPU machine (no sglang there): every GPU path that needs no sglang, in
# order of value, within an internal deadline of 500 s (docs/gpu_check.md; the steps: --list).
#
#   OUT=/tmp/out bash bench/gpu_check.sh              # extra arguments go to bench/gpu_check.py
#
# Writes only $OUT/summary.json (rewritten at every step), $OUT/draft_latency.json and
# $OUT/logs.tar.gz. Without CUDA every GPU step is "skipped: no CUDA" and it exits 0 (the dry run).
# Interpreter: $PYTHON, else .venv/bin/python, else python3; the checkout goes on PYTHONPATH
# (nothing is installed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" bench/gpu_check.py --out "${OUT:-artifacts/gpu_check}" "$@"
