"""Token trees: one verify pass over several continuations, and what a tree round accepts.

A ``DraftTree`` is a list of nodes in topological order: node 0 is the root (the anchor, the last
committed token), every other node a draft token whose parent comes before it. A chain is the
tree with one child per node. One target forward verifies the whole tree: node i attends to the
committed prefix and to its own root path (``attention_mask``), at position ``prefix + depth(i)``
(``position_ids``), so its logits are those of a plain forward over the committed tokens + its
root path. Row i of the verify output scores the token after node i.

Acceptance (``accept_tree``):

- greedy: the longest root path whose every token equals the target's argmax at its parent, and
  the bonus token = the target's argmax at the path's last node (``greedy_tree_accept``);
- sampled (the drafts are deterministic, q one-hot per node): recursive rejection over siblings
  (``tree_rejection_sample``): at a node with the target's law p, its children are tried in
  order, child c accepted with probability r(c) where r starts as p and, after each rejected
  child, r <- norm(max(r - onehot(c), 0)); when every child is rejected the token is sampled from
  r. Each committed token then has exactly the target's law (the multi-draft rule of SpecTr /
  sglang's EAGLE trees for one-hot drafts).

``grow_tree`` builds a tree best-first: each candidate node carries the probability that it is
accepted given its parent; the tree keeps the nodes with the highest probability of being reached
(the product along the root path) within a node budget, which maximizes the expected number of
accepted drafts (the sum of the kept nodes' reach) when that number is the only cost.
Pure torch and python: no HF, no sglang.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from sglang_dlite.errors import DLiteInputError


@dataclass(frozen=True)
class DraftTree:
    tokens: Tuple[int, ...]  # node tokens; tokens[0] is the root (the anchor)
    parents: Tuple[int, ...]  # parents[0] == -1; 0 <= parents[i] < i

    def __post_init__(self):
        toks, par = tuple(int(t) for t in self.tokens), tuple(int(p) for p in self.parents)
        object.__setattr__(self, "tokens", toks)
        object.__setattr__(self, "parents", par)
        if not toks or len(toks) != len(par):
            raise DLiteInputError(f"a draft tree needs a root and one parent per node (got {len(toks)} tokens, "
                                  f"{len(par)} parents).")
        if par[0] != -1:
            raise DLiteInputError(f"node 0 is the root (the anchor): its parent must be -1, not {par[0]}.")
        seen = set()
        for i in range(1, len(toks)):
            if not 0 <= par[i] < i:
                raise DLiteInputError(f"node {i}'s parent {par[i]} is not an earlier node: list the nodes in "
                                      "topological order (every parent before its children).")
            if (par[i], toks[i]) in seen:
                raise DLiteInputError(f"node {par[i]} has token {toks[i]} twice among its children: siblings must "
                                      "differ (rejection sampling tries each token once).")
            seen.add((par[i], toks[i]))

    @classmethod
    def chain(cls, anchor: int, drafts: Sequence[int]) -> "DraftTree":
        """The chain [anchor, d_1 .. d_K] as a tree (one child per node)."""
        return cls((anchor, *drafts), tuple(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def drafts(self) -> List[int]:
        """The draft tokens (every node but the root), in node order: what the verify pass reads
        after the anchor."""
        return list(self.tokens[1:])

    @property
    def depths(self) -> List[int]:
        d = [0] * len(self.tokens)
        for i in range(1, len(d)):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, i: int) -> List[int]:
        return [j for j in range(i + 1, len(self.parents)) if self.parents[j] == i]

    def path(self, i: int) -> List[int]:
        """The nodes from the root to node i, both included."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def ancestry(self) -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True when node j is on node i's root path (i included)."""
        n = len(self.tokens)
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[self.parents[i]]
        return anc

    def attention_mask(self, prefix_len: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """The additive 4-D mask [1, 1, N, prefix_len + N] of a verify forward over the tree after
        ``prefix_len`` cached positions: 0 where node i may attend (every prefix position, its root
        path), the dtype's lowest value elsewhere."""
        allowed = torch.cat([torch.ones(len(self.tokens), prefix_len, dtype=torch.bool), self.ancestry()], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None].to(device)

    def position_ids(self, prefix_len: int, device=None) -> torch.Tensor:
        """[1, N]: each node's absolute position, ``prefix_len + depth``."""
        return (prefix_len + torch.tensor(self.depths, dtype=torch.int64))[None].to(device)

    def accepted_along(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a committed continuation of the anchor) this tree holds as a root
        path: the drafts a greedy round over this tree would accept where the target continues with
        ``tokens`` (at most ``len(tokens)``; a round accepting ``a`` drafts commits ``a + 1`` tokens, so
        ``len(tokens)`` here means "at least as many": the tree held the bonus too)."""
        kids = _child_table(self)
        node = n = 0
        for tok in tokens:
            node = next((c for c in kids[node] if self.tokens[c] == int(tok)), None)
            if node is None:
                break
            n += 1
        return n

    def committed(self, path: Sequence[int], bonus: int) -> List[int]:
        """The tokens a round commits: the accepted path's drafts (the root excluded) + the bonus."""
        return [self.tokens[i] for i in path[1:]] + [int(bonus)]


def _child_table(tree: DraftTree) -> List[List[int]]:
    kids: List[List[int]] = [[] for _ in tree.tokens]
    for i in range(1, len(tree.tokens)):
        kids[tree.parents[i]].append(i)
    return kids


def greedy_tree_accept(tree: DraftTree, target_tokens: torch.Tensor) -> Tuple[List[int], int]:
    """``target_tokens [N]``: the target's argmax at each node. Returns (the accepted root path as
    node indices, the root included; the bonus token = the target's argmax at its last node)."""
    if target_tokens.shape[0] != len(tree):
        raise DLiteInputError(f"{target_tokens.shape[0]} verify rows for a tree of {len(tree)} nodes.")
    want = [int(t) for t in target_tokens.tolist()]
    kids = _child_table(tree)
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in kids[node] if tree.tokens[c] == want[node]), None)
        if nxt is None:
            return path, want[node]
        path.append(nxt)


