"""Per-request choice between the suffix lookup and DLite, from calibrated acceptance estimates.

Every round, per request, the candidates are the chains

    chain_i = DLite's first i drafts + the lookup's continuation after them,   i = 0 .. K

(i = 0: the lookup alone; i = K: DLite alone; in between: "mixed", the lookup continuing DLite's
tokens where the index knows what follows them). A chain may be longer than DLite's K drafts (the
sglang worker's ``--speculative-num-draft-tokens`` above K + 1): then the lookup alone, and DLite's
K drafts continued by the lookup, run up to that length; DLite alone stays K long. Each position j
of a chain gets a conditional
acceptance probability p_j from a calibration table, and a chain's score is its expected number
of accepted drafts, sum_i prod_{j<=i} p_j. The chooser takes the best lookup-involving chain when
its score beats DLite alone by ``margin`` (else DLite): ``candidates`` then ``best_chain``, driven for a
batch by ``hybrid.BatchLookup`` (which may also cut a chain where the probability that a position
is reached drops below ``min_reach``: a shorter verify on a CPU).

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

from sglang_dlite.drafting.accept import expected_accepted, expected_accepted_prefixes
from sglang_dlite.drafting.suffix import LookupStep, SuffixIndex

CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")

MATCH_EDGES = (1, 2, 4, 8, 16, 32)  # match-length buckets: <=1, <=2, <=4, ..., >32
N_CONF_BINS = 10
SOURCES = ("suffix", "mixed", "dlite")
# A cross-request corpus step (corpus.py) without a fitted ``corpus`` table: what the request's own
# lookup table gives the same (match, frequency) cell where the request's own tokens have no
# continuation (the same kind of evidence), this share of it where they continue otherwise
# ("contested": this request's own history is evidence against it). Not fitted: priors; an offline
# check on agent-stdlib conversations (issue 46 item 5) read contested corpus steps right less often.
CORPUS_CONTESTED_SCALE = 0.5


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
    corpus: dict = field(default_factory=dict)  # lookup_key -> P(accepted | reached) of corpus steps
    margin: float = 0.0  # a lookup-involving chain is taken when its score >= DLite's + margin
    skip_dlite_at: Optional[float] = None  # lookup score at which DLite is not run at all
    source: str = "prior"  # where the numbers come from

    def p_lookup(self, step: LookupStep) -> float:
        if step.corpus:  # the cross-request corpus: its own table, else the lookup's (a share if contested)
            v = self.corpus.get(lookup_key(step))
            if v is None:
                v = self._p_own(step) * (CORPUS_CONTESTED_SCALE if step.contested else 1.0)
            return v
        return self._p_own(step)

    def _p_own(self, step: LookupStep) -> float:
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
        return cls(lookup=dict(d.get("lookup", {})), dlite=dict(d.get("dlite", {})), corpus=dict(d.get("corpus", {})),
                   margin=float(d.get("margin", 0.0)), skip_dlite_at=d.get("skip_dlite_at"),
                   source=str(d.get("source", path)))

    def to_dict(self) -> dict:
        d = {"lookup": self.lookup, "dlite": self.dlite, "margin": self.margin,
             "skip_dlite_at": self.skip_dlite_at, "source": self.source}
        return {**d, "corpus": self.corpus} if self.corpus else d


_DEFAULT: Optional[Calibration] = None


def default_calibration() -> Calibration:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Calibration.load()
    return _DEFAULT


def lookup_only(index: SuffixIndex, k: int, cal: Calibration):
    """(draft, per-step probabilities, score) of the lookup alone."""
    d = index.propose(k)
    ps = [cal.p_lookup(s) for s in d.steps]
    return d, ps, expected_accepted(ps)


def needs_dlite(lookup, cal: Calibration, horizon: int) -> bool:
    """The skip-DLite rule of every hybrid drafter (the reference engine's and the sglang worker's):
    DLite runs unless the lookup alone (``lookup_only``'s result) expects to get at least
    ``cal.skip_dlite_at`` drafts accepted within its first ``horizon`` steps. ``horizon`` is
    ``min(chain length, DLite's K)``: the threshold was tuned on chains of DLite's length, so a
    lookup tail past K (chains longer than K) does not skip DLite on its own."""
    skip = cal.skip_dlite_at
    return skip is None or expected_accepted(lookup[1][:horizon]) < skip


class Candidate:
    """One chain this round could verify: ``split`` DLite drafts at its head (``alone``: DLite's
    drafts only), its tokens and their calibrated acceptance probabilities. ``score(n)`` is its
    expected number of accepted drafts when only its first ``n`` tokens are verified."""

    __slots__ = ("split", "tokens", "probs", "alone", "_cum")

    def __init__(self, split: int, tokens: Sequence[int], probs: Sequence[float], alone: bool = False):
        self.split, self.tokens, self.probs, self.alone = split, list(tokens), list(probs), alone
        self._cum = expected_accepted_prefixes(self.probs)

    def score(self, n: Optional[int] = None) -> float:
        return self._cum[-1] if n is None else self._cum[min(max(n, 0), len(self.probs))]

    @property
    def source(self) -> str:
        if self.alone:
            return "dlite"
        if not self.tokens:
            return "none"
        return "suffix" if self.split == 0 else "mixed"


def candidates(index: SuffixIndex, k: int, cal: Calibration, dlite_tokens: Optional[Sequence[int]] = None,
               dlite_conf: Optional[Sequence[float]] = None, lookup=None,
               log: Optional[dict] = None) -> List[Candidate]:
    """Every chain of the module docstring for this round, the lookup alone first. ``index``
    covers the committed tokens including the anchor. Without DLite drafts (skipped or
    unavailable) only the lookup."""
    if lookup is None:
        lookup = lookup_only(index, k, cal)
    ld, lps, _ = lookup
    cands = [Candidate(0, ld.tokens, lps)]
    if log is not None:
        log["lookup"] = [(s.token, s.count, s.total, s.match_len) for s in ld.steps]
    if dlite_tokens is None:
        return cands
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
    # i < len(d): DLite's first i drafts, then the lookup; i == len(d): all of DLite's drafts,
    # then (only when the chain may be longer than DLite's K) the lookup after them
    for i in range(1, len(d) + 1):
        if i == len(d):
            cands.append(Candidate(i, d, dps, alone=True))
            if not after[i]:
                continue
        cands.append(Candidate(i, d[:i] + [s.token for s in after[i]], dps[:i] + [cal.p_lookup(s) for s in after[i]]))
    return cands


def best_chain(cands: Sequence[Candidate], cal: Calibration, n: Optional[int] = None) -> Candidate:
    """The chain to verify when at most ``n`` of its tokens are (None: all): the best
    lookup-involving chain if its score at ``n`` beats DLite alone by ``cal.margin``, else DLite."""
    dl = next((c for c in cands if c.alone), None)
    best_l = max((c for c in cands if not c.alone), key=lambda c: c.score(n))
    use_l = dl is None or (best_l.tokens and best_l.score(n) >= dl.score(n) + cal.margin)
    return best_l if use_l else dl

