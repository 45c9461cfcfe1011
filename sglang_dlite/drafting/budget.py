"""How much to speculate: under load (``LoadPolicy``), whether to draft (``DraftGate``) and how many
positions to verify (``VerifyWidthPolicy``).

**Under load.**
- **Opt-out.** A request whose ``sampling_params.custom_params`` holds ``"dlite_speculate": false``
  (``/generate``; the OpenAI routes take it as ``extra_body={"custom_params": {...}}``) decodes with
  no drafts: its verify rows after the anchor are padding that acceptance never takes, so every
  round commits exactly the target's next token (output identical to no speculation). If every
  request of a round opted out, the round drafts nothing at all (a one-row verify per request).
- **Hard off-switch** (setting ``max_batch_size``): a decode batch of more running requests runs no
  drafter pass and no lookup; it verifies the anchors alone (one row per request: plain decoding
  through the verify path).
- **Soft limit** (``soft_batch_size``): a larger batch verifies at most ``soft_num_drafts`` drafts
  per request (0: as the hard switch).

**The verify width**: the width that maximises committed tokens per second.

A verify round of width ``w`` (the anchor + ``w - 1`` drafts per request) commits, per request,
``1 + E(w - 1)`` tokens in expectation, with ``E(n) = sum_{i<=n} prod_{j<=i} p_j`` from the
per-position acceptance probabilities of the chain being verified (the hybrid chooser's calibrated
``probs``). Its cost is the target's verify forward over ``rows = batch * w`` tokens. On a GPU that
cost is flat in ``w`` (the verify is latency-bound) and the widest round always wins; on a CPU it
is not: the target's GEMMs cost about the same for 1-6 rows and step up at 7-8 (oneDNN's
register blocking, measured on SmolLM2-135M), so a chain whose tail is unlikely to be accepted
is cheaper to leave out.

``VerifyWidthPolicy`` learns that cost online from the rounds it picked (wall seconds of the
verify forward by total rows; the median of the last few) and picks ``argmax_w sum_r (1 +
E_r(w - 1)) / (rest(batch) + cost(batch * w))``, where ``rest`` is the rest of a drafting round's
period at that batch size (the draft, acceptance and the scheduler's work: what the round costs
whatever its width; told by ``DraftGate`` from the period it measures): a round's throughput is its
tokens over its whole time, so a costly draft makes the verify's extra rows relatively cheaper. Rows it has not measured yet get an optimistic estimate
(interpolated between measured neighbours, proportional below the smallest, flat above the
largest), so every width is tried once and then judged by what it cost. A measurement not
refreshed for ``stale_after`` rounds is forgotten (checked every ``STALE_CHECK`` rounds): a width
measured while something else slowed the machine (another process, a prefill in between) would
otherwise look expensive for good and never be tried again, since only chosen widths are re-measured;
forgotten, it gets the optimistic estimate and one more try. Pure Python; the sglang
DLITE worker uses it where the verify runs eagerly on a CPU (the setting ``verify_width``).
"""

from __future__ import annotations

import bisect
import logging
import operator
from collections import deque
from itertools import accumulate, takewhile
from statistics import median
from typing import Dict, List, Optional, Sequence

import torch

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.drafting.accept import expected_accepted

logger = logging.getLogger(__name__)

WIDTH_MODES = ("auto", "adaptive", "fixed")


# ---------------------------------------------------------------------------- under load
OPT_OUT_KEY = "dlite_speculate"


