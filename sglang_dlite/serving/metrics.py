"""DLITE's own Prometheus metrics, served by sglang's ``/metrics`` next to its spec counters
(``--enable-metrics``). Everything here is a no-op unless the server runs with
``--enable-metrics``; then recording costs a few microseconds per decode round and, on CUDA,
adds no device synchronisation (timings come from CUDA events read back once they completed).

Metrics (prometheus names; sglang's multiprocess collector serves them from the scheduler):
- ``sglang:dlite_draft_ms``        histogram: drafter time per decode round (ms)
- ``sglang:dlite_verify_ms``       histogram: target verify forward per decode round (ms)
- ``sglang:dlite_context_rows``    histogram: valid context rows (0..C) per request at draft time
- ``sglang:dlite_rounds_total``    counter: decode rounds (batch steps) drafted
- ``sglang:dlite_source_rounds_total{source}``  counter: request-rounds drafted by each source
- ``sglang:dlite_refused_requests_total{endpoint,field}``  counter (HTTP process): requests the
  request guards (``guards.py``) refused with a 400 before they reached sglang
- acceptance under the names vLLM and llama.cpp dashboards read: ``sglang:spec_decode_num_drafts_total``
  (request-rounds that verified drafts), ``sglang:spec_decode_num_draft_tokens_total`` (drafts
  verified), ``sglang:spec_decode_num_accepted_tokens_total`` (drafts accepted) and
  ``sglang:spec_decode_num_accepted_tokens_per_pos_total{position}`` (drafts accepted at chain
  position 0, 1, ...); acceptance rate = accepted / draft tokens, mean accepted length =
  1 + accepted / drafts (a request that opted out, or a round with no drafts, is not a draft; a
  token tree's drafts are its nodes, the padding rows of a batch's smaller trees not counted).
  Recorded where sglang takes each round's result (``spec_metrics.RoundStats.consume``), for the
  request-rounds sglang counts (``spec_verify_ct``): not the overlap scheduler's round past a
  request's stop, nor a retracted request's, so they add up to the per-response metrics
  (``spec_metrics.py``) to the token

API for drafting code (e.g. a hybrid suffix-lookup / DLite drafter), safe to call always::

    from sglang_dlite.serving import metrics
    metrics.record_source("suffix", n)     # n requests of this round were drafted by "suffix"

The setting ``round_log`` (``SGLANG_DLITE_CONFIG='{"round_log": PATH}'``; no ``--enable-metrics``
needed) appends one JSON line per decode round to PATH: ``{"bs", "width", "tree", "draft_ms", "verify_ms", "pos", "acc"}`` (TP rank 0; width: tokens
verified per request; pos / acc: each request's output length before the round and the drafts it
accepted; with the setting ``online`` on, ``learn_ms``: the round's host time in the online learner, and
``online``: what it counted in the round, {name: count} of ``online_serving.ROUND_COUNTS``), e.g. for
``bench/e2e.py``'s per-mode draft / verify split and tau by output position, or an offline engine that
has no ``/metrics``.

Request-rounds of a round that no ``record_source`` call claimed are counted as ``"dlite"`` when
the worker finishes the round, so the per-source share is
``rate(sglang:dlite_source_rounds_total[5m]) / ignoring(source) group_left sum(rate(...))``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import Optional

import torch

from sglang_dlite.settings import ServingOptions

logger = logging.getLogger(__name__)

MS_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 250, 500, 1000, 2500)
DEFAULT_SOURCE = "dlite"

_M: Optional[dict] = None  # the prometheus objects, once enabled
_claimed: dict = {}  # source -> request-rounds claimed in the current round


def enabled() -> bool:
    return _M is not None


def enable(num_context_positions: int = 8) -> bool:
    """Create the metrics in this process (idempotent). False when prometheus_client is missing."""
    global _M
    if _M is not None:
        return True
    try:  # an optional dependency: without it DLITE's counters are off
        from prometheus_client import Counter, Histogram
    except ImportError:
        logger.warning("DLITE metrics: prometheus_client is not installed; DLITE's counters are off.")
        return False
    C = max(1, int(num_context_positions))
    _M = dict(
        draft_ms=Histogram("sglang:dlite_draft_ms", "DLITE drafter time per decode round (ms).", buckets=MS_BUCKETS),
        verify_ms=Histogram("sglang:dlite_verify_ms", "DLITE target verify forward per decode round (ms).",
                            buckets=MS_BUCKETS),
        context_rows=Histogram("sglang:dlite_context_rows",
                               "Valid target context rows per request at draft time (0..C).",
                               buckets=tuple(float(i) for i in range(C + 1))),
        rounds=Counter("sglang:dlite_rounds", "DLITE decode rounds (batch steps) drafted."),
        source=Counter("sglang:dlite_source_rounds", "Request-rounds drafted, by drafting source.", ["source"]),
        drafts=Counter("sglang:spec_decode_num_drafts", "Request-rounds that verified drafts."),
        draft_tokens=Counter("sglang:spec_decode_num_draft_tokens", "Draft tokens verified."),
        accepted=Counter("sglang:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
        accepted_per_pos=Counter("sglang:spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by position in the chain (0: the first draft).",
                                 ["position"]),
    )
    return True


_refusals = None  # the HTTP process's refusal counter: None = not created yet, False = metrics off


def record_refusal(endpoint: str, field) -> None:
    """Count one request refused by the request guards (HTTP process; no-op without metrics).
    ``field`` must come from a bounded set (guards.metric_field), never raw client input."""
    global _refusals
    if _refusals is False:
        return
    if _refusals is None:
        try:  # an optional dependency: without it refusals are not counted
            from prometheus_client import Counter

            if not metrics_requested(None):
                raise ImportError
        except ImportError:
            _refusals = False
            return
        _refusals = Counter("sglang:dlite_refused_requests", "Requests refused by DLITE's request guards (HTTP 400).",
                            ["endpoint", "field"])
    _refusals.labels(endpoint=endpoint, field=field or "body").inc()


def record_source(name: str, n: int = 1) -> None:
    """Count ``n`` request-rounds of the current round as drafted by ``name`` (no-op when off)."""
    if _M is None or n <= 0:
        return
    _claimed[name] = _claimed.get(name, 0) + int(n)


def record_sources(sources) -> None:
    """``record_source`` for each source name of a round's requests (one name per request)."""
    for name in set(sources):
        record_source(name, sources.count(name))


