#!/usr/bin/env python
"""Training runs side by side: the in-run held-out tau of several `sglang-dlite train` folders
against their compute (thread-minutes = training wall time x processes x threads per process), in
one PNG and one JSON, with a table printed.

    python bench/compare_runs.py v6=artifacts/train/v6 v7=artifacts/train/v7 \
        --mark eagle3=68 --out artifacts/results/v9/runs_v6_v7.json --plot bench/plots/training_runs.png

Every run evaluates the same held-out anchors (the trainer's --eval-anchors set of the same data
and seed), so the curves compare; the points are the trainer's evaluations (a 95 % CI band around
each). ``--mark LABEL=THREAD_MIN`` draws a vertical line at another drafter's training budget
(e.g. the EAGLE-3-style baseline's), for equal-budget reading. Reads only the folders' JSON files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (a train --out folder) or RUN_DIR")
    p.add_argument("--stage", default="stabilize")
    p.add_argument("--threads", nargs="*", default=[], metavar="LABEL=N",
                   help="torch threads per process of a run whose folder records no command (default 1)")
    p.add_argument("--mark", nargs="*", default=[], metavar="LABEL=THREAD_MIN")
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--plot", default=None, help="PNG file")
    return p.parse_args(argv)


def recorded_threads(info: dict):
    """--threads of the run's last recorded invocation (the CLI default, 2, when that command did
    not give it); None when the folder records no command (runs older than the invocation list)."""
    inv = info.get("invocations") or []
    if not inv or "command" not in inv[-1]:
        return None
    m = re.search(r"--threads[ =](\d+)", inv[-1]["command"])
    return int(m.group(1)) if m else 2


def run_curve(run_dir: str, stage: str = "stabilize", threads=None) -> dict:
    """The run's evaluations with the compute spent when each was made. ``threads``: torch threads
    per process when the folder does not record its command (default then: 1)."""
    info_path, metrics_path = os.path.join(run_dir, "train_info.json"), os.path.join(run_dir, "metrics.jsonl")
    for path in (info_path, metrics_path):
        if not os.path.isfile(path):
            raise SystemExit(f"{run_dir!r} is not a train --out folder: {os.path.basename(path)} is missing.")
    with open(info_path) as f:
        info = json.load(f)
    procs, rec = int(info.get("processes", 1)), recorded_threads(info)
    if threads is not None:
        source = "--threads"
    elif rec is not None:
        threads, source = rec, "recorded command"
    else:
        threads, source = 1, "assumed 1 (no recorded command)"
    recs = [json.loads(x) for x in open(metrics_path) if x.strip()]
    wall = {r["step"]: r["wall_s"] for r in recs if r.get("stage") == stage and "wall_s" in r}
    points = []
    for r in recs:
        if r.get("stage") != stage or "tau_proxy" not in r:
            continue
        known = [s for s in wall if s <= r["step"]]
        if not known:
            continue
        w = wall[max(known)]
        points.append({"step": r["step"], "wall_s": w, "thread_min": round(w * procs * threads / 60, 2),
                       "tau": round(r["tau_proxy"], 4), "tau_ci95": r.get("tau_ci95"),
                       "first_position": (r.get("acc_per_pos") or [None])[0]})
    if not points:
        raise SystemExit(f"{run_dir!r} has no held-out evaluation in stage {stage!r} yet.")
    return {"run": run_dir, "processes": procs, "threads_per_process": threads,
            "threads_from": source,
            "global_batch": info.get("global_batch"), "points": points}


def plot(curves: dict, marks: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, c in curves.items():
        x = [p["thread_min"] for p in c["points"]]
        ax.plot(x, [p["tau"] for p in c["points"]], marker="o", ms=3, label=label)
        ci = [p["tau_ci95"] for p in c["points"]]
        if all(ci):
            ax.fill_between(x, [a for a, _ in ci], [b for _, b in ci], alpha=0.12)
    for label, x in marks.items():
        ax.axvline(x, ls="--", c="gray")
        ax.text(x, ax.get_ylim()[1], f" {label}", va="top", fontsize=8, color="gray")
    ax.set_xlabel("training compute (thread-minutes)")
    ax.set_ylabel("in-run held-out tau (greedy, K drafts)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _pairs(items, flag: str, want: str) -> dict:
    out = {}
    for item in items:
        label, sep, x = item.partition("=")
        try:
            out[label] = float(x)
        except ValueError:
            raise SystemExit(f"{flag} {item!r}: want {want}.") from None
        if not sep or not label:
            raise SystemExit(f"{flag} {item!r}: want {want}.")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = {k: int(v) for k, v in _pairs(args.threads, "--threads", "LABEL=N, e.g. v5=1").items()}
    marks = _pairs(args.mark, "--mark", "LABEL=THREAD_MINUTES, e.g. eagle3=68")
    curves = {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = os.path.basename(item.rstrip("/")), item
        curves[label] = run_curve(path, args.stage, threads.get(label))
    w = max([14] + [len(k) for k in curves])
    print(f"{'run':<{w}} {'procs x thr':>11} {'steps':>7} {'thread-min':>10} {'last tau':>9} {'best tau':>9} {'@thread-min':>11}")
    for label, c in curves.items():
        last = c["points"][-1]
        best = max(c["points"], key=lambda p: p["tau"])
        print(f"{label:<{w}} {c['processes']:>5} x {c['threads_per_process']:<3} {last['step']:>7} "
              f"{last['thread_min']:>10.1f} {last['tau']:>9.3f} {best['tau']:>9.3f} {best['thread_min']:>11.1f}"
              + ("  (threads per process assumed 1)" if c["threads_from"].startswith("assumed") else ""))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"stage": args.stage, "marks": marks, "runs": curves, "argv": sys.argv}, f, indent=1)
    if args.plot:
        plot(curves, marks, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
