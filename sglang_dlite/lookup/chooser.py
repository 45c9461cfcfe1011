"""Per-request choice between the suffix lookup and DLite, from calibrated acceptance estimates.

Every round, per request, the candidates are the chains

    chain_i = DLite's first i drafts + the lookup's continuation after them,   i = 0 .. K

(i = 0: the lookup alone; i = K: DLite alone; in between: "mixed", the lookup continuing DLite's
tokens where the index knows what follows them). Each position j of a chain gets a conditional
acceptance probability p_j from a calibration table, and a chain's score is its expected number
of accepted drafts, sum_i prod_{j<=i} p_j. The chooser takes the best lookup-involving chain when
its score beats DLite alone by ``margin`` (else DLite), and optionally cuts the chain where the
probability that a position is reached drops below ``min_reach`` (a shorter verify on a CPU).

Calibration (``Calibration``): lookup steps by (matched suffix length, frequency) cells; DLite's
drafts by (its own confidence q_j = softmax max of its logits, agreement with the lookup's next
token). The shipped tables (``calibration.json``) were fitted by ``bench/lookup_calibration.py``
on target-greedy continuations of TRAINING prompts (the gen-data sources sharegpt/stdlib/bfcl,
whose splits exclude every evaluation workload), never on the evaluation workloads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from .suffix import LookupStep, SuffixIndex

CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")

MATCH_EDGES = (1, 2, 4, 8, 16, 32)  # match-length buckets: <=1, <=2, <=4, ..., >32
N_CONF_BINS = 10
SOURCES = ("suffix", "mixed", "dlite")


def match_bucket(m: int) -> int:
    for i, e in enumerate(MATCH_EDGES):
        if m <= e:
            return i
    return len(MATCH_EDGES)


def freq_bucket(count: int, total: int) -> int:
    """0: minority continuation, 1: majority (<100 %), 2: the only one seen once, 3: always (>=2)."""
    if count >= total:
        return 3 if total >= 2 else 2
    return 1 if 2 * count > total else 0


def lookup_key(step: LookupStep) -> str:
    return f"{match_bucket(step.match_len)}:{freq_bucket(step.count, step.total)}"


def conf_bin(q: float) -> int:
    return min(N_CONF_BINS - 1, max(0, int(q * N_CONF_BINS)))


def dlite_key(q: float, agree: int) -> str:
    """agree: 0 no lookup suggestion, 1 the lookup suggests another token, 2 the same token."""
    return f"{conf_bin(q)}:{agree}"


@dataclass
class Calibration:
    lookup: dict = field(default_factory=dict)  # lookup_key -> P(accepted | reached)
    dlite: dict = field(default_factory=dict)  # dlite_key -> P(accepted | reached)
    margin: float = 0.0  # a lookup-involving chain is taken when its score >= DLite's + margin
    skip_dlite_at: Optional[float] = None  # lookup score at which DLite is not run at all
    source: str = "prior"  # where the numbers come from

    def p_lookup(self, step: LookupStep) -> float:
        v = self.lookup.get(lookup_key(step))
        if v is not None:
            return v
        # prior: the observed frequency, shrunk for short matches and few occurrences
        m = step.match_len
        return step.count / (step.total + 1.0) * (m / (m + 1.0))

    def p_dlite(self, q: float, agree: int) -> float:
        v = self.dlite.get(dlite_key(q, agree))
        return float(q) if v is None else v

    @classmethod
    def load(cls, path: Optional[str] = None) -> "Calibration":
        path = path or CALIBRATION_FILE
        if not os.path.isfile(path):
            return cls()
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return cls(lookup=dict(d.get("lookup", {})), dlite=dict(d.get("dlite", {})),
                   margin=float(d.get("margin", 0.0)), skip_dlite_at=d.get("skip_dlite_at"),
                   source=str(d.get("source", path)))

    def to_dict(self) -> dict:
        return {"lookup": self.lookup, "dlite": self.dlite, "margin": self.margin,
                "skip_dlite_at": self.skip_dlite_at, "source": self.source}


_DEFAULT: Optional[Calibration] = None


def default_calibration() -> Calibration:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Calibration.load()
    return _DEFAULT


def expected_accepted(ps: Sequence[float]) -> float:
    """sum_i prod_{j<=i} p_j."""
    s, reach = 0.0, 1.0
    for p in ps:
        reach *= p
        s += reach
    return s


@dataclass
class Choice:
    tokens: List[int]
    source: str  # "suffix" | "mixed" | "dlite" | "none"
    score: float  # expected accepted drafts of the chosen chain
    probs: List[float]  # per-position calibrated acceptance probabilities
    split: int  # DLite drafts at the head of the chain
    scores: dict = field(default_factory=dict)  # best score per source


def lookup_only(index: SuffixIndex, k: int, cal: Calibration):
    """(draft, per-step probabilities, score) of the lookup alone."""
    d = index.propose(k)
    ps = [cal.p_lookup(s) for s in d.steps]
    return d, ps, expected_accepted(ps)


def choose(index: SuffixIndex, k: int, cal: Calibration, dlite_tokens: Optional[Sequence[int]] = None,
           dlite_conf: Optional[Sequence[float]] = None, lookup=None, min_reach: float = 0.0,
           log: Optional[dict] = None) -> Choice:
    """The chain to verify this round (see the module docstring). ``index`` covers the committed
    tokens including the anchor. Without DLite drafts (skipped or unavailable) only the lookup."""
    if lookup is None:
        lookup = lookup_only(index, k, cal)
    ld, lps, ls = lookup
    cands = [(ls, 0, ld.tokens, lps)]
    if log is not None:
        log["lookup"] = [(s.token, s.count, s.total, s.match_len) for s in ld.steps]
    if dlite_tokens is not None:
        d = [int(t) for t in dlite_tokens][:k]
        q = [float(x) for x in dlite_conf][:k]
        v, m = index.match()
        dps: List[float] = []
        after = []  # per split i: the lookup continuation after d[:i] (steps)
        for i in range(len(d) + 1):
            cont = index.propose(k - i, start=(v, m)) if (v > 0 and k - i > 0) else None
            after.append(cont.steps if cont is not None else [])
            if i == len(d):
                break
            nxt = after[i][0].token if after[i] else None
            agree = 0 if nxt is None else (2 if nxt == d[i] else 1)
            dps.append(cal.p_dlite(q[i], agree))
            v, m = index.walk(v, m, d[i])
        if log is not None:
            log["dlite"] = list(zip(d, q))
            log["after"] = [[(s.token, s.count, s.total, s.match_len) for s in st] for st in after]
        for i in range(1, len(d) + 1):
            ps = dps[:i] + [cal.p_lookup(s) for s in after[i]] if i < len(d) else dps
            toks = d[:i] + [s.token for s in after[i]] if i < len(d) else d
            cands.append((expected_accepted(ps), i, toks, ps))
    dl = next((c for c in cands if c[1] == len(dlite_tokens or ()) and dlite_tokens is not None), None)
    best_l = max((c for c in cands if dl is None or c[1] < dl[1]), key=lambda c: c[0])
    scores = {"suffix": ls, "dlite": dl[0] if dl else None,
              "mixed": max((c[0] for c in cands if 0 < c[1] < (dl[1] if dl else 0)), default=None)}
    if dl is not None and not (best_l[0] >= dl[0] + cal.margin and best_l[2]):
        pick = dl
    else:
        pick = best_l
    score, split, toks, ps = pick
    if dl is not None and pick is dl:
        source = "dlite"
    elif not toks:
        source = "none"
    else:
        source = "suffix" if split == 0 else "mixed"
    if min_reach > 0:  # cut where the chance that a position is reached gets small
        reach, n = 1.0, 0
        for p in ps:
            reach *= p
            if reach < min_reach:
                break
            n += 1
        toks, ps = toks[:n], ps[:n]
        score = expected_accepted(ps)
    return Choice(list(toks), source, score, list(ps), split, scores)