def record_acceptance(accepted, num_drafts) -> None:
    """Request-rounds' acceptance: request i accepted ``accepted[i]`` of the ``num_drafts[i]`` drafts
    it verified (``num_drafts`` an int: the same for every request); one with no drafts is not a draft."""
    if _M is None or not accepted:
        return
    drafts = [num_drafts] * len(accepted) if isinstance(num_drafts, int) else num_drafts
    rows = [(int(a), int(d)) for a, d in zip(accepted, drafts) if d > 0]
    if not rows:
        return
    _M["drafts"].inc(len(rows))
    _M["draft_tokens"].inc(sum(d for _, d in rows))
    _M["accepted"].inc(sum(a for a, _ in rows))
    for pos in range(max(min(a, d) for a, d in rows)):
        _M["accepted_per_pos"].labels(position=str(pos)).inc(sum(1 for a, _ in rows if a > pos))


def record_round(draft_ms: float, verify_ms: float, batch_size: int, context_rows=None) -> None:
    """Record one finished decode round (no-op when off). ``context_rows``: per-request counts."""
    if _M is None:
        return
    _M["draft_ms"].observe(draft_ms)
    _M["verify_ms"].observe(verify_ms)
    _M["rounds"].inc()
    if context_rows is not None:
        h = _M["context_rows"]
        for r in context_rows:
            h.observe(r)
    claimed = 0
    for name, n in _claimed.items():
        _M["source"].labels(source=name).inc(n)
        claimed += n
    _claimed.clear()
    if batch_size > claimed:
        _M["source"].labels(source=DEFAULT_SOURCE).inc(batch_size - claimed)


