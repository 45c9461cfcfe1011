"""Per-request lookup state for a batched serving worker (sglang's DLITE worker uses it; this
module imports no sglang and only reads ``req.rid`` and the request's token ids).

One ``SuffixIndex`` per live request, keyed by request id, beside the drafter's hidden-state
context. Invariant (the same as the DLITE worker's): between rounds an index covers exactly the
tokens in the target's KV (``seq_lens``); the anchor (bonus token) is appended when a round
begins, the accepted drafts when it commits. The worker updates it from its own forward results,
so the overlap scheduler's delayed ``req.output_ids`` never matter; filter/merge need nothing
(the state follows ``batch.reqs``). A decode batch is the whole running batch, so every index
whose request is not in it (finished, aborted, retracted) is freed at that round; a request
that comes back (retraction) is re-indexed from its tokens at its next prefill.

Optional cross-request corpus (``corpus_tokens`` > 0; off by default: the DLITE setting
``corpus_tokens``): a request's indexed tokens join a ``corpus.SharedCorpus`` when its index is
freed (finished or aborted; a retracted request's part, continued when it finishes, without
duplicates), under its tenant key (``req.sampling_params.custom_params["dlite_tenant"]`` if set,
else the default tenant), and the tree rounds' indices (``begin_round(lookup=False)``) are
``corpus.CorpusView`` s: the corpus's continuations beside the request's own. Chain rounds are unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Callable, List, Optional, Sequence

from sglang_dlite.drafting.chooser import Calibration, Candidate, best_chain, candidates, default_calibration, lookup_only, needs_dlite, pick
from sglang_dlite.drafting.corpus import SharedCorpus
from sglang_dlite.drafting.suffix import DEFAULT_MAX_MATCH, SuffixIndex

ENV_LOOKUP = "SGLANG_DLITE_LOOKUP"  # "0" / "off" / "false": DLite alone (no lookup)
ENV_TRACE = "SGLANG_DLITE_LOOKUP_TRACE"  # a JSON-lines file: live indices and sources per round


def lookup_enabled(environ=None) -> bool:
    v = (environ if environ is not None else os.environ).get(ENV_LOOKUP, "1").strip().lower()
    return v not in ("0", "off", "false", "no", "none")


def _req_tokens(req) -> list:
    get = getattr(req, "get_fill_ids", None)
    if get is not None:
        return list(get())
    return list(getattr(req, "origin_input_ids", ())) + list(getattr(req, "output_ids", ()))


TENANT_PARAM = "dlite_tenant"  # the custom param naming a request's corpus tenant


def req_tenant(req):
    """The request's corpus tenant key (``custom_params["dlite_tenant"]``), None: the default tenant."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params.get(TENANT_PARAM) if isinstance(params, dict) else None


