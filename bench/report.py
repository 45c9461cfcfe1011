#!/usr/bin/env python
"""Turn the benchmark JSON files into bench/RESULTS.md (tables) and PNG plots.

    python bench/report.py [--results artifacts/results] [--out bench/RESULTS.md] [--plots bench/plots]

Reads whatever exists (any subset is fine):
  - acceptance results ``acc_*.json`` written by ``bench/acceptance.py`` (one per drafter x workload
    [x engine]; when several files share drafter, workload, engine and temperature, the newest wins);
  - draft-cost results ``draft_cost*.json`` written by ``bench/draft_cost.py`` (the newest is used);
  - sglang end-to-end results written by ``bench/e2e.py`` (``--e2e FILE ...``).
Writes: tau per drafter x workload; tau per context bucket (all workloads pooled, rounds-weighted)
and per workload; per-position acceptance; end-to-end tokens/s vs autoregressive; draft ms and
drafter memory vs context; the commands that produced each file. Plots (bench/plots/):
tau_vs_context.png, tau_vs_output_position.png, draft_ms_vs_context.png, speedup_per_workload.png,
e2e_speedup.png.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

from dlite_lab.benchmarking.draft_rounds import draft_cost_table, plot_draft_cost
from sglang_dlite.drafting.tau import TAU_DEFINITION, pool_tau

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = ("0-1k", "1-2k", "2-4k", "4-8k", ">=8k")
DRAFTER_ORDER = ("hybrid", "suffix", "dlite", "dlite-teacher", "dlite-window128", "dlite-window512", "dlite-single",
                 "eagle3", "dflash", "dspark", "ngram")


# Fixed styles for the drafters the headline compares; the rest get colour x marker x dash
# combinations (tab10 alone has 10 colours, so 11 series repeated a colour before).
FIXED_STYLES = {"hybrid": ("black", "o", "-"), "suffix": ("tab:orange", "s", "-"), "dlite": ("tab:blue", "^", "-"),
                "ngram": ("tab:red", "D", "-")}
_COLOURS = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan",
            "gold", "navy", "teal", "maroon", "lime")
_MARKERS = ("v", "P", "X", "*", "h", "<", ">", "p")
_DASHES = ("--", "-.", ":")
_GENERIC = {"model", "stabilize", "distill", "teacher", "final", "checkpoint", "export", ""}


def display_name(drafter: str) -> str:
    """A drafter's label: its name, plus a short tag of its checkpoint folder (never the path)."""
    base, _, path = drafter.partition(":")
    if not path:
        return base
    parts = [x for x in Path(path).parts if x not in _GENERIC and x not in ("artifacts", "train", "/")]
    return f"{base} ({parts[-1]})" if parts else base


def series_style(label: str, i: int) -> dict:
    """Distinct colour/marker/dash per series index (fixed ones for the headline drafters)."""
    if label in FIXED_STYLES:
        c, m, ls = FIXED_STYLES[label]
        return {"color": c, "marker": m, "linestyle": ls, "linewidth": 2.2 if label == "hybrid" else 1.5}
    return {"color": _COLOURS[i % len(_COLOURS)], "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _DASHES[i % len(_DASHES)], "linewidth": 1.2}


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def drafter_key(name: str):
    base = name.split(":", 1)[0]
    return (DRAFTER_ORDER.index(base) if base in DRAFTER_ORDER else len(DRAFTER_ORDER), name)


def load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"warning: skipping {path}: {exc}", file=sys.stderr)
        return None


def load_acceptance(results_dir: str):
    """{(engine, drafter, workload, temperature): result} keeping the newest file per key."""
    files = sorted(glob.glob(os.path.join(results_dir, "acc_*.json")), key=os.path.getmtime)
    out, skipped = OrderedDict(), []
    for f in files:
        r = load_json(f)
        if not r or "tau" not in r or "drafter" not in r or "workload" not in r:
            skipped.append(f)
            continue
        key = (r.get("engine", "reference"), r["drafter"], os.path.basename(str(r["workload"])),
               r.get("temperature", 0.0))
        r["_file"] = os.path.relpath(f, ROOT) if os.path.isabs(f) else f
        out[key] = r  # newest last
    return out, skipped


