"""An incremental suffix index over one request's tokens (SuffixDecoding-style lookup drafting).

A suffix automaton (SAM) over the committed tokens, extended one token at a time (amortized O(1)
states/transitions per token, never rebuilt), with per-state occurrence counts |endpos| kept for
the states a lookup can reach: those whose shortest string is at most ``max_match + 1`` tokens.
The count update walks the suffix-link path from the state of the newest (max_match + 1)-token
suffix to the root: the lengths on it strictly decrease, so it is at most max_match + 2 states
(in natural text a handful), whatever the context length.

Each of those states also keeps its most frequent continuation and the number of its earlier
occurrences that have one, updated on the same walk one token earlier (the states whose
transition on the new token gained an occurrence are exactly the previous suffix path).

``propose(K)`` matches the longest suffix of the committed tokens (up to ``max_match`` tokens)
that occurred earlier, then walks the automaton K steps along the most frequent continuation
(count(match + chain + c) out of every earlier continuation of (match + chain)), backing off to
a shorter suffix (the suffix link) where the walk runs out of continuations. Each step is O(1)
(the best continuation is stored), the match O(max_match): a round costs O(match + K) and does
not grow with the context. The raw frequencies are turned into acceptance
probabilities by a calibration table fitted on training data (``chooser.py``).

Pure python; imports neither torch nor sglang.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import List, Sequence

DEFAULT_MAX_MATCH = 64


@dataclass
class LookupStep:
    token: int
    count: int  # earlier occurrences of (context suffix + chain + token)
    total: int  # earlier occurrences of (context suffix + chain) that have a continuation
    match_len: int  # length of the matched suffix this step continues
    corpus: bool = False  # from the cross-request corpus (corpus.py), not the request's own tokens
    contested: bool = False  # a corpus step where the request's own tokens continue otherwise


@dataclass
class LookupDraft:
    steps: List[LookupStep] = field(default_factory=list)

    @property
    def tokens(self) -> List[int]:
        return [s.token for s in self.steps]

    def __len__(self):
        return len(self.steps)


class SuffixIndex:
    """Suffix automaton with capped occurrence counts over a growing token sequence."""

    __slots__ = ("max_match", "nxt", "link", "length", "cnt", "best", "btok", "total", "last", "x", "xlen",
                 "tokens")

    def __init__(self, tokens: Sequence[int] = (), max_match: int = DEFAULT_MAX_MATCH):
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1 (got {max_match}).")
        self.max_match = int(max_match)
        self.nxt: List[dict] = [{}]
        self.link: List[int] = [-1]
        self.length: List[int] = [0]
        self.cnt: List[int] = [0]
        self.best: List[int] = [-1]  # most frequent continuation: child state
        self.btok: List[int] = [-1]  # ... and its token
        self.total: List[int] = [0]  # earlier occurrences that have a continuation
        self.last = 0
        self.x = 0  # state of the newest min(n, max_match + 1)-token suffix
        self.xlen = 0
        self.tokens: List[int] = []
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_states(self) -> int:
        return len(self.length)

    def memory_bytes(self) -> int:
        """A rough estimate of the python objects held (for reports, not an exact sizeof)."""
        ntrans = sum(len(d) for d in self.nxt)
        return 8 * len(self.tokens) + 7 * 8 * self.num_states + 64 * self.num_states + 40 * ntrans

    # ------------------------------------------------------------------ building
    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(int(t))

    def append(self, c: int) -> None:
        nxt, link, length, cnt = self.nxt, self.link, self.length, self.cnt
        best, btok, total = self.best, self.btok, self.total
        old_x, old_xlen = self.x, self.xlen
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        cnt.append(0)
        best.append(-1)
        btok.append(-1)
        total.append(0)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                cnt.append(cnt[q])  # endpos(clone) = endpos(q) before this token
                best.append(best[q])
                btok.append(btok[q])
                total.append(total[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    if best[p] == q:
                        best[p] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
        self.tokens.append(c)
        # The state of the newest min(n, max_match + 1)-token suffix: one transition, at most
        # one suffix-link step (its shortest string is <= xlen + 1 tokens long).
        y = nxt[self.x][c]
        ylen = self.xlen + 1
        cap = self.max_match + 1
        if ylen > cap:
            ylen = cap
            if length[link[y]] >= cap:
                y = link[y]
        self.x, self.xlen = y, ylen
        # The new end position joins endpos of y and of every state above it.
        while y > 0:
            cnt[y] += 1
            y = link[y]
        # The states of the previous suffixes (<= max_match + 1 tokens) gained a continuation
        # (this token): their totals and, where it overtook, their best continuation.
        p = old_x
        if p > 0 and length[link[p]] >= old_xlen:  # the suffix moved into a clone
            p = link[p]
        while p != -1:
            total[p] += 1
            w = nxt[p][c]
            b = best[p]
            if b < 0 or cnt[w] > cnt[b]:
                best[p], btok[p] = w, c
            p = link[p]

    def sync(self, tokens: Sequence[int]) -> bool:
        """Make the index cover exactly ``tokens``: extends it when its tokens are a prefix
        (incremental), rebuilds it otherwise. Returns True when it had to rebuild."""
        n = len(self.tokens)
        if len(tokens) >= n and (n == 0 or (tokens[n - 1] == self.tokens[-1] and list(tokens[:n]) == self.tokens)):
            self.extend(tokens[n:])
            return False
        self.__init__(tokens, self.max_match)
        return True

    # ------------------------------------------------------------------ lookup
    def match(self):
        """(state, length) of the longest suffix of the tokens, at most max_match long, that also
        ends at an earlier position; (0, 0) when none does."""
        v, m = self.x, self.xlen
        link, length, cnt = self.link, self.length, self.cnt
        if m > self.max_match:
            m = self.max_match
            if length[link[v]] >= m:
                v = link[v]
        while v > 0 and cnt[v] < 2:
            v = link[v]
            m = length[v]
        return (v, m) if v > 0 else (0, 0)

    def _best(self, v: int):
        """Most frequent continuation of state v: (token, child, count, total) or None. O(1)."""
        w = self.best[v]
        if w < 0:
            return None
        return self.btok[v], w, self.cnt[w], self.total[v]

    def walk(self, v: int, m: int, c: int):
        """Continue a match (state v, length m) with token c: the longest suffix of
        (matched string + c) present in the index, capped at max_match. (0, 0) if none."""
        nxt, link, length = self.nxt, self.link, self.length
        while v > 0 and c not in nxt[v]:
            v = link[v]
            m = length[v]
        if c not in nxt[v]:
            return 0, 0
        w, m = nxt[v][c], m + 1
        if m > self.max_match:
            m = self.max_match
            if length[link[w]] >= m:
                w = link[w]
        return w, m

    def continuations(self, v: int, m: int, k: int, min_match: int = 1):
        """The ``k`` most frequent continuations of a match (state v, length m), backing off to a
        shorter suffix (as ``propose``) where it has none: ``[(LookupStep, the match after the
        step's token)]``, most frequent first; [] when no suffix of at least ``min_match`` tokens
        continues. The branches of a lookup tree (``tree_drafters.py``)."""
        link, length, cnt, total = self.link, self.length, self.cnt, self.total
        while v > 0 and m >= min_match and total[v] == 0:
            v = link[v]
            m = length[v]
        if v <= 0 or m < min_match or k < 1:
            return []
        kids = heapq.nlargest(k, self.nxt[v].items(), key=lambda kv: cnt[kv[1]])
        out = []
        for c, w in kids:
            step = LookupStep(c, cnt[w], total[v], m)
            n = m + 1
            if n > self.max_match:
                n = self.max_match
                if length[link[w]] >= n:
                    w = link[w]
            out.append((step, (w, n)))
        return out

    def propose(self, k: int, start=None, min_match: int = 1) -> LookupDraft:
        """Up to k tokens along the most frequent continuation (see the module docstring).
        ``start``: a (state, length) match to continue from (default: ``match()``)."""
        v, m = self.match() if start is None else start
        out = LookupDraft()
        link, length = self.link, self.length
        while len(out.steps) < k and m >= min_match and v > 0:
            b = self._best(v)
            while b is None or b[3] == 0:  # no earlier continuation here: back off
                v = link[v]
                m = length[v]
                if v <= 0 or m < min_match:
                    return out
                b = self._best(v)
            c, w, n, total = b
            out.steps.append(LookupStep(c, n, total, m))
            v, m = w, m + 1
            if m > self.max_match:
                m = self.max_match
                if length[link[v]] >= m:
                    v = link[v]
        return out
