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
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_dlite.baselines.common import mark_synced  # noqa: E402
from sglang_dlite.baselines.registry import engine_adapter, new_model  # noqa: E402
from sglang_dlite.drafters import DraftRequest  # noqa: E402

SMOLLM2 = SimpleNamespace(hidden_size=576, vocab_size=49152, num_hidden_layers=30, model_type="llama")
COST_DRAFTERS = ("dlite", "eagle3", "dflash", "dspark", "ngram", "suffix")
SUFFIX_ALPHABET = 512  # the suffix row's tokens: repeats everywhere (busy index states), see build()


def build(name: str, emb: torch.Tensor, dtype):
    """An engine adapter with random weights bound to a shared random (tied) embedding/LM head."""
    if name == "ngram":
        from sglang_dlite.baselines.ngram import NGramDrafter
        return NGramDrafter(block_size=7), "prompt lookup, n = 3..1"
    if name == "suffix":
        from sglang_dlite.lookup.drafters import SuffixEngineDrafter
        d = SuffixEngineDrafter(block_size=7)
        # Tokens from a 512-token alphabet: every token recurs ~T/512 times, so short matches have
        # many continuations (a scan over them would grow with T; the index stores the best one).
        d.cost_alphabet = SUFFIX_ALPHABET
        return d, (f"suffix lookup (incremental suffix automaton, match <= {d.max_match}), tokens from a "
                   f"{SUFFIX_ALPHABET}-token alphabet; the first (indexing) round is a warm-up round")
    model = new_model(name, SMOLLM2, seed=0).to(dtype).eval()
    if name == "dlite":
        torch.nn.init.normal_(model.head.out_proj.weight, std=0.02)  # a non-identity head
    model.bind_target(emb, emb)
    c = model.config
    desc = (f"layers={c.num_layers} heads={c.num_heads}/{c.num_kv_heads}x{c.head_dim} "
            f"capture={c.target_layer_ids} K={c.block_size}")
    if name == "dlite":
        desc += f" C={c.num_context_positions} r={c.rnn_rank}"
    if name == "dspark":
        desc += f" markov_rank={c.markov_rank}"
    params = sum(p.numel() for p in model.parameters())
    return engine_adapter(name, model), f"{desc} params={params / 1e6:.2f}M (+ target embedding/LM head)"


