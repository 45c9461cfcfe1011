#!/usr/bin/env python
"""Which lm_head_argmax path is faster on this CPU: the torch reference or the fused C++ kernel?

    python bench/lm_head_dispatch.py [--dtypes float32,bfloat16] [--rows 7,14,28,56,112] \
        [--threads 1] [--out artifacts/results/lm_head_dispatch.json]

Greedy drafting's last step (final RMS-norm + vocabulary projection + argmax) at SmolLM2-135M's
shapes (V=49152, H=576); rows = batch x K draft positions. The two paths are interleaved run by
run (a loaded machine slows both alike) and the minimum over --reps runs is reported. The last
column is what the ops mode ``auto`` picks (``ops.CPU_TORCH_FASTER_BELOW``): keep that table in
line with what this prints. Writes JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sglang_dlite import ops
from sglang_dlite.ops import reference


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lm_head_argmax: torch reference vs C++ kernel (see module doc).")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="7,14,28,56,112", help="rows per call (batch x K)")
    ap.add_argument("--shape", default="49152,576", help="V,H of the LM head (default: SmolLM2-135M)")
    ap.add_argument("--reps", type=int, default=30, help="timed runs per path (the minimum is reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned, reported)")
    ap.add_argument("--out", default="artifacts/results/lm_head_dispatch.json")
    args = ap.parse_args(argv)
    if "cpp" not in ops.available_impls():
        ap.error(f"the C++ ops are not available here: {ops.build_status()}")
    torch.set_num_threads(args.threads)
    V, H = (int(x) for x in args.shape.split(","))
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "loadavg_start": os.getloadavg(), "ops": ops.build_status(),
           "command": " ".join(["bench/lm_head_dispatch.py"] + (list(argv) if argv is not None else sys.argv[1:]))}
    print(f"# threads={env['threads']} loadavg={env['loadavg_start']} {env['ops']}")
    results = []
    for dtype in dtypes:
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(V, H, generator=g) * 0.02).to(dtype)
        nw = torch.ones(H, dtype=dtype)
        for rows in tqdm(rows_list, desc=str(dtype).replace("torch.", ""), leave=False):
            h = torch.randn(rows, H, generator=g).to(dtype)
            paths = {"torch": lambda: reference.lm_head_argmax(h, nw, 1e-5, w),
                     "cpp": lambda: torch.ops.sglang_dlite.lm_head_argmax(h, nw, 1e-5, w)}
            times = {k: [] for k in paths}
            for r in range(args.warmup + args.reps):
                for k, fn in paths.items():
                    t0 = time.perf_counter()
                    fn()
                    if r >= args.warmup:
                        times[k].append((time.perf_counter() - t0) * 1e3)
            row = {"dtype": str(dtype).replace("torch.", ""), "rows": rows,
                   "torch_ms": min(times["torch"]), "cpp_ms": min(times["cpp"]),
                   "auto_picks": "torch" if ops.torch_faster_on_cpu("lm_head_argmax", dtype, rows) else "cpp"}
            row["cpp_over_torch"] = row["cpp_ms"] / row["torch_ms"]
            row["faster"] = "cpp" if row["cpp_ms"] < row["torch_ms"] else "torch"
            results.append(row)
    env["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kind": "lm_head_dispatch", "env": env, "results": results}, indent=2) + "\n")
    print("| dtype | rows | torch ms | C++ ms | C++/torch | faster | auto picks |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['dtype']} | {r['rows']} | {r['torch_ms']:.2f} | {r['cpp_ms']:.2f} | {r['cpp_over_torch']:.2f}x | "
              f"{r['faster']} | {r['auto_picks']} |")
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
