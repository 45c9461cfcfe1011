"""The reference engine's online drafter (issue 47): an engine drafter (DLite, or hybrid over the
learner's working model) that learns from every verify result through ``online.OnlineLearner``, with
the tree gate and the learning back-off for token-tree drafters (``OnlineConfig.tree_gate``,
``backoff``). The sglang worker's side of the same rules: ``sglang_plugin/online_serving.py``."""

from __future__ import annotations

import copy
import time
from typing import Optional

import torch

from .drafters import DLiteEngineDrafter, DraftRequest
from .online import STATE_KEY, OnlineLearner
from .proposal import DraftProposal


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
        self._gate = None  # this round's (adapted tree, shipped tree, the adapted one verified?)

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
        st = self.learner.state_for(req)
        learn = self.shadow is None or self.learner.learns_tree_round(st)  # the back-off (tree rounds)
        self.learner.before_draft(req, learn=learn)
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
        rounds may leave it out, the bonus is then the target's argmax at the last row)."""
        self.learner.observe(req, drafts, target_logits, accepted, path=path)
        if self._gate is None or not path:
            return
        adapted, shipped, use = self._gate
        self._gate = None
        seq = list(committed) if committed is not None else list(drafts) + [int(target_logits[-1].argmax())]
        self.learner.judge_tree(self.learner.state_for(req), use, shipped if use else adapted, seq, accepted)

    def memory_bytes(self, state: dict) -> int:
        inner = getattr(self.inner, "memory_bytes", None)
        st = state.get(STATE_KEY)
        own = 0 if st is None else sum(p.nbytes() for p in st.buffer)
        return (inner(state) if inner else 0) + own

    def stats(self) -> dict:
        return self.learner.summary()
