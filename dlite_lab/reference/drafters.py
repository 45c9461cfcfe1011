"""What the reference engine asks a drafter each round, and the drafters it can use.

A drafter sees a ``DraftRequest`` (the committed tokens and the target's captured hidden states)
and returns a ``DraftProposal`` of at most ``num_drafts`` tokens (DLite: its block size K). The
adapters here drive the product's drafting code (``sglang_dlite.drafting``) one request at a time:

- ``DLiteEngineDrafter``: DLite alone; reads only the last C positions (plus the history the config
  allows, for the lab's teacher / window ablations);
- ``SuffixEngineDrafter`` / ``HybridEngineDrafter``: the suffix lookup alone, or lookup and DLite
  chosen per request every round (``drafting.chooser``);
- ``TreeEngineDrafter``: one token tree per round (``suffix-tree`` / ``dlite-tree`` / ``hybrid-tree``,
  ``drafting.hybrid.grow_round_tree``);
- ``OnlineDrafter``: any of them over the online learner's working copy (``drafting.online``);
- ``OracleDrafter``: a known continuation (tests).

Lookup, hybrid and tree drafts are deterministic (DLite's greedy chain, the lookup's most frequent
continuation), so sampled requests use the deterministic-draft rejection rule (q one-hot):
lossless at any temperature. A chain may be shorter than K (the lookup ran out, or the length
cut): the engine then verifies fewer tokens.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from dlite_lab.ablations import History
from sglang_dlite.drafting.chooser import Calibration, choose, default_calibration, lookup_only, needs_dlite
from sglang_dlite.drafting.context import last_rows
from sglang_dlite.drafting.corpus import SharedCorpus
from sglang_dlite.drafting.hybrid import (
    BRANCHINGS, DEFAULT_BRANCHES, DEFAULT_TREE_NODES, ChainBranches, HeadBranches, grow_round_tree,
)
from sglang_dlite.drafting.online import STATE_KEY, OnlineLearner
from sglang_dlite.drafting.suffix import DEFAULT_MAX_MATCH, SuffixIndex
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

    # Optional: ``observe(req, drafts, target_logits, accepted)``, called by the reference engine
    # after each chain's verify (target_logits [len(drafts) + 1, V]); online.py learns from it.
    # Optional: ``finish_request(state, tokens)``, called by the reference engine when a speculative
    # ``generate`` ends (tokens: the session's prompt + output); drafting/corpus.py's corpus learns from it.


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


# ---------------------------------------------------------------------------- the suffix lookup and hybrid
def session_index(req: DraftRequest, max_match: int = DEFAULT_MAX_MATCH) -> SuffixIndex:
    """The request's suffix index, brought up to its committed tokens: incremental while the
    engine appends to the same token list; a new turn's prompt is checked against the indexed
    tokens once (O(n)) and extends them when it continues them (rebuild otherwise)."""
    st = req.state
    idx = st.get("suffix_index")
    if idx is None:
        idx = st["suffix_index"] = SuffixIndex(max_match=max_match)
    toks = req.tokens
    if st.get("suffix_ref") is toks and len(toks) >= len(idx):
        idx.extend(toks[len(idx):])
    else:
        idx.sync(toks)
        st["suffix_ref"] = toks
    return idx


def _proposal(tokens, source, score) -> DraftProposal:
    t = torch.tensor([list(tokens)], dtype=torch.int64).view(1, len(tokens))
    return DraftProposal(t, None, source=source, score=score)


class SuffixEngineDrafter:
    """The suffix lookup alone (no model, no hidden states: captures one layer, keeps one row,
    because the engine always captures something)."""

    def __init__(self, num_drafts: int = 7, max_match: int = DEFAULT_MAX_MATCH,
                 calibration: Optional[Calibration] = None):
        self.num_drafts = num_drafts
        self.max_match = max_match
        self.cal = calibration or default_calibration()
        self.capture_layer_ids = [0]
        self.hidden_rows_needed = 1

    def memory_bytes(self, state: dict) -> int:
        idx = state.get("suffix_index")
        return 0 if idx is None else idx.memory_bytes()

    def draft(self, req: DraftRequest) -> DraftProposal:
        idx = session_index(req, self.max_match)
        d, ps, score = lookup_only(idx, self.num_drafts, self.cal)
        return _proposal(d.tokens, "suffix" if d.tokens else "none", score)


class HybridEngineDrafter:
    """DLite + the suffix lookup, the better (or their combination) per round."""

    def __init__(self, dlite: DLiteEngineDrafter, max_match: int = DEFAULT_MAX_MATCH,
                 calibration: Optional[Calibration] = None, min_reach: float = 0.0,
                 round_log: Optional[list] = None, num_drafts: Optional[int] = None):
        self.dlite = dlite
        # a chain may run past DLite's K drafts (the lookup continues it): num_drafts >= K
        self.num_drafts = dlite.num_drafts if num_drafts is None else int(num_drafts)
        if self.num_drafts < dlite.num_drafts:
            raise ValueError(f"num_drafts={num_drafts} is below DLite's K={dlite.num_drafts}; "
                             "verify a prefix with min_reach or a shorter K instead.")
        self.capture_layer_ids = dlite.capture_layer_ids
        self.hidden_rows_needed = dlite.hidden_rows_needed
        self.max_match = max_match
        self.cal = calibration or default_calibration()
        self.min_reach = min_reach
        self.round_log = round_log  # calibration runs: every round's candidates

    def memory_bytes(self, state: dict) -> int:
        idx = state.get("suffix_index")
        return 0 if idx is None else idx.memory_bytes()

    def draft(self, req: DraftRequest) -> DraftProposal:
        n = self.num_drafts
        idx = session_index(req, self.max_match)
        lk = lookup_only(idx, n, self.cal)
        log = None if self.round_log is None else {"ctx_len": len(req.tokens)}
        if log is None and not needs_dlite(lk, self.cal, self.dlite.num_drafts):  # calibration logs run DLite always
            c = choose(idx, n, self.cal, lookup=lk, min_reach=self.min_reach)
        else:
            prop = self.dlite.propose(req, return_confidence=True)
            c = choose(idx, n, self.cal, prop.tokens[0].tolist(), prop.confidence[0].tolist(),
                       lookup=lk, min_reach=self.min_reach, log=log)
        if log is not None:
            log.update(source=c.source, tokens=c.tokens, score=c.score, split=c.split)
            self.round_log.append(log)
        return _proposal(c.tokens, c.source, c.score)


# ---------------------------------------------------------------------------- token trees
class TreeEngineDrafter:
    """One token tree per round from the suffix lookup (``lookup=True``) and / or DLite (``dlite``):
    ``suffix-tree`` is the lookup alone, ``dlite-tree`` DLite alone, ``hybrid-tree`` both.
    ``num_drafts``: the tree's nodes, the root not counted (a round verifies num_drafts + 1 rows);
    ``branches``: the children each source offers a node (the budget decides how many are kept);
    ``branching``: DLite's branches at every node (``head``: ``HeadBranches``) or along its greedy
    chain only (``chain``: ``ChainBranches``, what the sglang worker drafts); ``corpus``: a
    ``corpus.SharedCorpus`` (off: None) whose earlier requests branch the lookup's nodes too, fed by
    ``finish_request`` (the reference engine calls it after each speculative ``generate``)."""

    drafts_trees = True  # its proposals carry a DraftTree (OnlineDrafter's tree gate reads this)

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
        self.dlite, self.lookup, self.branching, self.corpus = dlite, lookup, branching, corpus
        self.num_drafts, self.branches, self.max_match, self.max_depth = int(num_drafts), int(branches), max_match, max_depth
        self.cal = calibration or default_calibration()
        self.block_size = dlite.num_drafts if dlite is not None else 0
        self.capture_layer_ids = dlite.capture_layer_ids if dlite is not None else [0]
        self.hidden_rows_needed = dlite.hidden_rows_needed if dlite is not None else 1

    def memory_bytes(self, state: dict) -> int:
        idx = state.get("suffix_index")
        return 0 if idx is None else idx.memory_bytes()

    def _dlite_branches(self, req: DraftRequest):
        """This round's DLite branch source (None without DLite)."""
        if self.dlite is None:
            return None
        with torch.no_grad():
            if self.branching == "chain":
                prop = self.dlite.propose(req, num_drafts=self.block_size, top_k=self.branches)
                return ChainBranches(prop.top_tokens[0].tolist(), prop.top_probs[0].tolist())
            return HeadBranches(self.dlite.model, self.dlite.backbone(req), self.branches, self.block_size)

    def finish_request(self, state: dict, tokens: list) -> None:
        """A request ended with ``tokens`` (prompt + output): the corpus (if on) takes them."""
        if self.corpus is not None:
            self.corpus.add(tokens)

    def draft(self, req: DraftRequest) -> DraftProposal:
        index = session_index(req, self.max_match) if self.lookup else None
        if self.corpus is not None:
            index = self.corpus.view(index, cursor=req.state.setdefault("corpus_cursor", {}))
        dlite = self._dlite_branches(req)
        tree, reach, source = grow_round_tree(req.tokens[-1], index, dlite, self.cal, self.branches,
                                              self.num_drafts, self.max_depth)
        tokens = torch.tensor([tree.drafts], dtype=torch.int64).view(1, len(tree) - 1)
        return DraftProposal(tokens, None, source=source, score=expected_accepted_tree(reach), tree=tree)


