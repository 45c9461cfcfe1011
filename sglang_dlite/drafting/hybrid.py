"""The served hybrid drafting: DLite and the suffix lookup, per request every round, as chains for
a batch (``BatchLookup``) or as token trees (``grow_round_tree``). Pure python / torch: imports no
sglang and reads only ``req.rid`` and the request's token ids.

**Per-request lookup state** (``BatchLookup``):
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

**Token trees** (``grow_round_tree``; the sglang worker's tree rounds and the reference engine's
tree drafters): each round grows one token tree (``drafting.tree.grow_tree``: best-first by the chance each
node is reached, within ``num_drafts`` nodes) whose nodes' children come from two sources:

- the suffix lookup: the most frequent continuations of the node's match
  (``SuffixIndex.continuations``, ranked by occurrence counts: a branch wherever the earlier
  continuations split), each scored by the calibrated lookup table (``Calibration.p_lookup``);
- optionally (``corpus``, off by default) a cross-request corpus of earlier requests' tokens
  (``corpus.CorpusView``): its continuations of the same context that differ from the request's own,
  scored by the calibration's corpus rule;
- DLite: the top-k tokens of its low-rank head at the node's block position
  (``DLiteDrafter.head_branch``: one head step + one vocabulary projection per expanded node, the
  backbone run once per round), each scored by the calibrated DLite table (its softmax probability,
  agreement with the lookup's first suggestion) for the head's first choice and by
  ``min(probability, table)`` for the others.

A token both sources propose is one child with the better score. A node keeps both states: the
head state while its depth is below DLite's K, and the lookup's match after its token (a DLite
prefix is continued by the lookup: the "mixed" chains of ``chooser.py`` as branches of one tree).
The drafts are deterministic, so sampled requests verify them by recursive rejection with one-hot
q (``drafting.tree``): lossless at any temperature.
"""

from __future__ import annotations

import json
from typing import Callable, List, Optional, Sequence