class BatchLookup:
    def __init__(self, num_drafts: int, calibration: Optional[Calibration] = None,
                 max_match: int = DEFAULT_MAX_MATCH, trace_path: Optional[str] = None,
                 dlite_drafts: Optional[int] = None, corpus_tokens: int = 0):
        self.num_drafts = int(num_drafts)
        # chooser.needs_dlite: the lookup is scored over at most the drafts DLite makes (its K)
        self.skip_horizon = self.num_drafts if dlite_drafts is None else min(self.num_drafts, int(dlite_drafts))
        self.cal = calibration or default_calibration()
        self.max_match = max_match
        self.states: dict = {}
        self.trace_path = trace_path
        self.source_rounds: dict = {}
        self._round = None  # (indices, drafts, sources) of the round draft_round drafted
        on = corpus_tokens is not None and int(corpus_tokens) > 0
        self.corpus = SharedCorpus(int(corpus_tokens), max_match=max_match) if on else None
        self.tenants: dict = {}  # rid -> corpus tenant (with the corpus only)
        self.cursors: dict = {}  # rid -> the request's corpus matches (CorpusView's cursor)

    def __len__(self) -> int:
        return len(self.states)

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self.states.values())

    def _trace(self, rec: dict) -> None:
        if self.trace_path:
            with open(self.trace_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ lifecycle
    def on_extend(self, reqs: Sequence) -> None:
        """After a prefill/extend: index (or extend the index of) each request's tokens in KV."""
        for req in reqs:
            toks = _req_tokens(req)
            idx = self.states.get(req.rid)
            if idx is None:
                self.states[req.rid] = SuffixIndex(toks, self.max_match)
            else:
                idx.sync(toks)
            if self.corpus is not None:
                self.tenants[req.rid] = req_tenant(req)
        self._trace({"event": "extend", "rids": [r.rid for r in reqs], "live": sorted(self.states)})

    def retain(self, rids: Sequence) -> None:
        """Free the indices of requests not in ``rids``; with the corpus, their tokens join it."""
        keep = set(rids)
        for rid in [r for r in self.states if r not in keep]:
            idx = self.states.pop(rid)
            if self.corpus is not None:
                self.corpus.add(idx.tokens, self.tenants.pop(rid, None))
                self.cursors.pop(rid, None)

    # ------------------------------------------------------------------ a round
    def begin_round(self, reqs: Sequence, anchors: Sequence[int], seq_lens: Optional[Sequence[int]] = None,
                    lookup: bool = True):
        """A decode round starts: free the indices of requests not in it, append the anchors,
        and (``lookup``) run the lookup. Returns (indices, lookups, whether DLite is needed at all).
        Without ``lookup`` (tree and skipped rounds) and with the corpus, the indices are
        ``CorpusView`` s (their upkeep goes to the request's own index)."""
        self.retain([r.rid for r in reqs])
        idxs, lookups, need_dlite = [], [], False
        for i, req in enumerate(reqs):
            idx = self.states.get(req.rid)
            if idx is None:  # never saw its prefill (should not happen): index what it has
                toks = _req_tokens(req)
                if seq_lens is not None:
                    toks = toks[: int(seq_lens[i])]
                idx = self.states[req.rid] = SuffixIndex(toks, self.max_match)
            idx.append(int(anchors[i]))
            if self.corpus is not None and not lookup:
                tenant = self.tenants.setdefault(req.rid, req_tenant(req))
                idx = self.corpus.view(idx, tenant, self.cursors.setdefault(req.rid, {}))
            idxs.append(idx)
            if lookup:
                lk = lookup_only(idx, self.num_drafts, self.cal)
                need_dlite = need_dlite or needs_dlite(lk, self.cal, self.skip_horizon)
                lookups.append(lk)
        return idxs, lookups, need_dlite

    def skip_round(self, reqs: Sequence, anchors: Sequence[int], seq_lens: Optional[Sequence[int]] = None) -> None:
        """A round that drafts nothing (the serving load policy): the indices take the anchors, and
        ``commit_round`` adds nothing more (no draft to accept); its source is "off"."""
        idxs, _, _ = self.begin_round(reqs, anchors, seq_lens, lookup=False)
        self._round = (idxs, [[] for _ in idxs], ["off"] * len(idxs))

    def draft_round(self, reqs: Sequence, anchors: Sequence[int], seq_lens: Optional[Sequence[int]],
                    dlite: Callable[[], tuple], choose_width: Optional[Callable[[list], int]] = None) -> List[list]:
        """A decode round's chains, n tokens per request: ``dlite()`` -> DLite's (tokens, confidences)
        lists, run only when some lookup does not skip it; n = ``choose_width(expected_table) - 1``
        (a verify width policy's ``choose_expected``) or ``num_drafts``. ``commit_round`` closes the round."""
        idxs, lookups, need_dlite = self.begin_round(reqs, anchors, seq_lens)
        d_toks, d_conf = dlite() if need_dlite else (None, None)
        cands = self.round_candidates(idxs, lookups, d_toks, d_conf)
        n = self.num_drafts
        if choose_width is not None:
            n = choose_width(self.expected_table(cands, self.num_drafts)) - 1
        drafts, sources, _ = self.pick_round(idxs, cands, n)
        self._round = (idxs, drafts, sources)
        return drafts

    def commit_round(self, reqs: Sequence, accepted: Sequence[int]) -> Optional[List[str]]:
        """``commit`` of the round ``draft_round`` drafted; its sources (None without one)."""
        if self._round is None:
            return None
        (idxs, drafts, sources), self._round = self._round, None
        self.commit(reqs, idxs, drafts, accepted, sources)
        return sources

    def round_candidates(self, idxs, lookups, dlite_tokens: Optional[List[list]] = None,
                         dlite_conf: Optional[List[list]] = None) -> List[List[Candidate]]:
        """Per request, every chain it could verify this round (``chooser.candidates``)."""
        if dlite_tokens is None:
            return [candidates(idx, self.num_drafts, self.cal, lookup=lk) for idx, lk in zip(idxs, lookups)]
        return [candidates(idx, self.num_drafts, self.cal, dlite_tokens[i], dlite_conf[i], lookup=lk)
                for i, (idx, lk) in enumerate(zip(idxs, lookups))]

    def expected_table(self, cands: List[List[Candidate]], num_drafts: int) -> List[List[float]]:
        """table[r][n]: expected accepted drafts of request r's best chain when n of its tokens
        are verified (n = 0 .. num_drafts): what a per-round verify width is chosen from."""
        return [[best_chain(c, self.cal, n).score(n) for n in range(num_drafts + 1)] for c in cands]

    def pick_round(self, idxs, cands: List[List[Candidate]], n: int):
        """Per request: the chain to verify with n drafts per request (a shorter chain is padded
        by repeating its last token; the verify is n wide anyway), its source, and its calibrated
        per-position probabilities (as long as the real chain)."""
        out, sources, probs = [], [], []
        for idx, cs in zip(idxs, cands):
            c = pick(cs, self.cal, n)
            toks = list(c.tokens[:n])
            probs.append(list(c.probs[: len(toks)]))
            if len(toks) < n:
                fill = toks[-1] if toks else idx.tokens[-1]
                toks += [fill] * (n - len(toks))
            out.append(toks)
            sources.append(c.source)
        return out, sources, probs

    def commit(self, reqs, idxs, drafts: List[list], accepted: Sequence[int], sources=None) -> None:
        """After accept: the accepted drafts join the index (the bonus is the next anchor)."""
        for idx, d, a in zip(idxs, drafts, accepted):
            idx.extend(d[: int(a)])
        if sources is not None:
            for s in sources:
                self.source_rounds[s] = self.source_rounds.get(s, 0) + 1
        if self.trace_path:
            self._trace({"event": "decode", "rids": [r.rid for r in reqs], "live": sorted(self.states),
                         "sources": sources, "accepted": [int(a) for a in accepted],
                         "width": 1 + max((len(d) for d in drafts), default=0)})