def load_draft_cost(results_dir: str):
    files = sorted(glob.glob(os.path.join(results_dir, "draft_cost*.json")), key=os.path.getmtime)
    for f in reversed(files):
        r = load_json(f)
        if r and r.get("kind") == "draft_cost" and r.get("results"):
            r["_file"] = f
            return r
    return None


# ---------------------------------------------------------------------------- tables
def pooled_by_context(rs):
    """Tau per context bucket pooled over several result files (``drafting.tau.pool_tau``: their
    committed tokens over their rounds) -> {bucket: (tau, rounds)}."""
    parts = {}
    for r in rs:
        for b, t in (r.get("tau_by_context") or {}).items():
            parts.setdefault(b, []).append((t, (r.get("rounds_by_context") or {}).get(b, 0)))
    out = {}
    for b, ps in parts.items():
        pooled = pool_tau(ps)
        if pooled is not None:
            out[b] = (pooled, sum(k for t, k in ps if t is not None and k))
    return out


def pooled_per_position(rs):
    K = max((len(r.get("per_position_accept") or []) for r in rs), default=0)
    out = []
    for i in range(K):
        num = den = 0.0
        for r in rs:
            pp = r.get("per_position_accept") or []
            if i < len(pp) and pp[i] is not None and r.get("rounds"):
                num += pp[i] * r["rounds"]
                den += r["rounds"]
        out.append(num / den if den else None)
    return out


