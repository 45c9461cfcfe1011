"""What the reference engine asks a drafter each round, and the drafters it can use.

A drafter sees a ``DraftRequest`` (the committed tokens and the target's captured hidden states)
and returns a ``DraftProposal`` of at most ``num_drafts`` tokens (DLite: its block size K). The
adapters here drive the product's drafting code (``sglang_dlite.drafting``) one request at a time:

- ``DLiteEngineDrafter``: DLite alone; reads only the last C positions (plus the history the config
  allows, for the lab's teacher / window ablations);
- ``SuffixEngineDrafter`` / ``HybridEngineDrafter``: the suffix lookup alone, or lookup and DLite
  chosen per request every round;
- ``TreeEngineDrafter``: one token tree per round (``suffix-tree`` / ``dlite-tree`` / ``hybrid``);
- ``OnlineDrafter``: any of them over the online learner's working copy (``drafting.online``);

The lookup drafters drive the sglang worker's own batched drafting (``drafting.hybrid.BatchLookup``:
the per-request indices, the hybrid's choice, ``grow_trees``) with a batch of one request: the same
draft / commit calls the worker makes over its running batch. The engine tells them what each round
accepted (``commit``) and when a request ends (``finish_request``).
- ``OracleDrafter``: a known continuation (tests).

Lookup, hybrid and tree drafts are deterministic (DLite's greedy chain, the lookup's most frequent
continuation), so sampled requests use the deterministic-draft rejection rule (q one-hot):
lossless at any temperature. A chain may be shorter than K (the lookup ran out, or the length
cut): the engine then verifies fewer tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from dlite_lab.ablations import History
from sglang_dlite.drafting.accept import expected_accepted
from sglang_dlite.drafting.chooser import Calibration
from sglang_dlite.drafting.context import last_rows
from sglang_dlite.drafting.corpus import SharedCorpus
from sglang_dlite.drafting.hybrid import DEFAULT_BRANCHES, DEFAULT_TREE_NODES, BatchLookup, grow_round_tree, grow_trees
from sglang_dlite.drafting.online import STATE_KEY, OnlineLearner
from sglang_dlite.drafting.suffix import DEFAULT_MAX_MATCH
from sglang_dlite.drafting.tree import expected_accepted_tree
from sglang_dlite.errors import DLiteInputError
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.model.proposal import DraftProposal


@dataclass
class DraftRequest:
    tokens: list  # committed token ids; the anchor is tokens[-1]
    hidden: torch.Tensor  # [L, T, H] captured hidden states of absolute positions hidden_start..+T-1
    hidden_start: int
    temperature: float = 0.0
    top_p: float = 1.0
    generator: Optional[torch.Generator] = None
    # Per-conversation scratch space owned by the engine's Session. DLite uses none (it keeps
    # nothing between rounds); drafters with their own KV cache (baselines) keep it here and must
    # crop it to ``hidden_end`` positions themselves (the engine rolls back rejected drafts).
    state: dict = field(default_factory=dict)

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + self.hidden.shape[1]


class Drafter(Protocol):
    num_drafts: int  # drafts proposed per round, at most: a round verifies num_drafts + 1 tokens (W)
    capture_layer_ids: list  # target layers whose outputs the engine must capture
    hidden_rows_needed: Optional[int]  # how many newest positions to keep (None: all)

    def draft(self, req: DraftRequest) -> DraftProposal: ...

    # Optional: ``commit(req, accepted_drafts)``, called by the reference engine after each verify
    # (a tree: its accepted root path's drafts); the lookup drafters' indices take them.
    # Optional: ``observe(req, drafts, target_logits, accepted)``, called after ``commit``
    # (target_logits [len(drafts) + 1, V]); online.py learns from it.
    # Optional: ``finish_request(state, tokens)``, called by the reference engine when a speculative
    # ``generate`` ends (tokens: the session's prompt + output): the lookup frees the request's index,
    # drafting/corpus.py's corpus takes the tokens.


class DLiteEngineDrafter:
    """Adapts a DLiteDrafter (any history mode) to the engine's per-round interface."""

    def __init__(self, model: DLiteDrafter):
        self.model = model
        cfg = model.config
        self.num_drafts = cfg.block_size  # K
        self.capture_layer_ids = list(cfg.target_layer_ids)
        w = cfg.history_window
        self.hidden_rows_needed = None if w is None else cfg.num_context_positions + w

    def context_inputs(self, req: DraftRequest):
        """Last C positions (left-padded, with a validity mask) + the allowed history."""
        cfg = self.model.config
        C = cfg.num_context_positions
        T = req.hidden.shape[1]
        n = min(C, T)
        ctx, valid = last_rows(req.hidden, C)  # [L, C, H], [C]
        dev = req.hidden.device
        history = None
        offset = req.hidden_end - C
        w = cfg.history_window
        if w != 0 and T > n:
            h = req.hidden[:, : T - n]
            if w is not None:
                h = h[:, -w:]
            start = req.hidden_end - n - h.shape[1]
            history = History(
                hidden=h[None], positions=torch.arange(start, start + h.shape[1], device=dev)[None],
                valid=torch.ones(1, h.shape[1], dtype=torch.bool, device=dev),
            )
        return ctx[None], valid[None], history, torch.tensor([offset], device=dev)

    def _inputs(self, req: DraftRequest):
        """(context rows, validity, anchor, the ablations' history keywords: none for DLite)."""
        ctx, valid, history, offset = self.context_inputs(req)
        anchor = torch.tensor([req.tokens[-1]], device=req.hidden.device)
        extra = {} if history is None else {"history": history, "round_offset": offset}
        return ctx, valid, anchor, extra

    def propose(self, req: DraftRequest, **kw) -> DraftProposal:
        """The model's ``propose`` for this request (``kw``: num_drafts, top_k, return_confidence, ...)."""
        ctx, valid, anchor, extra = self._inputs(req)
        return self.model.propose(ctx, valid, anchor, **extra, **kw)

    def backbone(self, req: DraftRequest) -> torch.Tensor:
        """The backbone outputs [1, K+1, H] for this request (a tree's head branches)."""
        ctx, valid, anchor, extra = self._inputs(req)
        return self.model.backbone(ctx, valid, anchor, *extra.values())

    def draft(self, req: DraftRequest) -> DraftProposal:
        return self.propose(req, temperature=req.temperature, top_p=req.top_p, generator=req.generator)


