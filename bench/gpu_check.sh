#!/usr/bin/env bash
# One script a CUDA machine runs (<= 8 minutes on an H100/H200): builds the extension with the
# CUDA ops, compiles every .cu standalone (make cuda-check), runs the CPU + CUDA kernel tests and
# the draft-latency microbenchmark (torch vs CUDA kernels, with the verify-round fraction), then,
# where a CUDA sglang is installed, bench/gpu_check_sglang.py (DLITE in a CUDA sglang engine), a short
# drafter training run on the GPU (tiny random target: steps/s, anchors/s), and writes
# ${OUT:-artifacts}/gpu_check.json (+ the benchmark's own JSON/PNG and logs beside it).
#
#   OUT=/tmp/out bash bench/gpu_check.sh        # PYTHON=... to pick the interpreter (CUDA torch)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-artifacts}"
mkdir -p "$OUT"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export SGLANG_DLITE_CACHE="${SGLANG_DLITE_CACHE:-$PWD/artifacts/cache}"
# bench scripts import the package (no sys.path edits): the checkout, where it is not installed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BATCHES="${BATCHES:-1,8,32}"
CONTEXTS="${CONTEXTS:-512,4096,32768}"
t_start=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - t_start ))s] $*"; }

log "python: $PY; $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' 2>&1)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/nvidia_smi.txt" 2>&1 || true

log "1/5 build the extension (CPU + CUDA ops)"
b0=$(date +%s)
timeout 300 "$PY" -m sglang_dlite.ops.build > "$OUT/build.log" 2>&1; build_rc=$?
build_s=$(( $(date +%s) - b0 )); tail -1 "$OUT/build.log"

log "2/5 make cuda-check (standalone nvcc, sm_80 + sm_90a, -Werror)"
timeout 120 bash csrc/cuda_check.sh > "$OUT/cuda_check.log" 2>&1; cuda_check_rc=$?
cat "$OUT/cuda_check.log"

log "3/5 kernel tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider python_tests/test_ops_cuda.py python_tests/test_ops.py \
  --junitxml="$OUT/ops_tests.xml" > "$OUT/ops_tests.log" 2>&1; tests_rc=$?
tail -3 "$OUT/ops_tests.log"

log "4/5 draft-latency benchmark"
IMPLS=torch,cuda
"$PY" -c 'from sglang_dlite import ops; import sys; sys.exit(0 if "cuda" in ops.available_impls() else 1)' || IMPLS=torch
timeout 240 "$PY" bench/draft_latency.py --drafter dlite --impl "$IMPLS" --device cuda --dtype bfloat16 \
  --batch-sizes "$BATCHES" --contexts "$CONTEXTS" --reps 20 --warmup 5 \
  --out "$OUT/draft_latency_cuda.json" > "$OUT/bench.log" 2>&1; bench_rc=$?
tail -20 "$OUT/bench.log"

log "5/5 sglang DLITE on CUDA (drafter CUDA graphs, lossless with target graphs, verify in graph, speed)"
sglang_rc=skipped
if "$PY" -c 'import sglang, torch; assert torch.cuda.is_available()' > /dev/null 2>&1; then
  left=$(( 450 - ($(date +%s) - t_start) )); [ "$left" -lt 90 ] && left=90
  timeout $(( left + 60 )) "$PY" bench/gpu_check_sglang.py --out "$OUT/gpu_check_sglang.json" --budget-s "$left" \
    > "$OUT/gpu_check_sglang.log" 2>&1; sglang_rc=$?
  tail -5 "$OUT/gpu_check_sglang.log"
else
  log "sglang (CUDA build) not importable here: step 5 skipped"
fi