def tables_acceptance(acc) -> list:
    lines = []
    groups = OrderedDict()
    for (engine, drafter, workload, temp), r in acc.items():
        groups.setdefault((engine, temp), {})[(drafter, workload)] = r
    for (engine, temp), rs in groups.items():
        drafters = sorted({d for d, _ in rs}, key=drafter_key)
        workloads = sorted({w for _, w in rs})
        tag = f"engine={engine}, temperature={temp}"
        lines += [f"### Acceptance length tau per workload ({tag})", "",
                  f"tau = {TAU_DEFINITION} (accepted drafts + the bonus token; 1 = nothing accepted). "
                  "Cell: tau (rounds)." + _old_tau_note(rs.values()), ""]
        lines.append("| drafter | " + " | ".join(workloads) + " | all (rounds-weighted) |")
        lines.append("|---|" + "---|" * (len(workloads) + 1))
        warned = {d: sorted({w for (dd, _), r in rs.items() if dd == d for w in (r.get("drafter_warnings") or [])})
                  for d in drafters}
        for d in drafters:
            cells, parts = [], []
            for w in workloads:
                r = rs.get((d, w))
                if r is None or r.get("tau") is None:
                    cells.append("-")
                    continue
                cells.append(f"{r['tau']:.2f} ({r.get('rounds', 0)})")
                parts.append((r["tau"], r.get("rounds", 0)))
            mark = " †" if warned[d] else ""
            lines.append(f"| {d}{mark} | " + " | ".join(cells) + f" | {fmt(pool_tau(parts))} |")
        for d in drafters:
            for w in warned[d]:
                lines.append(f"\n† {d}: {w}")
        lines += ["", f"### tau per context bucket, all workloads pooled ({tag})", "",
                  "Context = committed tokens before the round. Cell: tau (rounds).", ""]
        buckets = [b for b in BUCKETS if any(b in (r.get("tau_by_context") or {}) for r in rs.values())]
        lines.append("| drafter | " + " | ".join(buckets) + " |")
        lines.append("|---|" + "---|" * len(buckets))
        for d in drafters:
            pooled = pooled_by_context([r for (dd, _), r in rs.items() if dd == d])
            lines.append(f"| {d} | " + " | ".join(
                f"{pooled[b][0]:.2f} ({pooled[b][1]})" if b in pooled else "-" for b in buckets) + " |")
        lines += ["", f"<details><summary>tau per context bucket, per workload ({tag})</summary>", "",
                  "| drafter | workload | " + " | ".join(buckets) + " |", "|---|---|" + "---|" * len(buckets)]
        for d in drafters:
            for w in workloads:
                r = rs.get((d, w))
                if r is None:
                    continue
                tb, rb = r.get("tau_by_context") or {}, r.get("rounds_by_context") or {}
                lines.append(f"| {d} | {w} | " + " | ".join(
                    f"{tb[b]:.2f} ({rb.get(b, 0)})" if tb.get(b) is not None else "-" for b in buckets) + " |")
        lines += ["", "</details>", ""]
        lines += tables_source_share(rs, drafters, workloads, buckets, tag)
        lines += [f"### Per-position acceptance P[draft i accepted] ({tag})", ""]
        K = max((len(r.get("per_position_accept") or []) for r in rs.values()), default=0)
        lines.append("| drafter | " + " | ".join(f"i={i + 1}" for i in range(K)) + " |")
        lines.append("|---|" + "---|" * K)
        for d in drafters:
            pp = pooled_per_position([r for (dd, _), r in rs.items() if dd == d])
            lines.append(f"| {d} | " + " | ".join(fmt(p, ".3f") for p in pp) + " |")
        lines += ["", f"### End-to-end speed vs the target alone ({tag})", "",
                  "tokens/s = generated tokens over prefill + decode time of the same turns; speed-up = "
                  "speculative / autoregressive. Draft and verify ms are per round.", "",
                  "| drafter | workload | spec tok/s | AR tok/s | speed-up | draft ms | verify ms | lossless |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in drafters:
            for w in workloads:
                r = rs.get((d, w))
                if r is None:
                    continue
                if r.get("lossless_checked"):
                    ll = "ok" if not r.get("lossless_mismatches") else f"{r['lossless_mismatches']} mismatched"
                else:
                    ll = "not checked"
                lines.append(f"| {d} | {w} | {fmt(r.get('spec_tokens_per_s'), '.1f')} | "
                             f"{fmt(r.get('ar_tokens_per_s'), '.1f')} | {fmt(r.get('speedup'))}x | "
                             f"{fmt(r.get('draft_ms_per_round'), '.1f')} | {fmt(r.get('verify_ms_per_round'), '.1f')} | {ll} |")
        lines.append("")
    return lines


SOURCES = ("suffix", "mixed", "dlite", "none")


def tables_source_share(rs, drafters, workloads, buckets, tag) -> list:
    """Share of rounds per drafting source (hybrid / suffix runs), per workload and per context
    bucket (pooled), and the chooser's calibration: predicted vs actual accepted drafts."""
    have = [d for d in drafters if any(r.get("by_source") for (dd, _), r in rs.items() if dd == d)]
    if not have:
        return []
    lines = [f"### Share of rounds per drafting source ({tag})", "",
             "suffix = the suffix lookup's chain, mixed = DLite's first drafts continued by the lookup, "
             "dlite = DLite's chain, none = nothing to draft (a 1-token verify). Cell: share of rounds "
             "(tau of those rounds).", "",
             "| drafter | workload | " + " | ".join(SOURCES) + " |", "|---|---|" + "---|" * len(SOURCES)]
    for d in have:
        for w in workloads:
            r = rs.get((d, w))
            if r is None or not r.get("by_source"):
                continue
            bs = r["by_source"]
            lines.append(f"| {d} | {w} | " + " | ".join(
                f"{bs[s]['share']:.0%} ({bs[s]['tau']:.2f})" if s in bs else "-" for s in SOURCES) + " |")
    lines += ["", "Pooled over workloads, by context bucket (share of rounds: suffix / mixed / dlite):", "",
              "| drafter | " + " | ".join(buckets) + " |", "|---|" + "---|" * len(buckets)]
    for d in have:
        cells = []
        for b in buckets:
            cnt = {}
            for (dd, _), r in rs.items():
                if dd != d:
                    continue
                for s, x in (r.get("by_source") or {}).items():
                    cnt[s] = cnt.get(s, 0) + (x.get("rounds_by_context") or {}).get(b, 0)
            tot = sum(cnt.values())
            cells.append(" / ".join(f"{cnt.get(s, 0) / tot:.0%}" for s in SOURCES[:3]) if tot else "-")
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    lines += ["", "Calibration of the chooser's estimate (mean accepted drafts per round, pooled):", "",
              "| drafter | source | rounds | predicted | actual |", "|---|---|---|---|---|"]
    for d in have:
        for s in SOURCES:
            n = pred = act = 0
            for (dd, _), r in rs.items():
                x = (r.get("by_source") or {}).get(s) if dd == d else None
                if x:
                    n += x["rounds"]
                    pred += x["predicted_accepted"]
                    act += x["actual_accepted"]
            if n:
                lines.append(f"| {d} | {s} | {n} | {pred / n:.2f} | {act / n:.2f} |")
    return lines + [""]


def _load(x):
    return f"{x[0]:.1f}" if isinstance(x, (list, tuple)) and x else "?"


def tables_draft_cost(dc) -> list:
    env = dc.get("env", {})
    lines = ["### Draft cost vs context length", "",
             f"ms per draft round (median over {env.get('rounds', '?')} steady-state rounds, "
             f"{env.get('accept_per_round', '?')} drafts accepted + 1 bonus per round) and drafter memory per "
             f"request (state the drafter keeps between rounds: its own KV cache). CPU, {env.get('dtype')}, "
             f"{env.get('threads')} thread(s), 1-min load average {_load(env.get('loadavg_start'))} -> "
             f"{_load(env.get('loadavg_end'))} on {env.get('cores', '?')} cores. "
             f"{env.get('note', '')}", "", draft_cost_table(dc), ""]
    lines += ["Drafters as measured:", ""] + [f"- `{k}`: {v}" for k, v in env.get("drafters", {}).items()] + [""]
    return lines


def load_e2e(paths) -> list:
    out = []
    for f in paths or []:
        r = load_json(f)
        if r and r.get("table") is not None:
            r["_file"] = os.path.relpath(os.path.abspath(f), ROOT)
            out.append(r)
        elif r is not None:
            print(f"warning: {f} is not a bench/e2e.py result", file=sys.stderr)
    return out


def _old_tau_note(results) -> str:
    """A note for acceptance results recorded before ``tau_definition`` was written: their tau
    also counted the tokens a turn's last round computed past its EOS / token limit."""
    old = [r for r in results if "tau_definition" not in r]
    return (f" {len(old)} of these files predate the recorded definition: their tau also counted the tokens a "
            "turn's last round computed past its EOS / token limit (slightly higher)." if old else "")


def tables_e2e(results) -> list:
    lines = []
    for r in results:
        rows = {(x["mode"], x["concurrency"]): x for x in r.get("rows", [])}
        if "tau_definition" in r:
            tau_note = f"tau: {r['tau_definition']}."
        elif r.get("engine") == "sglang":
            tau_note = ("tau: recorded before the definition was unified: sglang's completion tokens / verify "
                        "rounds, the prefill's token INCLUDED (higher than tau by requests / verify rounds).")
        else:
            tau_note = "tau: committed tokens per verify round, the prefill's token excluded."
        lines += [f"### {r.get('engine')} engine, {r.get('device')}, {r.get('workload')}, {r.get('dtype', '?')}, "
                  f"{r.get('max_new_tokens')} new tokens, median of {r.get('repeats', 1)} run(s)", "",
                  f"`{r.get('command')}`", "", tau_note, "",
                  "| mode | concurrency | spec tok/s (min-max) | no-spec tok/s (min-max) | speed-up | tau | "
                  "identical | bf16 precision ties | mismatches |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in r["table"]:
            d, b = rows.get((t["mode"], t["concurrency"]), {}), rows.get(("nospec", t["concurrency"]), {})

            def rng(x):
                return f" ({x['tokens_per_s_min']}-{x['tokens_per_s_max']})" if "tokens_per_s_min" in x else ""

            ident = f"{t['identical']}/{t['requests']}" if "identical" in t else str(t.get("identical_outputs"))
            lines.append(f"| {t['mode']} | {t['concurrency']} | {t['spec_tok_s']}{rng(d)} | {t['nospec_tok_s']}{rng(b)} | "
                         f"{t['speedup']}x | {t['tau']} | {ident} | {t.get('ties', '-')} | {t.get('mismatches', '-')} |")
        floors = [(k, v) for k, v in (r.get("divergences") or {}).items() if k.startswith("nospec@")]
        for k, v in floors:
            lines.append(f"\nNo-speculation floor, {k}: {len(v)} of the requests differ, "
                         f"{sum(x['tie'] for x in v)} of them at bf16 precision ties.")
        lines.append("")
    return lines


# ---------------------------------------------------------------------------- plots
def _finish(fig, ax, plt, path: Path, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    """Labels, grid, legend; save as PNG and close."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_e2e(results, plots: Path, plt) -> list:
    if not results:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in results:
        modes = sorted({t["mode"] for t in r["table"]})
        for m in modes:
            ts = sorted((t for t in r["table"] if t["mode"] == m), key=lambda t: t["concurrency"])
            ax.plot([t["concurrency"] for t in ts], [t["speedup"] for t in ts], marker="o",
                    label=f"{m} ({r.get('workload')}, {r.get('dtype', '?')})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    _finish(fig, ax, plt, plots / "e2e_speedup.png", "concurrent requests", "tokens/s vs no speculation",
            "sglang end to end: DLITE speed-up vs concurrency", legend_size=7)
    return ["e2e_speedup.png"]


def plot_output_position(ref, plots: Path, plt, name: str = "tau_vs_output_position.png",
                         title: str = "tau vs position in the answer (all workloads pooled)") -> list:
    """tau vs how far into its answer a round starts (``tau_by_output_position``), per drafter, all
    workloads pooled (``drafting.tau.pool_tau``): does acceptance decay over a long answer?
    ``ref``: {(engine, drafter, workload, temperature): an acceptance result}."""
    series = {}
    for k, r in ref.items():
        for b, t in (r.get("tau_by_output_position") or {}).items():
            series.setdefault(k[1], {}).setdefault(b, []).append((t, (r.get("rounds_by_output_position") or {}).get(b, 0)))
    pooled = {d: {b: pool_tau(ps) for b, ps in by.items()} for d, by in series.items()}
    pooled = {d: {b: t for b, t in by.items() if t is not None} for d, by in pooled.items()}
    if not any(pooled.values()):
        return []
    order = [b for b in ("0-63", "64-127", "128-255", "256-511", "512-1023", "1024+")
             if any(b in by for by in pooled.values())]  # the buckets some drafter has rounds in
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, d in enumerate(sorted(pooled, key=drafter_key)):
        xs = [b for b in order if b in pooled[d]]
        label = display_name(d)
        ax.plot([order.index(b) for b in xs], [pooled[d][b] for b in xs], label=label, **series_style(label, i))
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(order)
    _finish(fig, ax, plt, plots / name, "output tokens committed before the round", "acceptance length tau", title)
    return [name]


def plot_all(acc, dc, plots: Path, e2e=None) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib missing: no plots", file=sys.stderr)
        return []
    plots.mkdir(parents=True, exist_ok=True)
    made = []
    ref = {k: r for k, r in acc.items() if k[3] == 0.0} or acc
    if ref:
        drafters = sorted({k[1] for k in ref}, key=drafter_key)
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for i, d in enumerate(drafters):
            pooled = pooled_by_context([r for k, r in ref.items() if k[1] == d])
            xs = [b for b in BUCKETS if b in pooled]
            if xs:
                label = display_name(d)
                ax.plot([BUCKETS.index(b) for b in xs], [pooled[b][0] for b in xs], label=label,
                        **series_style(label, i))
        used = [i for i, b in enumerate(BUCKETS) if any(b in pooled_by_context([r for k, r in ref.items() if k[1] == d])
                                                        for d in drafters)]
        ax.set_xticks(used)
        ax.set_xticklabels([BUCKETS[i] for i in used])
        _finish(fig, ax, plt, plots / "tau_vs_context.png", "context length before the round (tokens)",
                "acceptance length tau", "tau vs context length (all workloads pooled)")
        made.append("tau_vs_context.png")

        workloads = sorted({k[2] for k in ref})
        fig, ax = plt.subplots(figsize=(max(6.5, 1.4 * len(workloads) + 2), 4.2))
        width = 0.8 / max(len(drafters), 1)
        for i, d in enumerate(drafters):
            ys = []
            for w in workloads:
                r = next((r for k, r in ref.items() if k[1] == d and k[2] == w), None)
                ys.append(r.get("speedup") or 0.0 if r else 0.0)
            st = series_style(display_name(d), i)
            ax.bar([j + i * width for j in range(len(workloads))], ys, width, label=display_name(d),
                   color=st["color"], hatch=None if display_name(d) in FIXED_STYLES else ("//", "..", "xx")[i % 3])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
        ax.set_xticklabels(workloads, rotation=15, fontsize=8)
        ax.set_ylabel("speed-up vs autoregressive")
        ax.set_title("end-to-end speed-up per workload")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / "speedup_per_workload.png", dpi=110)
        plt.close(fig)
        made.append("speedup_per_workload.png")
        made += plot_output_position(ref, plots, plt)
    if dc:
        plot_draft_cost(dc, plots / "draft_ms_vs_context.png")
        made.append("draft_ms_vs_context.png")
    made += plot_e2e(e2e, plots, plt)
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="bench JSON -> bench/RESULTS.md + PNG plots")
    ap.add_argument("--results", default=str(ROOT / "artifacts" / "results"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    ap.add_argument("--plots", default=str(ROOT / "bench" / "plots"))
    ap.add_argument("--e2e", nargs="*", default=[], help="bench/e2e.py result JSON files to include")
    args = ap.parse_args(argv)

    acc, skipped = load_acceptance(args.results)
    dc = load_draft_cost(args.results)
    e2e = load_e2e(args.e2e)
    out, plots = Path(args.out), Path(args.plots)
    lines = ["# Results: DLite and the baselines side by side", "",
             f"Generated by `python bench/report.py` from `{os.path.relpath(args.results, ROOT)}`; "
             "every number comes from a JSON file listed under *Sources*. Missing cells: not run yet.", ""]
    if not acc and not dc:
        lines += ["No results yet. Produce them with `bench/acceptance.py --out artifacts/results/acc_DRAFTER_WORKLOAD.json` "
                  "and `bench/draft_cost.py --out artifacts/results/draft_cost.json`.", ""]
    made = plot_all(acc, dc, plots, e2e)
    if made:
        rel = os.path.relpath(plots, out.parent)
        lines += ["Plots: " + ", ".join(f"[{m}]({rel}/{m})" for m in made), ""]
    if acc:
        lines += ["## Acceptance and end-to-end speed", ""] + tables_acceptance(acc)
    else:
        lines += ["## Acceptance and end-to-end speed", "",
                  "No `acc_*.json` results yet (`bench/acceptance.py --drafter NAME --workload W --out "
                  "artifacts/results/acc_NAME_W.json`).", ""]
    if e2e:
        lines += ["## End to end in a real sglang engine", ""] + tables_e2e(e2e)
    if dc:
        lines += ["## Draft cost", ""] + tables_draft_cost(dc)
    lines += ["## Sources", ""]
    for k, r in acc.items():
        argv_ = r.get("argv")
        cmd = ("python bench/acceptance.py " + " ".join(argv_)) if argv_ else "(command not recorded)"
        lines.append(f"- `{r['_file']}`: `{cmd}` (torch threads {r.get('torch_threads', '?')})")
    if dc:
        lines.append(f"- `{os.path.relpath(dc['_file'], ROOT)}`: `python {dc.get('env', {}).get('command', 'bench/draft_cost.py')}`")
    for r in e2e:
        lines.append(f"- `{r['_file']}`: `{r.get('command')}`")
    for f in skipped:
        lines.append(f"- skipped (not an acceptance result): `{f}`")
    lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {out} ({len(acc)} acceptance results, draft cost: {'yes' if dc else 'no'}; plots: {', '.join(made) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