class Conversation:
    """One request's committed tokens + captured features, grown round by round in place (the
    engine extends its token list in place too)."""

    def __init__(self, drafter, context: int, rounds: int, accept: int, hid: torch.Tensor, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.d, self.accept = drafter, accept
        self.total = context + rounds * (accept + 1) + 1
        hi = 3 + getattr(drafter, "cost_alphabet", SMOLLM2.vocab_size - 3)
        self.all_tokens = torch.randint(3, hi, (self.total,), generator=g).tolist()
        self.tokens = self.all_tokens[:context]
        self.hid = hid[: len(drafter.capture_layer_ids)]
        self.state: dict = {}
        self._prefill_state()

    def _prefill_state(self):
        """The drafter's state as after the previous round: a KV baseline's cache covers every
        committed position with features (random keys/values: cost depends on the length only)."""
        d = self.d
        if not hasattr(d, "sync"):
            return
        end = len(self.tokens) - 1
        st = d._state(self.request())
        for cache in st.kv:
            shape = (cache.k.shape[0], end, cache.k.shape[2])
            cache.append(torch.randn(shape, dtype=cache.k.dtype), torch.randn(shape, dtype=cache.k.dtype))
        mark_synced(st, self.tokens)

    def request(self) -> DraftRequest:
        end = len(self.tokens) - 1
        need = self.d.hidden_rows_needed
        start = 0 if need is None else max(0, end - need)
        return DraftRequest(self.tokens, self.hid[:, start:end], start, state=self.state)

    def round(self):
        n = len(self.tokens)
        self.tokens.extend(self.all_tokens[n:n + self.accept + 1])
        return self.d.draft(self.request())

    def memory_bytes(self) -> int:
        return self.d.memory_bytes(self.state) if hasattr(self.d, "memory_bytes") else _tensor_bytes(self.state)

    def rows_read_bytes(self) -> int:
        """Captured target rows the drafter reads per round (DLite: the last C positions; a KV
        baseline: the positions committed since the last round; n-gram: none)."""
        L, H = self.hid.shape[0], self.hid.shape[2]
        es = self.hid.element_size()
        name = type(self.d).__name__
        if name in ("NGramDrafter", "SuffixEngineDrafter"):
            return 0
        if name == "DLiteEngineDrafter":
            return L * self.d.model.config.num_context_positions * H * es
        return L * (self.accept + 1) * H * es


class LatencyBench:
    """A KV baseline in ``bench/draft_latency.py``'s protocol (``DRAFTERS`` entry): prepare(batch,
    context) -> one simulated conversation per request; round(state) = every request extends by
    ``accept`` + 1 tokens and drafts, then is rewound (cache cropped back), so repeated rounds
    measure the same steady state. The ops implementation switch does not apply (plain torch)."""

    name = "?"
    accept = 2

    def __init__(self, args, device, dtype):
        if torch.device(device).type != "cpu":
            raise SystemExit(f"{self.name}: the baseline adapters run on the CPU in this benchmark")
        torch.manual_seed(0)
        emb = torch.randn(SMOLLM2.vocab_size, SMOLLM2.hidden_size, dtype=dtype) * 0.02
        self.drafter, self._desc = build(self.name, emb, dtype)
        self.cfg = self.drafter.model.config
        self.dtype = dtype
        self.hid = None

    def describe(self):
        return f"{self.name} {self._desc} (own KV cache; {self.accept} accepted + 1 bonus per round)"

    def prepare(self, batch, context):
        L = len(self.drafter.capture_layer_ids)
        if self.hid is None or self.hid.shape[1] < context + self.accept + 2:
            self.hid = torch.randn(L, context + self.accept + 2, SMOLLM2.hidden_size, dtype=self.dtype)
        return [Conversation(self.drafter, context, 1, self.accept, self.hid, seed=b) for b in range(batch)]

    def round(self, convs):
        out = []
        for c in convs:
            n0 = len(c.tokens)
            out.append(c.round().tokens)
            del c.tokens[n0:]  # rewind: same list object, cache back to the committed positions
            st = c.state[c.d.state_key]
            st.crop(n0 - 1)
            mark_synced(st, c.tokens)
        return torch.cat(out)


def latency_benches() -> dict:
    """DRAFTERS entries for bench/draft_latency.py."""
    return {n: type(f"{n}LatencyBench", (LatencyBench,), {"name": n}) for n in ("eagle3", "dflash", "dspark")}


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Draft cost vs context length (see module doc).")
    ap.add_argument("--drafter", default="dlite,eagle3,dflash,dspark,ngram", help=f"comma list of {COST_DRAFTERS}")
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds per drafter and context")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accept", type=int, default=2, help="drafts accepted per simulated round (+1 bonus)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned, reported)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dlite-ops", default="torch", help="SGLANG_DLITE_OPS for DLite (torch: like the baselines)")
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
    os.environ["SGLANG_DLITE_OPS"] = args.dlite_ops
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    emb = torch.randn(SMOLLM2.vocab_size, SMOLLM2.hidden_size, dtype=dtype) * 0.02
    drafters, described = {}, {}
    for n in names:
        drafters[n], described[n] = build(n, emb, dtype)
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
    convs = {(n, T): Conversation(drafters[n], T, pad, args.accept, hid, seed=T) for T in contexts for n in names}
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
                  f"{human(mem)}", flush=True)
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
    print(markdown_table({"contexts": contexts, "drafters": names, "results": results, "summary": summary}))
    png = Path(args.png) if args.png else out.with_suffix(".png")
    try:
        plot({"contexts": contexts, "drafters": names, "results": results, "env": env}, png)
        print(f"# wrote {out} and {png}")
    except ImportError:
        print(f"# wrote {out} (matplotlib missing: no PNG)")
    return 0


def markdown_table(data: dict) -> str:
    """ms per round and drafter memory per request by context, + the cost ratio (bench/report.py too)."""
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
        mem = " | ".join(human(get[(n, c)]["memory_bytes"]) if (n, c) in get else "-" for c in contexts)
        rm = f"; {rmin[n]:.2f}x" if n in rmin else ""
        lines.append(f"| {n} | {ms} | {ratio.get(n, float('nan')):.2f}x{rm} | {mem} |")
    return "\n".join(lines)


def plot(data: dict, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


if __name__ == "__main__":
    sys.exit(main())