# ---------------------------------------------------------------------------- online learning
class OnlineDrafter:
    """An engine drafter (DLite, or hybrid over the learner's working model) that learns online:
    ``draft`` as the inner drafter, ``observe`` feeds the verify result to the learner.

    The tree gate (``tree_gate`` rounds, token-tree drafters): once the working copy has been updated,
    every round grows two trees, one from the adapted copy and one from the shipped drafter, and
    verifies the one the gate picks: the adapted tree while, over the last ``tree_gate`` rounds, it
    would have accepted more drafts than the shipped one more often than fewer. The tree not verified
    is judged against what the round committed (``DraftTree.accepted_along``): exact for greedy rounds
    where it accepts no more than the verified tree, and "more" where it held every committed token;
    so each round says which tree was better, tied, or worse. Learning from a tree that agrees with the
    suffix lookup more often can narrow the hybrid's tree (issue 47): the gate keeps the shipped tree
    wherever that costs acceptance. Verification is unchanged: lossless either way."""

    def __init__(self, inner, learner: OnlineLearner):
        self.inner, self.learner = inner, learner
        self.num_drafts = inner.num_drafts
        self.capture_layer_ids = inner.capture_layer_ids
        self.hidden_rows_needed = inner.hidden_rows_needed
        learner.drafts_are_model = isinstance(inner, DLiteEngineDrafter) and inner.model is learner.model
        self.shadow = self._shipped_tree_drafter(inner, learner)
        learner.watch_paths = self.shadow is None
        self._rows = DLiteEngineDrafter(learner.model)  # its context_inputs: the rows the drafter read
        self._gate = None  # this round's (adapted tree, shipped tree, the adapted one verified?)
        self._pending = None  # (context, valid, anchor) of the round being verified

    @staticmethod
    def _shipped_tree_drafter(inner, learner: OnlineLearner):
        """The inner tree drafter over the shipped DLite (the gate's other tree), or None: no gate."""
        dlite = getattr(inner, "dlite", None)
        if not learner.cfg.tree_gate or not getattr(inner, "drafts_trees", False) or dlite is None:
            return None
        shadow = copy.copy(inner)
        shadow.dlite = DLiteEngineDrafter(learner.shipped)
        return shadow

    def draft(self, req: DraftRequest) -> DraftProposal:
        st = self.learner.state_for(req.state)
        learn = self.shadow is None or self.learner.learns_tree_round(st)  # the back-off (tree rounds)
        self.learner.activate(st)  # the session's weights in; its inputs kept unless backed off
        self._pending = None
        if learn:
            ctx, valid, _, _ = self._rows.context_inputs(req)
            self._pending = (ctx[0].detach().clone(), valid[0].clone(), int(req.tokens[-1]))
        self._gate = None
        if self.shadow is None or not st.adapted:
            return self.inner.draft(req)
        adapted = self.inner.draft(req)
        t0 = time.perf_counter()
        shipped = self.shadow.draft(req)
        self.learner.stats["shadow_ms"] += (time.perf_counter() - t0) * 1e3
        use = self.learner.gate_choice(st)
        self._gate = (adapted.tree, shipped.tree, use)
        return adapted if use else shipped

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