def opted_out(req) -> bool:
    """Whether this request asked to decode without speculation (``"dlite_speculate": false``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and params.get(OPT_OUT_KEY) is False


class LoadPolicy:
    """How much DLITE drafts under load (the settings ``max_batch_size``, ``soft_batch_size``,
    ``soft_num_drafts`` of ``options``, a ``settings.ServingOptions``): see the module doc."""

    def __init__(self, options):
        self.hard = options.max_batch_size
        self.soft = options.soft_batch_size
        self.soft_num_drafts = options.soft_num_drafts

    def num_drafts(self, batch_size: int, num_drafts: int) -> int:
        """Drafts per request this round, at most, for a batch of ``batch_size`` (0: no drafter pass)."""
        if self.hard is not None and batch_size > self.hard:
            return 0
        if self.soft is not None and batch_size > self.soft:
            return min(num_drafts, self.soft_num_drafts)
        return num_drafts

    @staticmethod
    def opted_out_rows(reqs: Sequence, device) -> Optional[torch.Tensor]:
        """[B] bool of the requests that opted out, or None when none did (the common case)."""
        flags = [opted_out(r) for r in reqs]
        if not any(flags):
            return None
        return torch.tensor(flags, dtype=torch.bool, device=device)


# ---------------------------------------------------------------------------- the verify width


def reaches(probs: Sequence[float], min_reach: float = 0.0) -> List[float]:
    """prod_{j<=i} p_j per draft i: the chance that draft i is accepted (every draft before it
    was), from the per-position acceptance probabilities; the chain ends before the first one
    below ``min_reach``."""
    return list(takewhile(lambda r: r >= min_reach, accumulate((float(p) for p in probs), operator.mul)))


def expected_committed(probs: Sequence[float], n: int) -> float:
    """1 + sum_{i<=n} prod_{j<=i} p_j: tokens one request commits when n drafts are verified."""
    return 1.0 + expected_accepted(list(probs)[:n])


def adaptive_width_wanted(device: str, disable_cuda_graph: bool, tp_size: int = 1, mode: str = "auto") -> bool:
    """Whether the hybrid picks its verify width per round (``mode``: the setting ``verify_width``).
    ``auto`` (default): on a CPU only (a GPU's verify cost is flat in the width and its CUDA graphs
    want one shape); ``adaptive``: also on a GPU served with --disable-cuda-graph; ``fixed``: never.
    Never under tensor parallelism (every rank would have to pick the same width from its own timings)."""
    v = str(mode).strip().lower()
    if v not in WIDTH_MODES:
        raise DLiteConfigError(f"verify_width={mode!r}: use auto, adaptive or fixed.")
    if v == "fixed" or tp_size > 1:
        return False
    on_cpu = str(device).startswith("cpu")
    if v == "adaptive" and not on_cpu and not disable_cuda_graph:
        logger.warning("verify_width=adaptive needs an eager verify on a GPU (--disable-cuda-graph); keeping "
                       "the fixed width.")
        return False
    return on_cpu or v == "adaptive"


class VerifyWidthPolicy:
    STALE_CHECK = 16  # rounds between two sweeps for measurements gone stale

    def __init__(self, max_verify_width: int, min_verify_width: int = 2, samples: int = 8, stale_after: int = 128):
        if not 2 <= min_verify_width <= max_verify_width:
            raise ValueError(f"verify widths need 2 <= min_verify_width ({min_verify_width}) <= "
                             f"max_verify_width ({max_verify_width}).")
        self.max_verify_width, self.min_verify_width = int(max_verify_width), int(min_verify_width)
        self._samples, self.stale_after = int(samples), int(stale_after)
        self._cost: Dict[int, deque] = {}  # total verify rows -> recent wall seconds
        self._rows: List[int] = []  # sorted keys of _cost
        self._seen: Dict[int, int] = {}  # total verify rows -> the round of its last measurement
        self._round = 0  # choices made
        self._rest: Dict[int, deque] = {}  # batch bucket -> recent seconds of a round outside its verify
        self._last_verify_s: Optional[float] = None
        self.chosen: Dict[int, int] = {}  # width -> rounds (reported by the worker's metrics)

    # ------------------------------------------------------------------ cost model
    def observe(self, rows: int, seconds: float) -> None:
        """The verify forward over ``rows`` tokens took ``seconds``."""
        rows = int(rows)
        q = self._cost.get(rows)
        if q is None:
            q = self._cost[rows] = deque(maxlen=self._samples)
            bisect.insort(self._rows, rows)
        q.append(float(seconds))
        self._seen[rows] = self._round
        self._last_verify_s = float(seconds)

    def observe_round(self, batch_size: int, period_s: float) -> None:
        """The drafting round whose verify was observed last took ``period_s`` from its start to the
        next round's start: the part outside its verify is the round's width-independent cost."""
        if self._last_verify_s is None:
            return
        q = self._rest.setdefault(batch_bucket(batch_size), deque(maxlen=self._samples))
        q.append(max(0.0, float(period_s) - self._last_verify_s))
        self._last_verify_s = None

    def rest(self, batch_size: int) -> float:
        """Median seconds of a drafting round outside its verify at the nearest measured batch
        bucket (0 before any round)."""
        if not self._rest:
            return 0.0
        return median(self._rest[nearest_bucket(self._rest, batch_size)])

    def measured(self, rows: int) -> Optional[float]:
        q = self._cost.get(int(rows))
        if not q:
            return None
        return min(q) if len(q) < 3 else median(q)

    def cost(self, rows: int) -> Optional[float]:
        """Measured, or an optimistic estimate from the measured rows; None before any round."""
        m = self.measured(rows)
        if m is not None:
            return m
        if not self._rows:
            return None
        i = bisect.bisect_left(self._rows, rows)
        if i == 0:  # below every measurement: proportional (optimistic: a smaller verify is cheaper)
            r0 = self._rows[0]
            return self.measured(r0) * rows / r0
        if i == len(self._rows):  # above every measurement: flat (optimistic)
            return self.measured(self._rows[-1])
        lo, hi = self._rows[i - 1], self._rows[i]
        c_lo, c_hi = self.measured(lo), self.measured(hi)
        return c_lo + (c_hi - c_lo) * (rows - lo) / (hi - lo)

    # ------------------------------------------------------------------ the choice
    def choose(self, chain_probs: Sequence[Sequence[float]]) -> int:
        """The width for this round; ``chain_probs[r]`` = request r's per-position acceptance
        probabilities (its chain length caps what it can gain; an empty chain gains nothing)."""
        return self.choose_expected([[expected_committed(p, n) - 1.0 for n in range(self.max_verify_width)]
                                     for p in chain_probs])

    def choose_expected(self, table: Sequence[Sequence[float]]) -> int:
        """The width for this round from ``table[r][n]``: request r's expected accepted drafts when
        n drafts are verified (n = 0 .. max_verify_width - 1; the hybrid re-picks each request's chain for
        every n, so a chain whose value lies in a tail that would be cut does not win)."""
        self._round += 1
        if self._round % self.STALE_CHECK == 0:
            self.forget_stale()
        bs = max(1, len(table))
        best_w, best_v, rest = self.max_verify_width, -1.0, self.rest(bs)
        for w in range(self.min_verify_width, self.max_verify_width + 1):
            c = self.cost(bs * w)
            gain = sum(1.0 + row[min(w - 1, len(row) - 1)] for row in table) if table else float(bs)
            v = gain if c is None else gain / max(rest + c, 1e-9)
            if c is None:  # nothing measured yet: the widest round (the fixed-width behaviour)
                v = w
            if v > best_v + 1e-12:
                best_w, best_v = w, v
        self.chosen[best_w] = self.chosen.get(best_w, 0) + 1
        return best_w

    def forget_stale(self) -> None:
        """Drop the measurements not refreshed for ``stale_after`` rounds (the module doc)."""
        stale = [r for r in self._rows if self._round - self._seen[r] > self.stale_after]
        for r in stale:
            del self._cost[r], self._seen[r]
        if stale:
            self._rows = [r for r in self._rows if r in self._cost]


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above ``batch_size``: the draft gate's batch-size bucket."""
    return 1 << max(int(batch_size) - 1, 0).bit_length()


