"""The draft-cost table and plot (``bench/draft_cost.py`` writes them, ``bench/report.py`` reuses them)."""

from __future__ import annotations

from pathlib import Path


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def draft_cost_table(data: dict) -> str:
    """Markdown: ms per round and drafter memory per request by context, + the cost ratio."""
    contexts, names, results = data["contexts"], data["drafters"], data["results"]
    lo, hi = contexts[0], contexts[-1]
    ratio = data["summary"][f"cost_ratio_{hi}_over_{lo}"]
    get = {(r["drafter"], r["context"]): r for r in results}
    rmin = data["summary"].get(f"cost_ratio_{hi}_over_{lo}_of_min", {})
    head = ("| drafter | " + " | ".join(f"ms @ {c}" for c in contexts) + f" | cost {hi}/{lo} (median; min) | "
            + " | ".join(f"memory/request @ {c}" for c in contexts) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in names:
        ms = " | ".join(f"{get[(n, c)]['ms']:.2f}" if (n, c) in get else "-" for c in contexts)
        mem = " | ".join(human_bytes(get[(n, c)]["memory_bytes"]) if (n, c) in get else "-" for c in contexts)
        rm = f"; {rmin[n]:.2f}x" if n in rmin else ""
        lines.append(f"| {n} | {ms} | {ratio.get(n, float('nan')):.2f}x{rm} | {mem} |")
    return "\n".join(lines)


def plot_draft_cost(data: dict, png: Path):
    """PNG: ms per round and drafter memory per request vs context length, one line per drafter."""
    import matplotlib  # optional: matplotlib (the dev extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib; after matplotlib.use("Agg")

    contexts, names, results = data["contexts"], data["drafters"], data["results"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in names:
        rs = sorted((r for r in results if r["drafter"] == n), key=lambda r: r["context"])
        a1.plot([r["context"] for r in rs], [r["ms"] for r in rs], marker="o", label=n)
        a2.plot([r["context"] for r in rs], [max(r["memory_bytes"], 1) / 2**20 for r in rs], marker="o", label=n)
    env = data.get("env", {})
    for ax, ylab in ((a1, "ms per draft round (median)"), (a2, "drafter memory per request (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a2.set_yscale("symlog", linthresh=0.1)  # DLite and n-gram keep 0 bytes
    a1.set_title(f"draft cost, CPU {env.get('dtype', '')} {env.get('threads', '?')} thread(s)")
    a2.set_title("drafter-owned state kept between rounds")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
