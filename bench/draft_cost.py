#!/usr/bin/env python
"""Draft cost vs context length: DLite (no drafter KV) against drafters that keep their own KV.

    python bench/draft_cost.py --drafter dlite,eagle3,dflash,dspark,ngram \
        --contexts 512,2048,8192,32768 --out artifacts/results/draft_cost.json

For each drafter and context length T it simulates one request in the middle of a conversation:
the drafter's per-request state already covers the T committed tokens (a KV baseline's own cache
holds T positions, filled with random keys/values: the values do not change the cost), then times
steady-state rounds through the same engine adapter the reference engine calls: each round the
conversation grows by ``--accept`` accepted drafts + 1 bonus token (the KV drafters encode those
new positions into their cache, exactly as in the engine) and the drafter drafts K tokens (greedy).
Drafters are interleaved round by round so a noisy, shared machine affects them alike; medians.

Reported per drafter and context: ms per draft round (median, min), drafter memory per request
(bytes the drafter keeps between rounds: its KV cache; DLite and n-gram keep nothing) and the
captured target rows the drafter reads per round; per drafter the ratio cost(max ctx)/cost(min ctx).

Weights are random and the target features synthetic (SmolLM2-135M shapes: H=576, V=49152,
30 layers), so contexts past SmolLM2's 8192 positions (e.g. 32k) are fine here: this measures the
drafters' cost, not acceptance. DLite runs its torch reference ops by default (--dlite-ops), so
every drafter is plain torch. Threads are pinned (--threads) and reported. Writes JSON, a PNG next
to it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_dlite import ops
from dlite_lab.benchmarking.draft_rounds import (
    COST_DRAFTERS, SMOLLM2, Conversation, build_drafter, draft_cost_table, human_bytes, plot_draft_cost,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Draft cost vs context length (see module doc).")
    ap.add_argument("--drafter", default="dlite,eagle3,dflash,dspark,ngram", help=f"comma list of {COST_DRAFTERS}")
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds per drafter and context")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accept", type=int, default=2, help="drafts accepted per simulated round (+1 bonus)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned, reported)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dlite-ops", default="torch", help="the ops mode for DLite (ops.set_ops_mode; torch: like the baselines)")
    ap.add_argument("--out", default="artifacts/results/draft_cost.json")
    ap.add_argument("--png", default=None, help="default: --out with .png")
    args = ap.parse_args(argv)

    names = [s.strip() for s in args.drafter.split(",") if s.strip()]
    bad = [n for n in names if n not in COST_DRAFTERS]
    if bad:
        ap.error(f"unknown drafter(s) {bad}; choose from {', '.join(COST_DRAFTERS)}")
    contexts = sorted(int(x) for x in args.contexts.split(","))
    if contexts[0] < 16:
        ap.error("contexts must be >= 16 tokens")
    ops.set_ops_mode(args.dlite_ops)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    emb = torch.randn(SMOLLM2.vocab_size, SMOLLM2.hidden_size, dtype=dtype) * 0.02
    drafters, described = {}, {}
    for n in names:
        drafters[n], described[n] = build_drafter(n, emb, dtype)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "loadavg_start": os.getloadavg(), "dlite_ops": args.dlite_ops, "accept_per_round": args.accept,
           "rounds": args.rounds, "warmup": args.warmup, "drafters": described,
           "note": ("random weights, synthetic target features of SmolLM2-135M shape; contexts past the "
                    "target's 8192 positions are fine here (cost only, no acceptance)."),
           "command": " ".join(["bench/draft_cost.py"] + (list(argv) if argv is not None else sys.argv[1:]))}
    print(f"# threads={env['threads']} dtype={args.dtype} loadavg={env['loadavg_start']} dlite_ops={args.dlite_ops}")
    for n in names:
        print(f"# {n}: {described[n]}")
    print(f"# {env['note']}")

    results = []
    max_L = max(len(d.capture_layer_ids) for d in drafters.values())
    pad = args.rounds + args.warmup
    hid = torch.randn(max_L, contexts[-1] + pad * (args.accept + 1) + 2, SMOLLM2.hidden_size, dtype=dtype)
    convs = {(n, T): Conversation(n, drafters[n], T, pad, args.accept, hid, seed=T) for T in contexts for n in names}
    times = {key: [] for key in convs}
    with torch.no_grad():  # interleaved: every (drafter, context) once per sweep
        for r in range(pad):
            for key, c in convs.items():
                t0 = time.perf_counter()
                c.round()
                dt = (time.perf_counter() - t0) * 1e3
                if r >= args.warmup:
                    times[key].append(dt)
    for T in contexts:
        for n in names:
            c = convs[(n, T)]
            mem = c.memory_bytes()
            row = {"drafter": n, "context": T, "ms": statistics.median(times[(n, T)]),
                   "ms_min": min(times[(n, T)]), "ms_all": times[(n, T)], "memory_bytes": mem,
                   "memory_bytes_per_token": mem / max(len(c.tokens) - 1, 1),
                   "rows_read_bytes_per_round": c.rows_read_bytes()}
            results.append(row)
            print(f"{n:7s} ctx={T:6d} {row['ms']:8.2f} ms/round (min {row['ms_min']:.2f})  drafter memory/request "
                  f"{human_bytes(mem)}", flush=True)
    del convs, hid
    env["loadavg_end"] = os.getloadavg()
    lo, hi = contexts[0], contexts[-1]
    ratio, ratio_min = {}, {}
    for n in names:
        a = next(r for r in results if r["drafter"] == n and r["context"] == lo)
        b = next(r for r in results if r["drafter"] == n and r["context"] == hi)
        ratio[n] = b["ms"] / a["ms"]
        ratio_min[n] = b["ms_min"] / a["ms_min"]
    summary = {f"cost_ratio_{hi}_over_{lo}": ratio, f"cost_ratio_{hi}_over_{lo}_of_min": ratio_min}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"kind": "draft_cost", "env": env, "contexts": contexts, "drafters": names,
                               "results": results, "summary": summary}, indent=2) + "\n")
    os.replace(tmp, out)
    print()
    print(draft_cost_table({"contexts": contexts, "drafters": names, "results": results, "summary": summary}))
    png = Path(args.png) if args.png else out.with_suffix(".png")
    try:
        plot_draft_cost({"contexts": contexts, "drafters": names, "results": results, "env": env}, png)
        print(f"# wrote {out} and {png}")
    except ImportError:
        print(f"# wrote {out} (matplotlib missing: no PNG)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
