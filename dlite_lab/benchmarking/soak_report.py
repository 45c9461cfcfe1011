"""What ``bench/soak.py`` measures and reports: DLITE's counters from a server's ``/metrics``,
the RSS slopes per process and phase, the per-kind request table and the soak plot."""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import requests


def dlite_metrics(base: str) -> dict:
    """DLITE's counters from /metrics: mean draft / verify ms per round, rounds, rows, sources, refusals."""
    try:
        text = requests.get(base + "/metrics", timeout=30).text
    except requests.RequestException:
        return {}

    def total(name, label=None):
        vals = [(m.group(1) or "", float(m.group(2))) for m in
                re.finditer(r"^" + re.escape(name) + r"(\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)]
        if label is None:
            return sum(v for _, v in vals)
        out = defaultdict(float)
        for labels, v in vals:
            m = re.search(label + r'="([^"]*)"', labels)
            out[m.group(1) if m else ""] += v
        return dict(out)

    out = {}
    n = total("sglang:dlite_draft_ms_count")
    if n:
        out["rounds"] = int(total("sglang:dlite_rounds_total"))
        out["draft_ms_mean"] = total("sglang:dlite_draft_ms_sum") / n
        out["verify_ms_mean"] = total("sglang:dlite_verify_ms_sum") / max(1.0, total("sglang:dlite_verify_ms_count"))
        rows_n = total("sglang:dlite_context_rows_count")
        out["context_rows_mean"] = total("sglang:dlite_context_rows_sum") / rows_n if rows_n else None
        out["source_request_rounds"] = total("sglang:dlite_source_rounds_total", "source")
    out["refused_by_field"] = total("sglang:dlite_refused_requests_total", "field")
    acc = re.search(r"^sglang:spec_accept_length(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)
    if acc:
        out["spec_accept_length"] = float(acc.group(1))
    return out


def slope_mb_per_min(points):
    """Least-squares slope of [(t_s, mb)] in MB/min (None with < 3 points or all at one time)."""
    if len(points) < 3 or len({t for t, _ in points}) < 2:
        return None
    return 60.0 * statistics.linear_regression(*zip(*points)).slope


def rss_summary(samples, load_ends) -> dict:
    """Scheduler RSS over the run: slopes over the load (all / second half / after the first,
    warm-up cycle), the RSS after each idle period, and the median / max under load per cycle.
    Prints one paragraph; ``python bench/soak.py --summary RUN.json`` reprints it for a run."""
    def pts(phase, after=0.0):
        return [(s["t"], s["scheduler_mb"]) for s in samples if s["phase"] == phase and s.get("scheduler_mb")
                and s["t"] > after]

    load = pts("load")
    end = load_ends[-1] if load_ends else (load[-1][0] if load else 0.0)
    warm = load_ends[0] if len(load_ends) > 1 else 0.0
    idle_after = []
    for i, t_end in enumerate(load_ends):
        nxt = load_ends[i + 1] if i + 1 < len(load_ends) else float("inf")
        ps = [pt for pt in pts("idle", t_end) if pt[0] < nxt]
        if ps:
            idle_after.append(ps[-1])
    cycles = []
    for i, t_end in enumerate(load_ends):
        lo = load_ends[i - 1] if i else 0.0
        xs = sorted(m for t, m in load if lo < t <= t_end)
        if xs:
            cycles.append(dict(median_mb=xs[len(xs) // 2], max_mb=xs[-1]))
    out = dict(
        pre_mb=next((s.get("scheduler_mb") for s in samples if s["phase"] == "pre"), None),
        end_mb=samples[-1].get("scheduler_mb") if samples else None,
        slope_mb_per_min=slope_mb_per_min(load),
        slope_second_half_mb_per_min=slope_mb_per_min([pt for pt in load if pt[0] >= end / 2]),
        slope_after_warmup_cycle_mb_per_min=slope_mb_per_min(pts("load", warm)) if warm else None,
        after_idle_mb=[m for _, m in idle_after],
        slope_after_idle_mb_per_min=slope_mb_per_min(idle_after),
        per_cycle=cycles,
    )

    def f(x):
        return f"{x:+.2f}" if x is not None else "n/a"

    print(f"\nscheduler RSS: pre-load {out['pre_mb'] or 0:.0f} MB, end {out['end_mb'] or 0:.0f} MB; slope "
          f"{f(out['slope_mb_per_min'])} MB/min over the load, {f(out['slope_second_half_mb_per_min'])} over its "
          f"second half, {f(out['slope_after_warmup_cycle_mb_per_min'])} after the first (warm-up) cycle; after each "
          f"idle period {[round(m) for m in out['after_idle_mb']]} MB (slope {f(out['slope_after_idle_mb_per_min'])} "
          f"MB/min); per cycle under load median/max {[(round(c['median_mb']), round(c['max_mb'])) for c in cycles]} MB")
    return out


def pct(xs, q):
    """The q-quantile of xs (nearest rank; nan when empty)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def table(records, kinds, wall):
    """Per request kind (in ``kinds`` order): requests, ok, refused, errors, latency p50/p99, tokens/s."""
    by = defaultdict(list)
    for r in records:
        by[r["kind"]].append(r)
    rows = []
    for kind in kinds:
        rs = by.get(kind, [])
        if not rs:
            continue
        outcomes = Counter(r["outcome"] for r in rs)
        lat = [r["latency"] for r in rs]
        toks = sum(r["tokens"] for r in rs)
        errs = {k: v for k, v in outcomes.items() if k not in ("ok", "refused")}
        rows.append(dict(kind=kind, requests=len(rs), ok=outcomes.get("ok", 0), refused_4xx=outcomes.get("refused", 0),
                         errors=errs, p50_s=pct(lat, 0.5), p99_s=pct(lat, 0.99), tokens=toks,
                         tokens_per_s=toks / wall if wall > 0 else 0.0))
    return rows


def print_table(rows, wall):
    print(f"\n{'kind':12s} {'req':>5s} {'ok':>5s} {'4xx':>5s} {'p50 s':>7s} {'p99 s':>7s} {'tok':>6s} {'tok/s':>6s}  errors")
    tot = Counter()
    for r in rows:
        print(f"{r['kind']:12s} {r['requests']:5d} {r['ok']:5d} {r['refused_4xx']:5d} {r['p50_s']:7.2f} {r['p99_s']:7.2f} "
              f"{r['tokens']:6d} {r['tokens_per_s']:6.2f}  {r['errors'] or '-'}")
        tot.update(requests=r["requests"], ok=r["ok"], refused=r["refused_4xx"], tokens=r["tokens"])
    print(f"{'all':12s} {tot['requests']:5d} {tot['ok']:5d} {tot['refused']:5d} {'':7s} {'':7s} {tot['tokens']:6d} "
          f"{tot['tokens'] / wall if wall else 0:6.2f}")


def plot_title(tag, n_requests, cfg) -> str:
    return (f"soak {tag}: {n_requests} requests, {cfg['clients']} clients + chaos,\n"
            f"{cfg['minutes']:g} min of load in {cfg.get('cycles', 1)} cycle(s) (dashed lines: ends of load)")


def plot(samples, load_ends, path, title):
    import matplotlib  # optional: matplotlib (the dev extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib; after matplotlib.use("Agg")

    t = [s["t"] / 60 for s in samples]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for key, style in (("scheduler_mb", "-o"), ("http_mb", "--s"), ("detokenizer_mb", ":^")):
        ys = [s.get(key) for s in samples]
        if any(y is not None for y in ys):
            a1.plot(t, [y if y is not None else float("nan") for y in ys], style, ms=3, label=key.replace("_mb", ""))
    a1.set_ylabel("resident memory (MB)")
    a1.legend(loc="best")
    a1.grid(alpha=0.3)
    a2.plot(t, [s.get("kv_used_tokens") if s.get("kv_used_tokens") is not None else float("nan") for s in samples],
            "-o", ms=3, color="tab:red", label="KV tokens in use")
    a2.set_ylabel("KV tokens in use")
    a2.set_xlabel("minutes since load start")
    a2.grid(alpha=0.3)
    for a in (a1, a2):
        for t_end in load_ends:
            a.axvline(t_end / 60, color="gray", ls="--", lw=1)
    a1.set_title(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
