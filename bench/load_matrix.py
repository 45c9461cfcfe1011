"""The load matrix (issue 48): DLITE vs no speculation (and sglang's NGRAM / EAGLE3) in sglang at every
concurrency, over workloads x output lengths x dtypes, three fresh-engine runs per cell, medians.

    python bench/load_matrix.py --workloads agent-stdlib,bfcl-multiturn --lengths 128,512 \\
        --dtypes bfloat16,float32 --concurrency 1,2,4,8,16,32,64 --modes nospec,dlite,ngram --repeats 3 \\
        --out-dir artifacts/load/matrix

Every run is ``benchmarking.sglang_runs.run_sglang``, as in ``bench/e2e.py`` (one engine per mode and repeat, every level on it,
the radix cache flushed between levels; sglang's NGRAM and DLITE with online learning get a fresh engine
per level: NGRAM's corpus and the adapted drafter remember the requests of the level before; on a CPU,
no speculation's decode forwards read the KV cache through the same attention code as DLITE's verify,
and every mode's prefill through the project's, unless ``--baseline-attention sglang``). Level c runs the first ``max(--min-requests, 2c)`` of
``--requests`` requests (capped there), so a level stays full for most of its run while c = 1
does not take hours on a CPU; the modes of a repeat run in rotated order (drift hits all alike).

Resumable: each finished (cell, mode, repeat, level) is appended to ``OUT_DIR/runs.jsonl`` with its
outputs; a rerun of the same command skips what is there (stop it any time). ``--report-only``
writes the report from what is there.

Report (``OUT_DIR/matrix.json``, a table printed): per (cell, mode, level) the medians over the
repeats of tokens/s, TTFT p50, inter-token latency p50 / p99 and tau, and the speed-up over no
speculation's median in the same cell and level; mismatches of the first repeat's outputs against
no speculation's (``dlite_lab.divergence``: bf16 ties are not mismatches; float32 must be
identical). PNGs: ``speedup_vs_concurrency.png`` (one panel per cell, a line per mode, the 1.0x
line) and ``tau_by_position.png`` (tau by how far into the answer the round started, every level
and repeat pooled, from the worker's round log).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

from dlite_lab.benchmarking.sglang_runs import (ATTENTION, POSITION_BUCKET, build_requests, jsonl_after,
                                                   pool_rounds_by_position, prefill_attention, remembers_requests,
                                                   run_sglang, tau_by_position)
from sglang_dlite.drafting.tau import TAU_DEFINITION

REPO = Path(__file__).resolve().parents[1]
STATS = ("tokens_per_s", "ttft_p50_s", "itl_p50_ms", "itl_p99_ms", "tau")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="agent-stdlib")
    p.add_argument("--lengths", default="128", help="max new tokens per request, comma-separated")
    p.add_argument("--dtypes", default="bfloat16", help="target dtypes, comma-separated (bfloat16, float32)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--modes", default="nospec,dlite", help="bench/e2e.py modes (nospec is the baseline, required)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=64, help="requests built per workload (every turn of each "
                                                            "conversation, conversations in order)")
    p.add_argument("--min-requests", type=int, default=16, help="level c runs max(this, 2c) requests")
    p.add_argument("--max-convs", type=int, default=64)
    p.add_argument("--out-dir", default="artifacts/load/matrix")
    p.add_argument("--baseline-attention", choices=ATTENTION, default="same",
                   help="a CPU's decode attention: same (default: no speculation's decode forwards read the KV "
                        "cache through the attention code DLITE's verify runs) or sglang (as sglang ships it, "
                        "slower at a batch of several requests); runs of the other kind in OUT_DIR are ignored")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-score", action="store_true", help="skip the float32 divergence scoring")
    return p.parse_args(argv)


def split(text, kind=str):
    return [kind(x) for x in text.split(",") if x]


def requests_at(args, total):
    return lambda c: min(total, max(args.min_requests, 2 * c))


def key(rec) -> tuple:
    return rec["workload"], rec["max_new_tokens"], rec["dtype"], rec["mode"], rec["repeat"], rec["concurrency"]


def load_runs(path: Path, attention: str) -> list:
    """The runs in ``path`` measured with ``attention`` (runs before the option: sglang's) and its
    prefill attention (runs before it was recorded: sglang's), so a resumed matrix never mixes them."""
    return [r for r in jsonl_after(str(path), 0) if r.get("attention", "sglang") == attention
            and r.get("prefill_attention", "sglang") == prefill_attention(attention)]


def measure(args, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    from sglang_dlite.model.dlite import shipped_drafter_path
    from sglang_dlite.model.bundled_target import resolve_target

    target, draft = resolve_target("default"), shipped_drafter_path()
    tok = AutoTokenizer.from_pretrained(target)
    runs_path = out_dir / "runs.jsonl"
    done = {key(r) for r in load_runs(runs_path, args.baseline_attention)}
    levels, modes = split(args.concurrency, int), split(args.modes)
    cells = [(w, n, d) for w in split(args.workloads) for n in split(args.lengths, int) for d in split(args.dtypes)]
    todo = sum(1 for (w, n, d) in cells for rep in range(args.repeats) for m in modes for c in levels
               if (w, n, d, m, rep, c) not in done)
    print(f"{len(cells)} cells x {len(modes)} modes x {args.repeats} repeats x {len(levels)} levels: "
          f"{todo} (cell, mode, repeat, level) runs to go, {len(done)} done ({runs_path})", flush=True)
    from tqdm import tqdm

    bar = tqdm(total=todo, unit="level", dynamic_ncols=True)
    for workload, length, dtype in cells:
        reqs = build_requests(tok, workload, args.max_convs, args.requests, length)
        at = requests_at(args, len(reqs))
        for rep in range(args.repeats):
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                missing = [c for c in levels if (workload, length, dtype, mode, rep, c) not in done]
                groups = [[c] for c in missing] if remembers_requests(mode) else [missing] if missing else []
                for group in groups:
                    def on_level(row, outputs, _mode=mode, _rep=rep):
                        rec = {"workload": workload, "max_new_tokens": length, "dtype": dtype, "mode": _mode,
                               "repeat": _rep, "concurrency": row["concurrency"], "attention": args.baseline_attention,
                               "prefill_attention": prefill_attention(args.baseline_attention),
                               "row": row, "outputs": outputs,
                               "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
                        with open(runs_path, "a", encoding="utf-8") as f:
                            f.write(json.dumps(rec) + "\n")
                        done.add(key(rec))
                        bar.update(1)
                        bar.set_postfix_str(f"{workload} {length} {dtype} {_mode} r{_rep} c{row['concurrency']}: "
                                            f"{row['tokens_per_s']} tok/s")

                    run_sglang(mode, target, draft, reqs, group, length, "cpu", dtype, requests_at=at,
                               on_level=on_level, attention=args.baseline_attention)
    bar.close()


def report(args, out_dir: Path) -> dict:
    from sglang_dlite.model.bundled_target import resolve_target

    recs = load_runs(out_dir / "runs.jsonl", args.baseline_attention)
    if not recs:
        raise SystemExit(f"{out_dir / 'runs.jsonl'} holds no run with --baseline-attention {args.baseline_attention} yet")
    groups = {}
    for r in recs:
        groups.setdefault((r["workload"], r["max_new_tokens"], r["dtype"], r["mode"], r["concurrency"]), []).append(r)
    rows = []
    for (w, n, d, m, c), rs in sorted(groups.items(), key=lambda kv: (kv[0][:3], kv[0][4], kv[0][3])):
        row = {"workload": w, "max_new_tokens": n, "dtype": d, "mode": m, "concurrency": c, "repeats": len(rs),
               "requests": rs[0]["row"]["requests"]}
        for s in STATS:
            vals = [x["row"][s] for x in rs if x["row"].get(s) is not None]
            row[s] = round(median(vals), 3) if vals else None
        tps = [x["row"]["tokens_per_s"] for x in rs]
        runs = [x["row"] for x in rs]
        row.update(tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
                   rounds_by_position=pool_rounds_by_position(runs), tau_by_position=tau_by_position(runs))
        rows.append(row)
    base = {(r["workload"], r["max_new_tokens"], r["dtype"], r["concurrency"]): r for r in rows if r["mode"] == "nospec"}
    for r in rows:
        b = base.get((r["workload"], r["max_new_tokens"], r["dtype"], r["concurrency"]))
        r["speedup"] = round(r["tokens_per_s"] / b["tokens_per_s"], 3) if b and r["mode"] != "nospec" else None
        r["ttft_ratio"] = (round(r["ttft_p50_s"] / b["ttft_p50_s"], 3)
                           if b and r["mode"] != "nospec" and r["ttft_p50_s"] and b["ttft_p50_s"] else None)
    if not args.no_score:
        score_mismatches(rows, recs, resolve_target("default"), args)
    print("\n| workload | tokens | dtype | c | mode | tok/s (median) | speed-up | tau | TTFT p50 s (vs no spec) "
          "| ITL p50 / p99 ms | runs | mismatches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        tt = "" if r["ttft_ratio"] is None else f" ({r['ttft_ratio']:.2f}x)"
        print(f"| {r['workload']} | {r['max_new_tokens']} | {r['dtype']} | {r['concurrency']} | {r['mode']} | "
              f"{r['tokens_per_s']} | {sp} | {r['tau'] if r['tau'] is not None else ''} | {r['ttft_p50_s']}{tt} | "
              f"{r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['repeats']} | {r.get('mismatches', '')} |")
    result = {"command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "baseline_attention": args.baseline_attention, "prefill_attention": prefill_attention(args.baseline_attention),
              "tau_definition": TAU_DEFINITION, "position_bucket": POSITION_BUCKET, "rows": rows}
    (out_dir / "matrix.json").write_text(json.dumps(result, indent=2))
    plot(rows, out_dir)
    print(f"wrote {out_dir / 'matrix.json'}, {out_dir / 'speedup_vs_concurrency.png'}, "
          f"{out_dir / 'tau_by_position.png'}")
    return result


def score_mismatches(rows, recs, target, args) -> None:
    """Mismatches of each mode's first-repeat outputs against no speculation's first repeat, same cell and
    level (bf16: precision ties are not mismatches, ``dlite_lab.divergence``)."""
    from transformers import AutoTokenizer

    from dlite_lab.divergence import DEFAULT_TIE_MARGIN, Fp32LogitGap, classify_divergences, is_mismatch

    tok = AutoTokenizer.from_pretrained(target)
    first = {}
    for r in recs:
        k = (r["workload"], r["max_new_tokens"], r["dtype"], r["mode"], r["concurrency"])
        if k not in first or r["repeat"] < first[k]["repeat"]:
            first[k] = r
    score, reqs_of = Fp32LogitGap(target), {}
    try:
        for row in rows:
            if row["mode"] == "nospec":
                continue
            w, n, d, m, c = (row[x] for x in ("workload", "max_new_tokens", "dtype", "mode", "concurrency"))
            a, b = first.get((w, n, d, m, c)), first.get((w, n, d, "nospec", c))
            if not (a and b) or len(a["outputs"]) != len(b["outputs"]):
                continue
            if (w, n) not in reqs_of:
                reqs_of[(w, n)] = build_requests(tok, w, args.max_convs, args.requests, n)
            reqs = reqs_of[(w, n)][: len(a["outputs"])]
            div = classify_divergences(reqs, a["outputs"], b["outputs"], score, DEFAULT_TIE_MARGIN,
                                       noise=score.bf16_noise if d == "bfloat16" else None)
            row.update(identical=len(reqs) - len(div), ties=sum(x["tie"] for x in div),
                       mismatches=sum(is_mismatch(x) for x in div) if d == "bfloat16" else len(div))
    finally:
        score.close()


def plot(rows, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["workload"], r["max_new_tokens"], r["dtype"]) for r in rows})
    for name, draw in (("speedup_vs_concurrency.png", _speedup_panel), ("tau_by_position.png", _position_panel)):
        fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
        for ax, cell in zip(axes[0], cells):
            draw(ax, [r for r in rows if (r["workload"], r["max_new_tokens"], r["dtype"]) == cell])
            ax.set_title(f"{cell[0]}, {cell[1]} tokens, {cell[2]}", fontsize=9)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)


def _speedup_panel(ax, rows) -> None:
    for m in sorted({r["mode"] for r in rows if r["speedup"] is not None}):
        pts = sorted((r["concurrency"], r["speedup"]) for r in rows if r["mode"] == m and r["speedup"] is not None)
        ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=m)
    ax.axhline(1.0, ls="--", c="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("tokens/s vs no speculation (median of runs)")


def _position_panel(ax, rows) -> None:
    for m in sorted({r["mode"] for r in rows if r["tau_by_position"]}):
        tau = tau_by_position([r for r in rows if r["mode"] == m])  # every level and repeat pooled
        ax.plot([k + POSITION_BUCKET / 2 for k in tau], list(tau.values()), marker="o", label=m)
    ax.set_xlabel("output position (tokens into the answer)")
    ax.set_ylabel("tau (tokens committed per round)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if "nospec" not in split(args.modes):
        raise SystemExit("--modes must include nospec: every speed-up is over no speculation in the same cell")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        measure(args, out_dir)
    report(args, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