from sglang_dlite.drafting.accept import expected_accepted
from sglang_dlite.drafting.budget import reaches
from sglang_dlite.drafting.chooser import Calibration, Candidate, best_chain, candidates, default_calibration, lookup_only, needs_dlite
from sglang_dlite.drafting.corpus import SharedCorpus
from sglang_dlite.drafting.suffix import DEFAULT_MAX_MATCH, SuffixIndex
from sglang_dlite.drafting.tree import grow_tree


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
    """The one batched lookup drafting (B >= 1): the sglang worker drives it over its running batch,
    the reference engine (``dlite_lab/reference/drafters.py``) over one request. ``min_reach`` cuts a
    chain where the chance its next position is reached falls below it (0: off); ``round_log`` (a
    list, or None) collects every request's candidates per round (DLite then runs every round: the
    calibration fit, ``bench/lookup_calibration.py``); ``corpus``: a ``SharedCorpus`` to use instead
    of one of ``corpus_tokens`` tokens."""

    def __init__(self, num_drafts: int, calibration: Optional[Calibration] = None,
                 max_match: int = DEFAULT_MAX_MATCH, trace_path: Optional[str] = None,
                 dlite_drafts: Optional[int] = None, corpus_tokens: int = 0, min_reach: float = 0.0,
                 round_log: Optional[list] = None, corpus: Optional[SharedCorpus] = None):
        self.num_drafts = int(num_drafts)
        # chooser.needs_dlite: the lookup is scored over at most the drafts DLite makes (its K)
        self.skip_horizon = self.num_drafts if dlite_drafts is None else min(self.num_drafts, int(dlite_drafts))
        self.cal = calibration or default_calibration()
        self.max_match = max_match
        self.min_reach, self.round_log = float(min_reach), round_log
        self.states: dict = {}
        self.trace_path = trace_path
        self.source_rounds: dict = {}
        self._round = None  # (indices, drafts, sources) of the round draft_round drafted
        on = corpus_tokens is not None and int(corpus_tokens) > 0
        self.corpus = corpus if corpus is not None else (SharedCorpus(int(corpus_tokens), max_match=max_match)
                                                        if on else None)
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
            self.finish(rid)

    def finish(self, rid, tokens: Optional[Sequence[int]] = None) -> None:
        """Request ``rid`` ended: its index is freed; with the corpus, ``tokens`` (default: what its
        index covers) join it under the request's tenant."""
        idx = self.states.pop(rid, None)
        if self.corpus is not None and (idx is not None or tokens is not None):
            self.corpus.add(idx.tokens if tokens is None else tokens, self.tenants.pop(rid, None))
        self.cursors.pop(rid, None)

    # ------------------------------------------------------------------ a round
    def begin_round(self, reqs: Sequence, anchors: Sequence[int], seq_lens: Optional[Sequence[int]] = None,
                    lookup: bool = True, retain: bool = True):
        """A decode round starts: free the indices of requests not in it (``retain``: the batch is
        every live request), append the anchors, and (``lookup``) run the lookup. Returns (indices,
        lookups, whether DLite is needed at all). Without ``lookup`` (tree and skipped rounds) and with
        the corpus, the indices are ``CorpusView`` s (their upkeep goes to the request's own index)."""
        if retain:
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
        return idxs, lookups, need_dlite or (lookup and self.round_log is not None)

    def skip_round(self, reqs: Sequence, anchors: Sequence[int], seq_lens: Optional[Sequence[int]] = None) -> None:
        """A round that drafts nothing (the serving load policy): the indices take the anchors, and
        ``commit_round`` adds nothing more (no draft to accept); its source is "off"."""
        idxs, _, _ = self.begin_round(reqs, anchors, seq_lens, lookup=False)
        self._round = (idxs, [[] for _ in idxs], ["off"] * len(idxs))

    def draft_round(self, reqs: Sequence, anchors: Sequence[int], seq_lens: Optional[Sequence[int]],
                    dlite: Optional[Callable[[], tuple]], choose_width: Optional[Callable[[list], int]] = None,
                    pad: bool = True, retain: bool = True):
        """A decode round's chains, at most n tokens per request: ``dlite()`` -> DLite's (tokens,
        confidences) lists, run only when some lookup does not skip it (None: the lookup alone); n =
        ``choose_width(expected_table) - 1`` (a verify width policy's ``choose_expected``) or
        ``num_drafts``. Returns (chains, padded to n by repeating their last token with ``pad``, their
        sources, their calibrated per-position probabilities). ``commit_round`` closes the round."""
        idxs, lookups, need_dlite = self.begin_round(reqs, anchors, seq_lens, retain=retain)
        d_toks, d_conf = dlite() if need_dlite and dlite is not None else (None, None)
        logs = None
        if self.round_log is not None:
            logs = [{"ctx_len": len(idx)} for idx in idxs]
        cands = self.round_candidates(idxs, lookups, d_toks, d_conf, logs)
        n = self.num_drafts
        if choose_width is not None:
            n = choose_width(self.expected_table(cands, self.num_drafts)) - 1
        drafts, sources, probs = self.pick_round(idxs, cands, n, pad, logs)
        self._round = (idxs, drafts, sources)
        return drafts, sources, probs

    def commit_round(self, reqs: Sequence, accepted: Sequence[int]) -> Optional[List[str]]:
        """``commit`` of the round ``draft_round`` drafted; its sources (None without one)."""
        if self._round is None:
            return None
        (idxs, drafts, sources), self._round = self._round, None
        self.commit(reqs, idxs, drafts, accepted, sources)
        return sources

    def round_candidates(self, idxs, lookups, dlite_tokens: Optional[List[list]] = None,
                         dlite_conf: Optional[List[list]] = None, logs: Optional[list] = None) -> List[List[Candidate]]:
        """Per request, every chain it could verify this round (``chooser.candidates``)."""
        return [candidates(idx, self.num_drafts, self.cal, None if dlite_tokens is None else dlite_tokens[i],
                           None if dlite_conf is None else dlite_conf[i], lookup=lk,
                           log=None if logs is None else logs[i])
                for i, (idx, lk) in enumerate(zip(idxs, lookups))]

    def expected_table(self, cands: List[List[Candidate]], num_drafts: int) -> List[List[float]]:
        """table[r][n]: expected accepted drafts of request r's best chain when n of its tokens
        are verified (n = 0 .. num_drafts): what a per-round verify width is chosen from."""
        return [[best_chain(c, self.cal, n).score(n) for n in range(num_drafts + 1)] for c in cands]

    def pick_round(self, idxs, cands: List[List[Candidate]], n: int, pad: bool = True, logs: Optional[list] = None):
        """Per request: the chain to verify with at most n drafts (cut at ``min_reach``; with ``pad`` a
        shorter chain is padded by repeating its last token: the verify is n wide anyway), its source,
        and its calibrated per-position probabilities (as long as the real chain)."""
        out, sources, probs = [], [], []
        for i, (idx, cs) in enumerate(zip(idxs, cands)):
            c = best_chain(cs, self.cal, n)
            toks = list(c.tokens[:n])
            if self.min_reach > 0:  # cut where the chance that a position is reached gets small
                toks = toks[:len(reaches(c.probs, self.min_reach))]
            probs.append(list(c.probs[: len(toks)]))
            if logs is not None:
                logs[i].update(source=c.source, tokens=toks, score=expected_accepted(probs[-1]), split=c.split)
                self.round_log.append(logs[i])
            if pad and len(toks) < n:
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


# ---------------------------------------------------------------------------- token trees
DEFAULT_TREE_NODES = 24  # drafts per tree round (the root not counted)
SERVED_TREE_NODES = 15  # drafts per tree round of ``--drafter hybrid``: the DLITE worker's rows (W = 16) less the root
DEFAULT_BRANCHES = 4  # children asked of each source per node