log "6 (>= 2 GPUs only) sglang DLITE with --tp-size 2: output vs no speculation, tau vs tp 1"
tp2_rc=skipped
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${ngpu:-0}" -ge 2 ] && "$PY" -c 'import sglang' > /dev/null 2>&1; then
  timeout 420 "$PY" bench/e2e.py --device cuda --dtype bfloat16 --modes nospec,dlite,dlite@tp2 --concurrency 1,8 \
    --max-requests 8 --max-new-tokens 64 --out "$OUT/e2e_tp2.json" > "$OUT/e2e_tp2.log" 2>&1; tp2_rc=$?
  grep -E '^\|' "$OUT/e2e_tp2.log" | tail -6
else
  log "$ngpu GPU(s) or no sglang: step 6 skipped"
fi

log "7 drafter training on the GPU (tiny random target; gen-data on the CPU, ${TRAIN_STEPS:-300} training steps on cuda)"
train_rc=skipped
if "$PY" -c 'import torch; assert torch.cuda.is_available()' > /dev/null 2>&1; then
  timeout 300 "$PY" -m sglang_dlite.training.smoke --out "$OUT/train_gpu" --procs 1 --device cuda \
    --steps "${TRAIN_STEPS:-300}" --hidden 512 --layers 8 > "$OUT/train_gpu.log" 2>&1; train_rc=$?
  grep -E '^training on|^train-smoke:.*tau' "$OUT/train_gpu.log" | tail -2
else
  log "no CUDA device: step 7 skipped"
fi

"$PY" - "$OUT" "$build_rc" "$build_s" "$cuda_check_rc" "$tests_rc" "$bench_rc" "$(( $(date +%s) - t_start ))" "$sglang_rc" "$tp2_rc" "$train_rc" <<'PYEOF'
import json, os, sys, xml.etree.ElementTree as ET
out, build_rc, build_s, cc_rc, tests_rc, bench_rc, total_s = sys.argv[1], *map(int, sys.argv[2:8])
sglang_rc, tp2_rc, train_rc = sys.argv[8], sys.argv[9], sys.argv[10]
def read(p):
    try:
        return open(os.path.join(out, p)).read()
    except OSError:
        return None
tests = None
x = read("ops_tests.xml")
if x:
    s = ET.fromstring(x)
    s = s if s.tag == "testsuite" else s.find("testsuite")
    tests = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = read("draft_latency_cuda.json")
res = {
    "gpu": (read("nvidia_smi.txt") or "").strip(),
    "build": {"rc": build_rc, "seconds": build_s, "last_line": (read("build.log") or "").strip().splitlines()[-1:]},
    "cuda_check": {"rc": cc_rc, "log": read("cuda_check.log")},
    "tests": {"rc": tests_rc, **(tests or {})},
    "bench": {"rc": bench_rc, **(json.loads(bench) if bench else {})},
    "sglang": {"rc": sglang_rc, **(json.loads(read("gpu_check_sglang.json")) if read("gpu_check_sglang.json") else {})},
    "tp2": {"rc": tp2_rc, **({"table": json.loads(read("e2e_tp2.json")).get("table")} if read("e2e_tp2.json") else {})},
    # steps/s and anchors/s of the GPU training run: res["train"]["training"]
    "train": {"rc": train_rc, **(json.loads(read("train_gpu/smoke.json")) if read("train_gpu/smoke.json") else {})},
    "total_seconds": total_s,
}
json.dump(res, open(os.path.join(out, "gpu_check.json"), "w"), indent=2)
print(f"wrote {os.path.join(out, 'gpu_check.json')}: build rc={build_rc} ({build_s}s), cuda-check rc={cc_rc}, "
      f"tests rc={tests_rc} {tests}, bench rc={bench_rc}, sglang rc={sglang_rc}, tp2 rc={tp2_rc}, "
      f"train rc={train_rc} {res['train'].get('training')}, total {total_s}s")
PYEOF
[ "$build_rc$tests_rc$bench_rc" = "000" ] && { [ "$sglang_rc" = 0 ] || [ "$sglang_rc" = skipped ]; } && { [ "$tp2_rc" = 0 ] || [ "$tp2_rc" = skipped ]; } \
  && { [ "$train_rc" = 0 ] || [ "$train_rc" = skipped ]; }
