"""sglang's own serving benchmark (``python -m sglang.bench_serving``) against ``sglang-dlite serve``,
with DLITE and without speculation, on sglang's random dataset and on a multi-turn dataset built from
this project's workloads.

    python bench/sglang_bench_serving.py --workloads agent-stdlib --num-prompts 16 --max-convs 8 \\
        --max-concurrency 8 --out-dir artifacts/results/bench_serving

Per mode (``--modes``, default ``dlite,nospec``) one ``sglang-dlite serve --cpu`` server on 127.0.0.1 and
a free port (``dlite_lab/benchmarking/agent_client.py``'s ``Server``: the project's launcher, at most
``--max-concurrency`` running requests, stopped with its process group), its torch threads pinned with
``--threads`` (OMP_NUM_THREADS / MKL_NUM_THREADS of the server). Against it, per dataset
(``--datasets``), sglang's benchmark client as a subprocess (``--cell-timeout``), greedy, every request
streamed, the radix cache flushed before each run and after sglang's warm-up request:

- ``random``: ``--dataset-name random --random-input-len 256 --random-output-len 64
  --random-range-ratio 1.0`` (every prompt exactly 256 tokens, every answer exactly 64, EOS ignored),
  ``--backend sglang``; its text corpus is a ShareGPT-format file written from the workloads (sglang
  would download ShareGPT otherwise).
- ``random-ids`` (not in the default): the same over random token ids.
- ``multiturn``: ``--dataset-name agentic-trace`` (sglang's multi-turn replay; the server's own replies
  go back into the history), ``--backend sglang-oai-chat``, ``--output-len`` tokens per round at most,
  stopping at EOS; ``--max-convs`` conversations per workload, ``--max-turns`` rounds each.

The tokenizer is the bundled target's folder (``--tokenizer``), the client runs offline: nothing
reaches a model hub. What it writes under ``--out-dir``: sglang's JSON per mode x dataset
(``MODE_DATASET.jsonl``, its ``--output-file`` with ``--output-details``), the generated datasets
(``datasets/``), the server and client logs (``logs/``), and ``summary.json``: per mode x dataset output
and request throughput, TTFT median / p99, TPOT and ITL median, sglang's accept length, and each mode's
ratio to no speculation; the table is printed. ``--resume`` keeps the cells whose JSON is there. The
library: ``dlite_lab/benchmarking/bench_serving.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from dlite_lab.benchmarking import bench_serving as bs
from dlite_lab.benchmarking.agent_client import MODES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="dlite,nospec", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--datasets", default="random,multiturn", help=f"comma-separated, of {', '.join(bs.DATASETS)}")
    p.add_argument("--workloads", nargs="+", default=["agent-stdlib"],
                   help="built-in names or .jsonl files: the multi-turn conversations and the random dataset's text")
    p.add_argument("--num-prompts", type=int, default=16, help="requests of the random datasets")
    p.add_argument("--random-input-len", type=int, default=256, help="prompt tokens of a random request")
    p.add_argument("--output-len", type=int, default=64,
                   help="new tokens per random request (exactly) and per multi-turn round (at most)")
    p.add_argument("--max-convs", type=int, default=8, help="multi-turn conversations per workload")
    p.add_argument("--max-turns", type=int, default=4, help="rounds per multi-turn conversation at most")
    p.add_argument("--max-concurrency", type=int, default=8,
                   help="sglang's --max-concurrency, and the server's --max-running-requests")
    p.add_argument("--request-rate", default="inf", help="sglang's --request-rate (inf: all at once, capped by the concurrency)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the server's torch threads (default: every core)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds for a server to answer /health")
    p.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds for one sglang client run")
    p.add_argument("--out-dir", default="artifacts/results/bench_serving")
    p.add_argument("--resume", action="store_true", help="keep the cells whose sglang JSON is already in --out-dir")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    bad = [m for m in a.modes if m not in MODES] + [d for d in a.datasets if d not in bs.DATASETS]
    if bad or not a.modes or not a.datasets:
        p.error(f"--modes of {', '.join(MODES)}, --datasets of {', '.join(bs.DATASETS)} (got {bad})")
    if min(a.num_prompts, a.random_input_len, a.max_convs, a.max_turns, a.max_concurrency, a.threads) < 1 or a.output_len < 4:
        p.error("--num-prompts, --random-input-len, --max-convs, --max-turns, --max-concurrency, --threads >= 1; "
                "--output-len >= 4 (sglang's minimum)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    # SIGTERM (a `timeout`, a job runner) unwinds like Ctrl-C: the servers and the client are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary = bs.run(a)
    print(bs.format_table(summary["rows"]))
    print(f"# wrote {summary['path']} (sglang's JSON per cell beside it)")
    return 1 if any(r.get("failed") for r in summary["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