class OracleDrafter:
    """Proposes a known continuation (e.g. the target's own greedy output): every draft accepted
    while the continuation holds. Tests use it to exercise multi-token acceptance."""

    def __init__(self, prompt_len_to_continuation: dict, num_drafts: int = 7, vocab_size: int = 2):
        self.table = prompt_len_to_continuation  # tuple(full token sequence) -> next tokens
        self.num_drafts = num_drafts
        self.capture_layer_ids = [0]
        self.hidden_rows_needed = 1
        self.vocab_size = vocab_size

    def draft(self, req: DraftRequest) -> DraftProposal:
        for seq in self.table:
            n = len(req.tokens)
            if len(seq) > n and list(seq[:n]) == list(req.tokens):
                nxt = list(seq[n:n + self.num_drafts])
                break
        else:
            nxt = []
        nxt = nxt + [0] * (self.num_drafts - len(nxt))
        return DraftProposal(torch.tensor([nxt]), None)


# ---------------------------------------------------------------------------- the lookup drafters
class _OneRequest:
    """The request a ``BatchLookup`` sees: its key and the tokens in the target's KV."""

    def __init__(self, rid, tokens=()):
        self.rid, self.tokens = rid, tokens

    def get_fill_ids(self):
        return self.tokens


class _LookupDrafter:
    """What the lookup drafters share: one ``BatchLookup`` driven at B = 1. Between rounds a session's
    index covers its tokens in the target's KV (``tokens[:-1]``): ``begin`` re-syncs it when a new turn
    (or a cut at a stop) changed them, the round appends the anchor, ``commit`` the accepted drafts."""

    def __init__(self, num_drafts: int, max_match: int, calibration: Optional[Calibration], **lookup_kw):
        self.lookup = BatchLookup(num_drafts, calibration, max_match, **lookup_kw)
        self.cal = self.lookup.cal
        self.num_drafts, self.max_match = self.lookup.num_drafts, max_match

    @property
    def corpus(self) -> Optional[SharedCorpus]:
        return self.lookup.corpus

    def begin(self, req: DraftRequest) -> _OneRequest:
        st, kv = req.state, len(req.tokens) - 1
        rid = st.setdefault("lookup_rid", object())
        idx = self.lookup.states.get(rid)
        if idx is None or st.get("lookup_tokens") is not req.tokens or len(idx) != kv:
            self.lookup.on_extend([_OneRequest(rid, req.tokens[:kv])])
            st["lookup_tokens"] = req.tokens
        return _OneRequest(rid)

    def commit(self, req: DraftRequest, accepted_drafts: list) -> None:
        self.lookup.commit_round([_OneRequest(req.state["lookup_rid"])], [len(accepted_drafts)])

    def finish_request(self, state: dict, tokens: list) -> None:
        """A request ended with ``tokens`` (prompt + output): its index is freed, the corpus (if on) takes them."""
        if "lookup_rid" in state:
            self.lookup.finish(state.pop("lookup_rid"), tokens if self.lookup.corpus is not None else None)

    def memory_bytes(self, state: dict) -> int:
        idx = self.lookup.states.get(state.get("lookup_rid"))
        return 0 if idx is None else idx.memory_bytes()

    def _chain(self, req: DraftRequest, dlite=None) -> DraftProposal:
        r = self.begin(req)
        drafts, sources, probs = self.lookup.draft_round([r], [req.tokens[-1]], None, dlite, pad=False, retain=False)
        t = torch.tensor(drafts[0], dtype=torch.int64).view(1, len(drafts[0]))
        return DraftProposal(t, None, source=sources[0], score=expected_accepted(probs[0]))