class RoundTimer:
    """Marks one decode round: ``start()`` before drafting, ``mark()`` after the draft and after
    the verify forward, ``finish(bs, valid)`` at the end. On CUDA the marks are CUDA events; a
    round is recorded once its events completed (checked without blocking at later rounds)."""

    def __init__(self, device, log_path: Optional[str] = None):
        self.cuda = str(device).startswith("cuda") and torch.cuda.is_available()
        self.marks: list = []
        self.pending: deque = deque()
        self.log_path = log_path

    def _record(self, draft_ms: float, verify_ms: float, batch_size: int, rows, width: int, tree: bool = False,
                positions=None, round_accepted=None, learn=None) -> None:
        record_round(draft_ms, verify_ms, batch_size, rows)  # acceptance: where sglang takes the result (spec_metrics)
        if self.log_path:
            rec = {"bs": batch_size, "width": width, "tree": tree, "draft_ms": round(draft_ms, 3),
                   "verify_ms": round(verify_ms, 3)}
            if positions is not None and round_accepted is not None:  # acceptance by output position
                rec.update(pos=positions, acc=round_accepted)
            if learn is not None:
                rec.update(learn)
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> "RoundTimer":
        self.marks = [self._now()]
        return self

    def mark(self) -> None:
        self.marks.append(self._now())

    def finish(self, batch_size: int, context_valid=None, width: int = 0, tree: bool = False,
               reqs=None, round_accepted=None, learn=None) -> None:
        """``context_valid``: [B, C] validity of the drafter's context rows (tensor) or None;
        ``width``: tokens verified per request this round; ``tree``: a tree round (rounds.py:
        ``width`` rows per request). With the round log on, ``reqs`` (the batch's requests, their
        output not yet extended by this round) and ``round_accepted`` ([B] drafts accepted by every
        request, opted-out ones included; a tree's along its accepted root path) log each request's
        output position and acceptance: tau by output position; ``learn``: the online learner's
        fields for the round log (``OnlineServing.take_round``), logged as is. Acceptance reaches
        /metrics where sglang takes the round's result (``spec_metrics.RoundStats``), not here."""
        positions = None
        if self.log_path and reqs is not None and round_accepted is not None:
            positions = [len(r.output_ids) for r in reqs]
        else:
            round_accepted = None
        rows = None
        if context_valid is not None:
            rows = (context_valid > 0.5).sum(dim=-1) if context_valid.dtype != torch.bool else context_valid.sum(-1)
        if len(self.marks) < 3:
            return
        if not self.cuda:
            t0, t1, t2 = self.marks[:3]
            self._record((t1 - t0) * 1e3, (t2 - t1) * 1e3, batch_size, None if rows is None else rows.tolist(), width,
                         tree, positions, None if round_accepted is None else round_accepted.tolist(), learn)
            return
        if rows is not None:
            rows = rows.to("cpu", non_blocking=True)
        if round_accepted is not None:
            round_accepted = round_accepted.to("cpu", non_blocking=True)
        end = self._now()
        self.pending.append((self.marks[:3], end, batch_size, rows, width, tree, positions, round_accepted, learn))
        self.poll()

    def poll(self) -> None:
        """Record the CUDA rounds whose events have completed (never waits)."""
        while self.pending and self.pending[0][1].query():
            (e0, e1, e2), _, bs, rows, width, tree, pos, racc, learn = self.pending.popleft()
            self._record(e0.elapsed_time(e1), e1.elapsed_time(e2), bs, None if rows is None else rows.tolist(), width,
                         tree, pos, None if racc is None else racc.tolist(), learn)
        while len(self.pending) > 64:  # never grow without bound
            self.pending.popleft()


def metrics_requested(server_args) -> bool:
    """Whether the server runs with --enable-metrics (sglang 0.5.23 keeps it in the runtime
    context's observability group; older layouts on server_args)."""
    try:  # sglang's runtime context (0.5.23); imported here so that this module loads without sglang
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:
        return bool(getattr(server_args, "enable_metrics", False))


def worker_timer(server_args, device, num_context_positions: int, tp_rank: int = 0,
                 options: Optional[ServingOptions] = None) -> Optional[RoundTimer]:
    """The DLITE worker's round timer, or None when neither metrics nor the round log
    (the setting ``round_log``: ``options.round_log``; None: read from ``SGLANG_DLITE_CONFIG``) is on
    (then the worker does nothing). Only TP rank 0 records (every rank runs the same rounds)."""
    if tp_rank != 0:
        return None
    log_path = (options or ServingOptions.from_env()).round_log
    if not (metrics_requested(server_args) and enable(num_context_positions)) and not log_path:
        return None
    return RoundTimer(device, log_path)
