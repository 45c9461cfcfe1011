"""Agents through the OpenAI API, measured with a real client: DLITE vs no speculation vs NGRAM.

    python bench/agent_client.py --workloads agent-stdlib bfcl-multiturn --sessions 1 8 --repeats 3 \\
        --out artifacts/results/agent_client.json

Every (repeat, mode) starts its own ``sglang-dlite serve --cpu`` server on 127.0.0.1 (``dlite``: the
default DLITE server; ``nospec``: ``--no-spec``; ``ngram``: sglang's NGRAM, 8 draft tokens; NGRAM's
corpus keeps what it served, so each of its levels gets a fresh server), the mode order rotated
between repeats. At each level ``--sessions N`` sessions run at once, each a workload conversation
sending its whole history every turn (its own replies, streamed; the workload's tools as OpenAI
``tools``): ``dlite_lab/benchmarking/agent_client.py``. The radix cache is flushed between levels.
``--base-url URL`` measures a server you run instead (one mode, named ``server``).

Reported per (workload, sessions, mode), medians over repeats: tokens/s (all completion tokens over
the level's wall time) and its ratio to no speculation (and DLITE's to NGRAM), τ (this project's:
committed tokens per verify round, the prefill's token excluded), TTFT p50 and its turn >= 2 p50
against no speculation's, inter-token latency p50 / p95, and prefix-cache parity: requests whose
``cached_tokens`` (turn >= 2) or output differ from the no-speculation server's, same repeat (outputs
are exact in ``--dtype float32``; in bfloat16 a verify and a decode step round differently, and a
differing reply changes the next turn's history, so cached tokens are compared on the turns whose
history is identical; where the previous turn stopped at max_tokens on an accepted draft the
speculative server holds that token's KV too and hits one token more: counted apart). JSON (``--out``, rewritten after every cell;
``--resume`` skips cells already there), a table, and a PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from statistics import median
import json

from tqdm.auto import tqdm

from dlite_lab.benchmarking import agent_client as ac
from dlite_lab.workloads import load_workload
from sglang_dlite.drafting.tau import TAU_DEFINITION


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["agent-stdlib"], help="built-in names or .jsonl files")
    p.add_argument("--modes", default="dlite,nospec,ngram", help=f"comma-separated, of {', '.join(ac.MODES)}")
    p.add_argument("--sessions", nargs="+", type=int, default=[1, 8], help="concurrent sessions per level")
    p.add_argument("--max-convs", type=int, default=8, help="conversations per workload (sessions cycle over them)")
    p.add_argument("--max-turns", type=int, default=4, help="generated turns per session at most")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--history", default="own", choices=["own", "recorded"],
                   help="the assistant turns a session sends back: its own replies (an agent) or the recorded ones")
    p.add_argument("--no-tools", action="store_true", help="send no OpenAI tools")
    p.add_argument("--base-url", default=None, help="a running server to measure instead of starting servers")
    p.add_argument("--out", default="artifacts/results/agent_client.json")
    p.add_argument("--resume", action="store_true", help="keep the cells already in --out")
    a = p.parse_args(argv)
    a.modes = ["server"] if a.base_url else [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in ac.MODES + ("server",)]
    if bad or min(a.sessions) < 1 or a.repeats < 1:
        p.error(f"--modes of {', '.join(ac.MODES)}; --sessions and --repeats >= 1 (got modes {bad})")
    return a


def cell_key(workload, sessions, mode, repeat) -> str:
    return f"{workload}|{sessions}|{mode}|{repeat}"


def run(a) -> dict:
    convs = {w: load_workload(w, max_convs=a.max_convs) for w in a.workloads}
    payload = {"tau_definition": TAU_DEFINITION, "args": vars(a), "env": ac.python_info(), "cells": {}}
    if a.resume and os.path.exists(a.out):
        with open(a.out, encoding="utf-8") as f:
            payload["cells"] = json.load(f).get("cells", {})
    log_dir = tempfile.mkdtemp(prefix="dlite_agent_client_")
    kw = dict(max_turns=a.max_turns, max_new_tokens=a.max_new_tokens, tools=not a.no_tools, history=a.history)
    todo = [(r, m) for r in range(a.repeats) for m in a.modes[r % len(a.modes):] + a.modes[:r % len(a.modes)]]
    bar = tqdm(total=len(todo) * len(a.sessions) * len(a.workloads), desc="agent cells")
    for r, mode in todo:
        srv = None
        try:
            for li, n in enumerate(a.sessions):
                keys = [cell_key(w, n, mode, r) for w in a.workloads]
                if all(k in payload["cells"] for k in keys):
                    bar.update(len(keys))
                    continue
                if srv is not None and mode == "ngram":  # its corpus remembers the last level's requests
                    srv.stop()
                    srv = None
                if srv is None:
                    srv = ac.Server.attach(a.base_url) if a.base_url else ac.Server.start(
                        mode, log_dir, dtype=a.dtype, max_running=max(a.sessions))
                for w, key in zip(a.workloads, keys):
                    srv.flush_cache()
                    turns, wall = asyncio.run(ac.run_level(srv.base, convs[w], n, **kw))
                    payload["cells"][key] = {"summary": ac.summarize(turns, wall), "turns": [t.row() for t in turns]}
                    ac.write_json(a.out, payload)
                    bar.update(1)
        finally:
            if srv is not None:
                srv.stop()
    bar.close()
    payload["table"] = table_rows(a, payload["cells"])
    ac.write_json(a.out, payload)
    return payload


def _turns(cell):
    return [ac.TurnRecord(**{k: v for k, v in t.items() if k in ac.TurnRecord.__dataclass_fields__}) for t in cell["turns"]]


def table_rows(a, cells) -> list:
    rows = []
    for w in a.workloads:
        for n in a.sessions:
            per_mode = {}
            for m in a.modes:
                reps = [cells[k]["summary"] for r in range(a.repeats) if (k := cell_key(w, n, m, r)) in cells]
                if reps:
                    per_mode[m] = ac.median_rows(reps)
            for m, row in per_mode.items():
                out = {"workload": w, "sessions": n, "mode": m, **row}
                for ref in ("nospec", "ngram"):
                    if ref in per_mode and ref != m and m != "nospec":  # paired: the median of same-repeat ratios
                        ratios = [cells[cell_key(w, n, m, r)]["summary"]["tokens_per_s"] /
                                  cells[cell_key(w, n, ref, r)]["summary"]["tokens_per_s"]
                                  for r in range(a.repeats) if cell_key(w, n, m, r) in cells and cell_key(w, n, ref, r) in cells]
                        out[f"x_{ref}"] = round(median(ratios), 3) if ratios else None
                if "nospec" in per_mode and m != "nospec":
                    b = per_mode["nospec"]["ttft_turn2plus_p50_s"]
                    out["ttft_turn2plus_vs_nospec"] = round(row["ttft_turn2plus_p50_s"] / b, 3) if b else None
                    par = [ac.parity(_turns(cells[cell_key(w, n, m, r)]), _turns(cells[cell_key(w, n, "nospec", r)]))
                           for r in range(a.repeats) if cell_key(w, n, m, r) in cells and cell_key(w, n, "nospec", r) in cells]
                    out["cached_tokens_mismatches"] = sum(p["cached_tokens_mismatches"] for p in par)
                    out["output_mismatches"] = sum(p["output_mismatches"] for p in par)
                    out["requests_compared"] = sum(p["requests"] for p in par)
                    out["cache_compared"] = sum(p["cache_compared"] for p in par)
                    out["cached_plus_one_at_length_stop"] = sum(p["cached_plus_one_at_length_stop"] for p in par)
                rows.append(out)
    return rows


def print_table(rows) -> None:
    cols = [("workload", "workload"), ("sessions", "sess"), ("mode", "mode"), ("tokens_per_s", "tok/s"),
            ("x_nospec", "x nospec"), ("x_ngram", "x ngram"), ("tau", "tau"), ("ttft_p50_s", "TTFT p50 s"),
            ("ttft_turn2plus_vs_nospec", "turn>=2 TTFT / nospec"), ("itl_p50_ms", "ITL p50 ms"),
            ("itl_p95_ms", "ITL p95 ms"), ("cached_tokens_mismatches", "cached !="), ("cached_plus_one_at_length_stop", "cached +1 (length stop)"),
            ("cache_compared", "cache compared"),
            ("output_mismatches", "output !="), ("requests_compared", "compared")]
    print("| " + " | ".join(h for _, h in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("–" if r.get(k) is None else str(r.get(k)) for k, _ in cols) + " |")


def plot(rows, path) -> None:
    try:
        import matplotlib  # optional: the table and JSON do without it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional, as above
    except ImportError:
        print("# matplotlib missing: no PNG")
        return
    groups = sorted({(r["workload"], r["sessions"]) for r in rows})
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        get = {(r["workload"], r["sessions"]): r for r in rows if r["mode"] == m}
        xs = [g for g in range(len(groups))]
        axes[0].bar([x + i * width for x in xs], [get.get(g, {}).get("tokens_per_s") or 0 for g in groups], width, label=m)
        axes[1].bar([x + i * width for x in xs], [get.get(g, {}).get("ttft_turn2plus_p50_s") or 0 for g in groups], width, label=m)
    for ax, title in zip(axes, ("tokens/s (streamed, all sessions)", "TTFT p50, turns >= 2 (s)")):
        ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(groups))])
        ax.set_xticklabels([f"{w}\n{n} sess." for w, n in groups], fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# wrote {path}")


def main(argv=None) -> int:
    a = parse_args(argv)
    payload = run(a)
    print_table(payload["table"])
    plot(payload["table"], os.path.splitext(a.out)[0] + ".png")
    print(f"# wrote {a.out}")
    bad = [r for r in payload["table"] if r.get("cached_tokens_mismatches") or (a.dtype == "float32" and r.get("output_mismatches"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