class SuffixEngineDrafter(_LookupDrafter):
    """The suffix lookup alone (no model, no hidden states: captures one layer, keeps one row,
    because the engine always captures something)."""

    capture_layer_ids = [0]
    hidden_rows_needed = 1

    def __init__(self, num_drafts: int = 7, max_match: int = DEFAULT_MAX_MATCH,
                 calibration: Optional[Calibration] = None):
        super().__init__(num_drafts, max_match, calibration)

    def draft(self, req: DraftRequest) -> DraftProposal:
        return self._chain(req)


class HybridEngineDrafter(_LookupDrafter):
    """DLite + the suffix lookup, the better (or their combination) per round: the worker's chain rounds.
    ``round_log`` (calibration runs): every round's candidates; ``min_reach``: the chain's cut."""

    def __init__(self, dlite: DLiteEngineDrafter, max_match: int = DEFAULT_MAX_MATCH,
                 calibration: Optional[Calibration] = None, min_reach: float = 0.0,
                 round_log: Optional[list] = None, num_drafts: Optional[int] = None):
        # a chain may run past DLite's K drafts (the lookup continues it): num_drafts >= K
        n = dlite.num_drafts if num_drafts is None else int(num_drafts)
        if n < dlite.num_drafts:
            raise ValueError(f"num_drafts={num_drafts} is below DLite's K={dlite.num_drafts}; "
                             "verify a prefix with min_reach or a shorter K instead.")
        super().__init__(n, max_match, calibration, dlite_drafts=dlite.num_drafts, min_reach=min_reach,
                         round_log=round_log)
        self.dlite = dlite
        self.capture_layer_ids = dlite.capture_layer_ids
        self.hidden_rows_needed = dlite.hidden_rows_needed

    def draft(self, req: DraftRequest) -> DraftProposal:
        def dlite():  # asked only where the lookup is not confident enough (calibration logs: always)
            prop = self.dlite.propose(req, return_confidence=True)
            return prop.tokens.tolist(), prop.confidence.float().tolist()
        return self._chain(req, dlite)


# ---------------------------------------------------------------------------- token trees
BRANCHINGS = ("head", "chain")  # where DLite branches: every node (head steps) or its greedy chain


class HeadBranches:
    """DLite's children of any node (``branching=head``, the lab's ``hybrid@branching=head``): one step of the
    token-fed head from the node's own state and one vocabulary projection per expanded node
    (``DLiteDrafter.head_branch``), the backbone outputs ``z`` [1, K+1, H] computed once per round.
    Exact top-k at every node; a model call per node (the served trees branch along DLite's chain)."""

    def __init__(self, model, z: torch.Tensor, branches: int, block_size: int):
        self.model, self.z, self.branches, self.block_size = model, z, branches, block_size

    def root_head(self):
        return torch.zeros(1, self.model.config.rnn_rank, device=self.z.device)

    def children(self, node):
        """(top tokens, their probabilities, the head state every child continues from)."""
        prev = torch.tensor([node.token], device=self.z.device)
        state, toks, probs = self.model.head_branch(self.z, node.head, node.depth, prev, self.branches)
        head = state if node.depth + 1 < self.block_size else None
        return toks[0].tolist(), probs[0].tolist(), lambda token: head


