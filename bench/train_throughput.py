"""Training throughput: anchors/s of ``sglang-dlite train`` per precision and batch shape, side by side.

    python bench/train_throughput.py --data artifacts/data/regen-v4                 # fp32 vs bf16, b32 / 2 seqs
    python bench/train_throughput.py --data artifacts/data/regen-v4 --configs fp32:32x2 fp32:64x4 bf16:32x2
    python bench/train_throughput.py --data D --steps 60 --train-args --num-layers 3 --head-input token

Each config (``PRECISION:BATCHxSEQS``: ``fp32`` / ``bf16`` autocast, anchors per step x sequences
they come from) runs the same short single-stage training (``--steps`` steps, one process, the same
data, seed and model options) in a fresh folder under ``--work``; anchors/s is the median of the
trainer's logged intervals after the first (which holds the warm-up), read from its
``metrics.jsonl``. The table gives each config's ratio to the first. ``torch`` threads are pinned
(``--threads``, default 1) and reported, with whether this CPU has native bf16 instructions: on
one without (``training/precision.py``) bf16 autocast is emulated and slower than float32. Absolute
numbers move with the machine's load; the ratios are what to compare. JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import time

from dlite_lab.training.precision import cpu_native_bf16
from dlite_lab.training.smoke import train_command, training_throughput

CONFIG_RE = re.compile(r"^(fp32|bf16):(\d+)x(\d+)$")
DEFAULT_TRAIN_ARGS = ["--single-stage", "--vocab-subset", "8192", "--stream-window", "8", "--eval-shards", "2",
                      "--num-layers", "3", "--init-from-target-layers", "27,28,29", "--head-input", "token",
                      "--target-layer-ids", "2,15,27"]


def parse_config(spec: str) -> dict:
    """``fp32:32x2`` -> {"name", "bf16", "batch_size", "seqs_per_batch"}; a clear error otherwise."""
    m = CONFIG_RE.match(spec)
    if not m:
        raise SystemExit(f"train_throughput: bad --configs entry {spec!r}: write PRECISION:BATCHxSEQS with PRECISION "
                         "fp32 or bf16, e.g. fp32:32x2 (32 anchors per step from 2 sequences)")
    prec, b, s = m.group(1), int(m.group(2)), int(m.group(3))
    if b < 1 or s < 1 or s > b:
        raise SystemExit(f"train_throughput: bad --configs entry {spec!r}: need 1 <= SEQS <= BATCH")
    return {"name": spec, "bf16": prec == "bf16", "batch_size": b, "seqs_per_batch": s}


def train_argv(cfg: dict, args, out: str) -> list:
    return ["train", "--device", "cpu", "--threads", str(args.threads), "--target", args.target, "--data", args.data,
            "--out", out, "--steps-stabilize", str(args.steps), "--eval-anchors", "16",
            "--batch-size", str(cfg["batch_size"]), "--seqs-per-batch", str(cfg["seqs_per_batch"]),
            "--bf16" if cfg["bf16"] else "--no-bf16", "--eval-every", str(10 ** 9), "--save-every", str(10 ** 9),
            "--log-every", str(args.log_every), "--no-progress", *args.train_args]


def run_config(cfg: dict, args) -> dict:
    out = os.path.join(args.work, cfg["name"].replace(":", "_"))
    shutil.rmtree(out, ignore_errors=True)
    cmd = train_command(train_argv(cfg, args, out), procs=1, launcher="torchrun")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise SystemExit(f"train_throughput: config {cfg['name']} failed (exit {proc.returncode}):\n{tail}")
    row = dict(cfg, process_wall_s=round(wall, 1), **training_throughput(out))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def table(rows: list) -> str:
    lines = ["| config | precision | batch x seqs | steps | anchors/s | vs first |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.get("ratio_to_first")
        lines.append(f"| {r['name']} | {'bf16' if r['bf16'] else 'fp32'} | {r['batch_size']} x {r['seqs_per_batch']} "
                     f"| {r['steps']} | {r['anchors_per_s']} | {ratio:.2f}x |" if ratio else f"| {r['name']} | - | - | - | - | - |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a gen-data folder (its shards are streamed as in training)")
    ap.add_argument("--target", default="default")
    ap.add_argument("--configs", nargs="+", default=["fp32:32x2", "bf16:32x2"], help="PRECISION:BATCHxSEQS, first = baseline")
    ap.add_argument("--steps", type=int, default=60, help="training steps per config (the first logged interval is dropped)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every run (pinned, reported)")
    ap.add_argument("--work", default="artifacts/bench/train_throughput", help="scratch run folders")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--out", default="artifacts/results/train_throughput.json")
    ap.add_argument("--train-args", nargs=argparse.REMAINDER, default=None,
                    help=f"model/data options given to every run (default: {' '.join(DEFAULT_TRAIN_ARGS)})")
    args = ap.parse_args(argv)
    cfgs = [parse_config(c) for c in args.configs]
    if not os.path.isdir(args.data):
        raise SystemExit(f"train_throughput: --data {args.data!r} is not a folder: point it at a gen-data output")
    if args.steps < 2 * args.log_every:
        raise SystemExit(f"train_throughput: --steps {args.steps} must be >= 2 x --log-every ({args.log_every}): "
                         "the first logged interval (warm-up) is dropped")
    if args.train_args is None:
        args.train_args = list(DEFAULT_TRAIN_ARGS)
    rows = []
    for cfg in cfgs:
        rows.append(run_config(cfg, args))
        print(f"{cfg['name']}: {rows[-1]['anchors_per_s']} anchors/s", flush=True)
    base = rows[0]["anchors_per_s"]
    for r in rows:
        r["ratio_to_first"] = round(r["anchors_per_s"] / base, 3) if base and r["anchors_per_s"] else None
    result = {"bench": "train_throughput", "data": args.data, "torch_threads": args.threads, "steps": args.steps,
              "cpu": platform.processor() or platform.machine(), "cpu_native_bf16": cpu_native_bf16(),
              "train_args": args.train_args, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"torch threads {args.threads}, CPU native bf16: {result['cpu_native_bf16']}")
    print(table(rows))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
