"""Tree drafting for the reference engine: ``suffix-tree``, ``dlite-tree`` and ``hybrid-tree``.

Each round grows one token tree (``speculation.tree.grow_tree``: best-first by the chance each
node is reached, within ``num_drafts`` nodes) whose nodes' children come from two sources:

- the suffix lookup: the most frequent continuations of the node's match
  (``SuffixIndex.continuations``, ranked by occurrence counts: a branch wherever the earlier
  continuations split), each scored by the calibrated lookup table (``Calibration.p_lookup``);
- DLite: the top-k tokens of its low-rank head at the node's block position
  (``DLiteDrafter.head_branch``: one head step + one vocabulary projection per expanded node, the
  backbone run once per round), each scored by the calibrated DLite table (its softmax probability,
  agreement with the lookup's first suggestion) for the head's first choice and by
  ``min(probability, table)`` for the others.

A token both sources propose is one child with the better score. A node keeps both states: the
head state while its depth is below DLite's K, and the lookup's match after its token (a DLite
prefix is continued by the lookup: the "mixed" chains of ``chooser.py`` as branches of one tree).
The drafts are deterministic, so sampled requests verify them by recursive rejection with one-hot
q (``speculation.tree``): lossless at any temperature.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..drafters import DLiteEngineDrafter, DraftRequest
from ..errors import DLiteInputError
from ..proposal import DraftProposal
from ..speculation.tree import expected_accepted_tree, grow_tree
from .chooser import Calibration, default_calibration
from .drafters import session_index
from .suffix import DEFAULT_MAX_MATCH, SuffixIndex

DEFAULT_TREE_NODES = 24  # drafts per tree round (the root not counted)
DEFAULT_BRANCHES = 4  # children asked of each source per node


class _Node:
    """A tree node's drafting state: its token, its block position (depth), DLite's head state
    after its parent (None past K or without DLite), the lookup's match after its token (None
    without the lookup), and which source proposed it."""

    __slots__ = ("token", "depth", "head", "match", "source")

    def __init__(self, token: int, depth: int, head, match, source: str):
        self.token, self.depth, self.head, self.match, self.source = token, depth, head, match, source


class _Round:
    """One round's expansion (``grow_tree``'s ``expand``) over the suffix index and / or DLite's
    backbone outputs ``z`` [1, K+1, H]."""

    def __init__(self, index: Optional[SuffixIndex], z: Optional[torch.Tensor], drafter: "TreeEngineDrafter"):
        self.index, self.z, self.d = index, z, drafter
        self.sources = set()  # who proposed the kept drafts: the round's source

    def root(self, anchor: int) -> _Node:
        state = None if self.z is None else torch.zeros(1, self.d.dlite.model.config.rnn_rank, device=self.z.device)
        return _Node(anchor, 0, state, None if self.index is None else self.index.match(), "")

    def _dlite(self, node: _Node):
        """(DLite's head state after the node, its top tokens, their probabilities)."""
        if node.head is None:
            return None, [], []
        prev = torch.tensor([node.token], device=self.z.device)
        state, toks, probs = self.d.dlite.model.head_branch(self.z, node.head, node.depth, prev, self.d.branches)
        return state, toks[0].tolist(), probs[0].tolist()

    def expand(self, node: _Node):
        """The node's children: ``[(token, P(accepted | node reached), child node)]``."""
        if node.source:
            self.sources.add(node.source)
        cal, d = self.d.cal, node.depth + 1
        looked = [] if node.match is None else self.index.continuations(*node.match, self.d.branches)
        state, toks, qs = self._dlite(node)
        head = state if d < self.d.block_size else None
        kids = {step.token: [cal.p_lookup(step), _Node(step.token, d, head, match, "suffix")] for step, match in looked}
        first = looked[0][0].token if looked else None
        for rank, (t, q) in enumerate(zip(toks, qs)):
            p = cal.p_dlite(q, 0 if first is None else (2 if first == t else 1))
            p = p if rank == 0 else min(q, p)
            if t in kids:
                kids[t][0] = max(kids[t][0], p)
                kids[t][1].source = "mixed"
            else:  # the lookup continues DLite's token from the node's match (a mixed branch)
                match = None if node.match is None else self.index.walk(*node.match, t)
                kids[t] = [p, _Node(t, d, head, match, "dlite")]
        return [(t, p, child) for t, (p, child) in kids.items()]


class TreeEngineDrafter:
    """One token tree per round from the suffix lookup (``lookup=True``) and / or DLite (``dlite``):
    ``suffix-tree`` is the lookup alone, ``dlite-tree`` DLite alone, ``hybrid-tree`` both.
    ``num_drafts``: the tree's nodes, the root not counted (a round verifies num_drafts + 1 rows);
    ``branches``: the children each source offers a node (the budget decides how many are kept)."""

    def __init__(self, dlite: Optional[DLiteEngineDrafter] = None, lookup: bool = True,
                 num_drafts: int = DEFAULT_TREE_NODES, branches: int = DEFAULT_BRANCHES,
                 max_match: int = DEFAULT_MAX_MATCH, calibration: Optional[Calibration] = None,
                 max_depth: Optional[int] = None):
        if dlite is None and not lookup:
            raise DLiteInputError("a tree drafter needs DLite, the suffix lookup, or both.")
        if num_drafts < 1 or branches < 1:
            raise DLiteInputError(f"a draft tree needs num_drafts >= 1 and branches >= 1 (got {num_drafts}, "
                                  f"{branches}).")
        self.dlite, self.lookup = dlite, lookup
        self.num_drafts, self.branches, self.max_match, self.max_depth = int(num_drafts), int(branches), max_match, max_depth
        self.cal = calibration or default_calibration()
        self.block_size = dlite.num_drafts if dlite is not None else 0
        self.capture_layer_ids = dlite.capture_layer_ids if dlite is not None else [0]
        self.hidden_rows_needed = dlite.hidden_rows_needed if dlite is not None else 1

    def memory_bytes(self, state: dict) -> int:
        idx = state.get("suffix_index")
        return 0 if idx is None else idx.memory_bytes()

    def _backbone(self, req: DraftRequest) -> Optional[torch.Tensor]:
        if self.dlite is None:
            return None
        ctx, valid, history, offset = self.dlite.context_inputs(req)
        anchor = torch.tensor([req.tokens[-1]], device=req.hidden.device)
        with torch.no_grad():
            return self.dlite.model.backbone(ctx, valid, anchor, history, offset)

    def draft(self, req: DraftRequest) -> DraftProposal:
        index = session_index(req, self.max_match) if self.lookup else None
        rnd = _Round(index, self._backbone(req), self)
        tree, reach = grow_tree(req.tokens[-1], rnd.root(req.tokens[-1]), rnd.expand, self.num_drafts,
                                self.max_depth)
        kinds = rnd.sources
        source = "none" if len(tree) == 1 else (next(iter(kinds)) if len(kinds) == 1 else "mixed")
        tokens = torch.tensor([tree.drafts], dtype=torch.int64).view(1, len(tree) - 1)
        return DraftProposal(tokens, None, source=source, score=expected_accepted_tree(reach), tree=tree)