def tree_rejection_sample(tree: DraftTree, p: torch.Tensor, generator: Optional[torch.Generator] = None,
                          uniforms: Optional[Iterable[float]] = None) -> Tuple[List[int], int]:
    """Recursive rejection over siblings (module docstring) for deterministic drafts. ``p [N, V]``:
    the target's (filtered) law at each node. ``uniforms``: the coins, in the order they are
    drawn (tests); else drawn from ``generator``. Returns (accepted root path, bonus token)."""
    if p.shape[0] != len(tree):
        raise DLiteInputError(f"{p.shape[0]} verify rows for a tree of {len(tree)} nodes.")
    coins = iter(uniforms) if uniforms is not None else None
    kids = _child_table(tree)
    path = [0]
    while True:
        node = path[-1]
        r = p[node].float()
        moved = False
        for c in kids[node]:
            tok = tree.tokens[c]
            u = next(coins) if coins is not None else float(torch.rand((), generator=generator, device=p.device))
            if u < float(r[tok]):
                path.append(c)
                moved = True
                break
            r = r.clone()
            r[tok] = 0.0
            total = r.sum()
            # r(c) == 1 and still rejected is a measure-zero event: fall back to p itself then
            r = r / total if total > 0 else p[node].float()
        if not moved:
            bonus = torch.multinomial(r, 1, generator=generator)
            return path, int(bonus)


def accept_tree(tree: DraftTree, target_tokens: Optional[torch.Tensor] = None, *, p: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None) -> Tuple[List[int], List[int]]:
    """What one tree round commits: (the accepted root path as node indices, the root included;
    the committed tokens = its drafts + the bonus). Greedy with ``target_tokens [N]``, sampled with
    ``p [N, V]`` (the target's filtered laws)."""
    if p is not None:
        path, bonus = tree_rejection_sample(tree, p, generator)
    elif target_tokens is not None:
        path, bonus = greedy_tree_accept(tree, target_tokens)
    else:
        raise DLiteInputError("accept_tree needs the target's tokens (greedy) or its laws p (sampled).")
    return path, tree.committed(path, bonus)


# An expansion: for one node (its handle), its candidate children as (token, P(accepted | the node
# reached), the child's handle). Handles are the caller's (drafter state); grow_tree only keeps them.
Expand = Callable[[object], Iterable[Tuple[int, float, object]]]


def grow_tree(anchor: int, root: object, expand: Expand, max_nodes: int,
              max_depth: Optional[int] = None) -> Tuple[DraftTree, List[float]]:
    """A tree of at most ``max_nodes`` drafts (the root not counted), best-first by the chance each
    node is reached (the product of its path's acceptance probabilities). ``expand`` is called once
    per kept node (lazily: a node's children are asked for when it joins the tree). Returns (the
    tree, each node's reach; their sum over the drafts is the expected accepted count)."""
    if max_nodes < 0:
        raise DLiteInputError(f"max_nodes must be >= 0 (got {max_nodes}).")
    tokens, parents, reach, depth = [int(anchor)], [-1], [1.0], [0]
    order = itertools.count()
    heap: list = []

    def offer(node: int, handle) -> None:
        if max_depth is not None and depth[node] >= max_depth:
            return
        taken = set()
        for tok, prob, child in expand(handle):
            tok = int(tok)
            if prob > 0 and tok not in taken:
                taken.add(tok)
                heapq.heappush(heap, (-reach[node] * float(prob), next(order), node, tok, child))

    offer(0, root)
    while heap and len(tokens) - 1 < max_nodes:
        neg, _, parent, tok, child = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        reach.append(-neg)
        depth.append(depth[parent] + 1)
        offer(len(tokens) - 1, child)
    return DraftTree(tuple(tokens), tuple(parents)), reach


def expected_accepted_tree(reach: Sequence[float]) -> float:
    """Expected accepted drafts of a tree from its nodes' reach (``grow_tree``): the root excluded."""
    return float(sum(reach[1:]))