class _Node:
    """A tree node's drafting state: its token, its block position (depth), DLite's head state
    after its parent (None past K, off DLite's reach or without DLite), the lookup's match after its
    token (None without the lookup), and which source proposed it."""

    __slots__ = ("token", "depth", "head", "match", "source")

    def __init__(self, token: int, depth: int, head, match, source: str):
        self.token, self.depth, self.head, self.match, self.source = token, depth, head, match, source


class ChainBranches:
    """DLite's children along its greedy chain only: at block position i of the chain, the k
    likeliest tokens of the pass that drafted the chain (``DLiteDrafter.propose(top_k=k)``:
    ``top_tokens`` / ``top_probs`` [n, k] lists of one request). Only the chain's own token
    continues (its node is on the chain); the others are leaves. No model call while the tree
    grows: the batched serving worker drafts a whole batch's branches in one pass."""

    def __init__(self, top_tokens: list, top_probs: list):
        self.top_tokens, self.top_probs = top_tokens, top_probs
        self.block_size = len(top_tokens)

    def root_head(self):
        return True if self.block_size else None

    def children(self, node: _Node):
        i = node.depth
        toks, probs = self.top_tokens[i], self.top_probs[i]
        on_chain = i + 1 < self.block_size
        return toks, probs, lambda token: True if on_chain and token == toks[0] else None


class _Round:
    """One round's expansion (``grow_tree``'s ``expand``) over the suffix index and / or DLite's
    branches (``HeadBranches`` or ``ChainBranches``)."""

    def __init__(self, index, dlite, cal: Calibration, branches: int):
        self.index, self.dlite, self.cal, self.branches = index, dlite, cal, branches
        self.sources = set()  # who proposed the kept drafts: the round's source

    def root(self, anchor: int) -> _Node:
        head = None if self.dlite is None else self.dlite.root_head()
        return _Node(anchor, 0, head, None if self.index is None else self.index.match(), "")

    def expand(self, node: _Node):
        """The node's children: ``[(token, P(accepted | node reached), child node)]``."""
        if node.source:
            self.sources.add(node.source)
        cal, d = self.cal, node.depth + 1
        looked = [] if node.match is None else self.index.continuations(*node.match, self.branches)
        toks, qs, head_of = ([], [], lambda token: None) if node.head is None else self.dlite.children(node)
        kids = {step.token: [cal.p_lookup(step), _Node(step.token, d, head_of(step.token), match,
                                                       "corpus" if step.corpus else "suffix")]
                for step, match in looked}
        first = looked[0][0].token if looked else None
        for rank, (t, q) in enumerate(zip(toks, qs)):
            p = cal.p_dlite(q, 0 if first is None else (2 if first == t else 1))
            p = p if rank == 0 else min(q, p)
            if t in kids:
                kids[t][0] = max(kids[t][0], p)
                kids[t][1].source = "mixed"
            else:  # the lookup continues DLite's token from the node's match (a mixed branch)
                match = None if node.match is None else self.index.walk(*node.match, t)
                kids[t] = [p, _Node(t, d, head_of(t), match, "dlite")]
        return [(t, p, child) for t, (p, child) in kids.items()]


def grow_round_tree(anchor: int, index, dlite, cal: Calibration, branches: int,
                    num_drafts: int, max_depth: Optional[int] = None):
    """One request's tree of at most ``num_drafts`` drafts from the lookup's ``index`` (a
    ``SuffixIndex``, or a ``corpus.CorpusView`` adding the cross-request corpus's branches) and / or
    DLite's branches ``dlite``. Returns (the tree, each node's reach, the round's source: suffix,
    dlite, corpus, mixed or none)."""
    rnd = _Round(index, dlite, cal, branches)
    tree, reach = grow_tree(anchor, rnd.root(anchor), rnd.expand, num_drafts, max_depth)
    kinds = rnd.sources
    source = "none" if len(tree) == 1 else (next(iter(kinds)) if len(kinds) == 1 else "mixed")
    return tree, reach, source


def grow_trees(anchors: Sequence[int], idxs: Sequence, top_tokens: Optional[list], top_probs: Optional[list],
               cal: Calibration, branches: int, num_drafts: int, max_depth: Optional[int] = None):
    """A batch's trees (B >= 1; the worker's tree rounds and the reference engine's): per request the
    lookup's ``idxs[b]`` (None: no lookup) and DLite's top-k along its greedy chain (``top_tokens`` /
    ``top_probs``: ``DLiteDrafter.propose(top_k=branches)``'s, as lists; None: no DLite) -> (trees,
    reaches, sources)."""
    out = [grow_round_tree(anchor, idxs[b], None if top_tokens is None else ChainBranches(top_tokens[b], top_probs[b]),
                           cal, branches, num_drafts, max_depth) for b, anchor in enumerate(anchors)]
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]
