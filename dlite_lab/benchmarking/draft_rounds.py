"""Random-weight drafters drafting simulated rounds in the middle of a conversation, and the
draft-cost table and plot.

``bench/draft_cost.py`` times every drafter this way at growing context lengths (and writes the
table and plot, which ``bench/report.py`` reuses), and ``bench/draft_latency.py`` times the KV
baselines (``latency_benches``) beside DLite. Weights are random and the target features synthetic,
with SmolLM2-135M's shapes: the cost of a round does not depend on the values, only on the shapes
and on how much state a drafter keeps.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from dlite_lab.baselines.common import mark_synced
from dlite_lab.baselines.ngram import NGramDrafter
from dlite_lab.baselines.registry import engine_adapter, new_model
from dlite_lab.reference.drafters import DraftRequest
from dlite_lab.reference.drafters import SuffixEngineDrafter

SMOLLM2 = SimpleNamespace(hidden_size=576, vocab_size=49152, num_hidden_layers=30, model_type="llama")
COST_DRAFTERS = ("dlite", "eagle3", "dflash", "dspark", "ngram", "suffix")
LOOKUP_DRAFTERS = ("ngram", "suffix")  # read no captured target rows
SUFFIX_ALPHABET = 512  # the suffix row's tokens: repeats everywhere (busy index states), see build_drafter()


def build_drafter(name: str, emb: torch.Tensor, dtype):
    """(engine adapter, description): random weights bound to a shared random (tied) embedding/LM head."""
    if name == "ngram":
        return NGramDrafter(num_drafts=7), "prompt lookup, n = 3..1"
    if name == "suffix":
        d = SuffixEngineDrafter(num_drafts=7)
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
    engine extends its token list in place too). ``name`` is the drafter's registry name."""

    def __init__(self, name: str, drafter, context: int, rounds: int, accept: int, hid: torch.Tensor, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.name, self.d, self.accept = name, drafter, accept
        self.total = context + rounds * (accept + 1) + 1
        hi = 3 + getattr(drafter, "cost_alphabet", SMOLLM2.vocab_size - 3)
        self.all_tokens = torch.randint(3, hi, (self.total,), generator=g).tolist()
        self.tokens = self.all_tokens[:context]
        self.hid = hid[: len(drafter.capture_layer_ids)]
        self.state: dict = {}
        self.fill_drafter_cache()

    def fill_drafter_cache(self):
        """The drafter's state as after the previous round: a KV baseline's cache covers every
        committed position with features (random keys/values: cost depends on the length only)."""
        d = self.d
        if not hasattr(d, "sync"):
            return
        end = len(self.tokens) - 1
        st = d.state(self.request())
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
        return self.d.memory_bytes(self.state) if hasattr(self.d, "memory_bytes") else tensor_bytes(self.state)

    def rows_read_bytes(self) -> int:
        """Captured target rows the drafter reads per round (DLite: the last C positions; a KV
        baseline: the positions committed since the last round; n-gram / suffix: none)."""
        L, H = self.hid.shape[0], self.hid.shape[2]
        es = self.hid.element_size()
        if self.name in LOOKUP_DRAFTERS:
            return 0
        if self.name == "dlite":
            return L * self.d.model.config.num_context_positions * H * es
        return L * (self.accept + 1) * H * es


class KVBaselineLatencyBench:
    """A KV baseline in ``bench/draft_latency.py``'s protocol (a ``DRAFTERS`` entry): prepare(batch,
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
        self.drafter, self.description = build_drafter(self.name, emb, dtype)
        self.cfg = self.drafter.model.config
        self.dtype = dtype
        self.hid = None

    def describe(self):
        return f"{self.name} {self.description} (own KV cache; {self.accept} accepted + 1 bonus per round)"

    def prepare(self, batch, context):
        L = len(self.drafter.capture_layer_ids)
        if self.hid is None or self.hid.shape[1] < context + self.accept + 2:
            self.hid = torch.randn(L, context + self.accept + 2, SMOLLM2.hidden_size, dtype=self.dtype)
        return [Conversation(self.name, self.drafter, context, 1, self.accept, self.hid, seed=b)
                for b in range(batch)]

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
    """``bench/draft_latency.py`` DRAFTERS entries for the KV baselines: eagle3, dflash, dspark."""
    return {n: type(f"{n}LatencyBench", (KVBaselineLatencyBench,), {"name": n}) for n in ("eagle3", "dflash", "dspark")}


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) dict / list / tuple."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


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

    names, results = data["drafters"], data["results"]
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