class TreeEngineDrafter(_LookupDrafter):
    """One token tree per round from the suffix lookup (``lookup=True``) and / or DLite (``dlite``):
    ``suffix-tree`` is the lookup alone, ``dlite-tree`` DLite alone, ``hybrid`` both.
    ``num_drafts``: the tree's nodes, the root not counted (a round verifies num_drafts + 1 rows);
    ``branches``: the children each source offers a node (the budget decides how many are kept);
    ``branching``: DLite's branches at every node (``head``: ``HeadBranches``) or along its greedy
    chain only (``chain``: ``drafting.hybrid.grow_trees``, what the sglang worker drafts); ``corpus``: a
    ``corpus.SharedCorpus`` (off: None) whose earlier requests branch the lookup's nodes too, fed by
    ``finish_request``. ``grow`` grows this round's tree again from another model (the tree gate)."""

    def __init__(self, dlite: Optional[DLiteEngineDrafter] = None, lookup: bool = True,
                 num_drafts: int = DEFAULT_TREE_NODES, branches: int = DEFAULT_BRANCHES,
                 max_match: int = DEFAULT_MAX_MATCH, calibration: Optional[Calibration] = None,
                 max_depth: Optional[int] = None, branching: str = "head", corpus: Optional[SharedCorpus] = None):
        if dlite is None and not lookup:
            raise DLiteInputError("a tree drafter needs DLite, the suffix lookup, or both.")
        if corpus is not None and not lookup:
            raise DLiteInputError("the cross-request corpus branches the suffix lookup's nodes: it needs the lookup.")
        if num_drafts < 1 or branches < 1:
            raise DLiteInputError(f"a draft tree needs num_drafts >= 1 and branches >= 1 (got {num_drafts}, "
                                  f"{branches}).")
        if branching not in BRANCHINGS:
            raise DLiteInputError(f"tree branching {branching!r}: use one of {', '.join(BRANCHINGS)}.")
        super().__init__(num_drafts, max_match, calibration, corpus=corpus)
        self.dlite, self.use_lookup, self.branching = dlite, lookup, branching
        self.branches, self.max_depth = int(branches), max_depth
        self.block_size = dlite.num_drafts if dlite is not None else 0
        self.capture_layer_ids = dlite.capture_layer_ids if dlite is not None else [0]
        self.hidden_rows_needed = dlite.hidden_rows_needed if dlite is not None else 1
        self._round = None  # (the request, its index) of the round being drafted

    def draft(self, req: DraftRequest, model=None) -> DraftProposal:
        """Begin the round and grow its tree (DLite's branches from ``model``, default its own)."""
        idxs = [None]
        if self.use_lookup:
            r = self.begin(req)
            idxs, _, _ = self.lookup.begin_round([r], [req.tokens[-1]], lookup=False, retain=False)
        self._round = (r if self.use_lookup else None, idxs)
        return self.grow(req, model if model is not None or self.dlite is None else self.dlite.model)

    def grow(self, req: DraftRequest, model) -> DraftProposal:
        """This round's tree (``draft`` began it) with DLite's branches from ``model``."""
        idxs, anchor = self._round[1], req.tokens[-1]
        if model is None:
            trees, reaches, sources = grow_trees([anchor], idxs, None, None, self.cal, self.branches,
                                                 self.num_drafts, self.max_depth)
        elif self.branching == "chain":
            with torch.no_grad():
                prop = DLiteEngineDrafter(model).propose(req, num_drafts=self.block_size, top_k=self.branches)
            trees, reaches, sources = grow_trees([anchor], idxs, prop.top_tokens.tolist(),
                                                 prop.top_probs.float().tolist(), self.cal, self.branches,
                                                 self.num_drafts, self.max_depth)
        else:
            with torch.no_grad():
                branches = HeadBranches(model, DLiteEngineDrafter(model).backbone(req), self.branches, self.block_size)
                tree, reach, source = grow_round_tree(anchor, idxs[0], branches, self.cal, self.branches,
                                                      self.num_drafts, self.max_depth)
            trees, reaches, sources = [tree], [reach], [source]
        tree = trees[0]
        tokens = torch.tensor([tree.drafts], dtype=torch.int64).view(1, len(tree) - 1)
        return DraftProposal(tokens, None, source=sources[0], score=expected_accepted_tree(reaches[0]), tree=tree)

    def commit(self, req: DraftRequest, accepted_drafts: list) -> None:
        (r, idxs), self._round = self._round, None
        if r is not None:
            self.lookup.commit([r], idxs, [accepted_drafts], [len(accepted_drafts)])