def nearest_bucket(measured, batch_size: int) -> int:
    """The measured bucket (a key of ``measured``) nearest to ``batch_size``'s bucket, the smaller on
    a tie: what stands in for a batch size not measured yet."""
    b = batch_bucket(batch_size)
    return min(measured, key=lambda k: (abs(k - b), k))


class DraftGate:
    """Whether drafting pays at a batch size: the committed tokens per second of a drafting round
    (draft + verify time, its mean committed tokens per request, both measured) against a round
    that verifies the anchors alone (one row per request, no drafter: plain decoding's cost).

    Per batch-size bucket (1, 2, 3-4, 5-8, ...: a serving batch changes size every few rounds; the
    nearest measured bucket stands in for an unmeasured one) it keeps the last
    ``samples`` rounds of each kind: the mean committed tokens (acceptance varies a lot from round to
    round, so a long window) over the median period. It drafts until ``warmup`` drafting rounds are
    measured, then tries one plain round, then drafts unless plain rounds are faster by more than
    ``1 / margin`` (drafting is the default: an early run of bad rounds must not switch it off);
    the kind not chosen is probed every ``probe_every`` rounds while off, every ``2 * probe_every``
    (``8 *`` while drafting is more than twice as fast) while on, so a change of load or of
    acceptance is seen. Pure Python; the sglang worker uses it beside the verify width policy
    (where a verify row is not free: a CPU), which it tells the period of every drafting round
    (``VerifyWidthPolicy.observe_round``: the draft's cost inside the width choice)."""

    def __init__(self, warmup: int = 16, probe_every: int = 32, samples: int = 64, margin: float = 0.9,
                 width_policy: Optional[VerifyWidthPolicy] = None):
        self.width_policy = width_policy
        self.warmup, self.probe_every, self.margin = int(warmup), int(probe_every), float(margin)
        self._rounds: Dict[bool, Dict[int, deque]] = {True: {}, False: {}}  # drafted -> bs -> (s, committed)
        self._samples = int(samples)
        self._since_probe: Dict[int, int] = {}
        self.off_rounds = 0  # rounds it chose without drafts (for tests and diagnostics)

    def observe(self, batch_size: int, drafted: bool, seconds: float, committed_per_request: float) -> None:
        q = self._rounds[bool(drafted)].setdefault(batch_bucket(batch_size), deque(maxlen=self._samples))
        q.append((float(seconds), float(committed_per_request)))
        if drafted and self.width_policy is not None:
            self.width_policy.observe_round(batch_size, seconds)

    def _rate(self, drafted: bool, batch_size: int) -> Optional[float]:
        """Committed tokens per request per second of this kind of round at the nearest batch size."""
        series = self._rounds[drafted]
        if not series:
            return None
        q = series[nearest_bucket(series, batch_size)]
        return sum(c for _, c in q) / len(q) / max(median(s for s, _ in q), 1e-9)

    def should_draft(self, batch_size: int) -> bool:
        bs = batch_bucket(batch_size)
        drafting = self._rounds[True].get(bs)
        if drafting is None or len(drafting) < self.warmup:
            return True
        plain, draft = self._rate(False, bs), self._rate(True, bs)
        choice = plain is None or draft >= self.margin * plain
        every = self.probe_every  # while off, or before a plain round was measured
        if choice and plain is not None:
            every *= 8 if draft > 2 * plain else 2
        n = self._since_probe.get(bs, every)  # the first time here: probe at once
        self._since_probe[bs] = n + 1
        if n >= every:  # probe the kind not chosen
            self._since_probe[bs] = 1
            choice = not choice
        return True if choice else self._off()

    def _off(self) -> bool:
        self.off_rounds += 1
        return False
