"""Tree drafting for the reference engine: ``suffix-tree``, ``dlite-tree`` and ``hybrid-tree``.

Each round grows one token tree (``drafting.tree.grow_tree``: best-first by the chance each
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

from typing import Optional

import torch

from sglang_dlite.drafting.tree import grow_tree
from sglang_dlite.drafting.chooser import Calibration

DEFAULT_TREE_NODES = 24  # drafts per tree round (the root not counted)
SERVED_TREE_NODES = 15  # drafts per tree round of ``--drafter hybrid``: the DLITE worker's rows (W = 16) less the root
DEFAULT_BRANCHES = 4  # children asked of each source per node
BRANCHINGS = ("head", "chain")  # where DLite branches: every node (head steps) or its greedy chain


class _Node:
    """A tree node's drafting state: its token, its block position (depth), DLite's head state
    after its parent (None past K, off DLite's reach or without DLite), the lookup's match after its
    token (None without the lookup), and which source proposed it."""

    __slots__ = ("token", "depth", "head", "match", "source")

    def __init__(self, token: int, depth: int, head, match, source: str):
        self.token, self.depth, self.head, self.match, self.source = token, depth, head, match, source


class HeadBranches:
    """DLite's children of any node: one step of the token-fed head from the node's own state and one
    vocabulary projection per expanded node (``DLiteDrafter.head_branch``), the backbone outputs
    ``z`` [1, K+1, H] computed once per round. Exact top-k at every node; a model call per node."""

    def __init__(self, model, z: torch.Tensor, branches: int, block_size: int):
        self.model, self.z, self.branches, self.block_size = model, z, branches, block_size

    def root_head(self):
        return torch.zeros(1, self.model.config.rnn_rank, device=self.z.device)

    def children(self, node: _Node):
        """(top tokens, their probabilities, the head state every child continues from)."""
        prev = torch.tensor([node.token], device=self.z.device)
        state, toks, probs = self.model.head_branch(self.z, node.head, node.depth, prev, self.branches)
        head = state if node.depth + 1 < self.block_size else None
        return toks[0].tolist(), probs[0].tolist(), lambda token: head


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