# ---------------------------------------------------------------------------- online learning
class OnlineDrafter:
    """An engine drafter (DLite, or hybrid over the learner's working model) that learns online:
    ``draft`` as the inner drafter, ``observe`` feeds the verify result to the learner.

    Token-tree drafters go through the tree gate (``OnlineLearner.tree_gate``, the sglang worker's
    rule): once the working copy has been updated, a round grows the tree of the model the gate
    favours, the adapted copy or the shipped drafter, and on a judged round (one in ``watch_every``:
    every round per session) the other tree too, which ``judge_tree`` scores against what the round
    committed (``DraftTree.accepted_along``). Verification is unchanged: lossless either way."""

    def __init__(self, inner, learner: OnlineLearner):
        self.inner, self.learner = inner, learner
        self.num_drafts = inner.num_drafts
        self.capture_layer_ids = inner.capture_layer_ids
        self.hidden_rows_needed = inner.hidden_rows_needed
        # the gate's other model: the shipped drafter, for tree drafters with DLite (else no gate)
        trees = isinstance(inner, TreeEngineDrafter) and inner.dlite is not None and learner.cfg.tree_gate
        self.gated = bool(trees)
        self._rows = DLiteEngineDrafter(learner.model)  # its context_inputs: the rows the drafter read
        self._gate = None  # this round's judged (adapted tree, shipped tree, the adapted one verified?)
        self._pending = None  # (context, valid, anchor) of the round being verified

    def draft(self, req: DraftRequest) -> DraftProposal:
        st = self.learner.state_for(req.state)
        learn = not self.gated or self.learner.learns_tree_round(st)  # the back-off (tree rounds)
        self.learner.activate(st)  # the session's weights in; its inputs kept unless backed off
        self._pending = None
        if learn:
            ctx, valid, _, _ = self._rows.context_inputs(req)
            self._pending = (ctx[0].detach().clone(), valid[0].clone(), int(req.tokens[-1]))
        self._gate = None
        gate = self.learner.tree_gate(st) if self.gated else None
        if gate is None:
            return self.inner.draft(req)  # the working copy's
        use, judge = gate
        adapted, shipped = self.learner.model, self.learner.shipped
        prop = self.inner.draft(req, adapted if use else shipped)
        if judge:  # the other tree too, scored in observe
            t0 = time.perf_counter()
            other = self.inner.grow(req, shipped if use else adapted)
            self.learner.stats["shadow_ms"] += (time.perf_counter() - t0) * 1e3
            self._gate = (prop.tree, other.tree, use) if use else (other.tree, prop.tree, use)
        return prop

    def commit(self, req: DraftRequest, accepted_drafts: list) -> None:
        commit = getattr(self.inner, "commit", None)
        if commit is not None:
            commit(req, accepted_drafts)

    def finish_request(self, state: dict, tokens: list) -> None:
        finish = getattr(self.inner, "finish_request", None)
        if finish is not None:
            finish(state, tokens)

    def observe(self, req: DraftRequest, drafts: list, target_logits: torch.Tensor, accepted: int,
                path: bool = False, committed: Optional[list] = None) -> None:
        """``committed``: the tokens the round committed (a tree round: ``drafts`` + the bonus; greedy
        rounds may leave it out, the bonus is then the target's argmax at the last row).
        ``target_logits`` [len(drafts) + 1, V]: the target's logits at the anchor and each draft;
        ``accepted``: the drafts it accepted (``path``: a tree round's accepted root path)."""
        if self._pending is not None:  # a round this drafter drafted (and did not back off)
            t0 = time.perf_counter()
            st = self.learner.state_for(req.state)
            self.learner.activate(st)
            ctx, valid, anchor = self._pending
            d = torch.tensor([drafts], dtype=torch.int64).view(1, len(drafts))
            probs = torch.softmax(target_logits.detach()[None].float(), -1)
            self.learner.learn_round(st, ctx[None], valid[None], torch.tensor([anchor]), d, probs, [accepted],
                                     path=path)
            self._pending = None
            self.learner.stats["observe_ms"] += (time.perf_counter() - t0) * 1e3
        if self._gate is None or not path:
            return
        adapted, shipped, use = self._gate
        self._gate = None
        seq = list(committed) if committed is not None else list(drafts) + [int(target_logits[-1].argmax())]
        self.learner.judge_tree(self.learner.state_for(req.state), use, shipped if use else adapted, seq, accepted)

    def memory_bytes(self, state: dict) -> int:
        inner = getattr(self.inner, "memory_bytes", None)
        st = state.get(STATE_KEY)
        own = 0 if st is None else sum(p.nbytes() for p in st.buffer)
        return (inner(state) if inner else 0) + own

    def stats(self) -> dict:
        return self.learner.summary()
