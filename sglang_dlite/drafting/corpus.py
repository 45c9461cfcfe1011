"""An optional cross-request corpus: earlier requests' tokens as an extra source of tree branches.

SuffixDecoding keeps a global suffix tree of earlier outputs and sglang's NGRAM a corpus of earlier
requests: agent fleets re-read the same files, tools and prompts across sessions, and a model's
outputs repeat across requests. ``SharedCorpus`` holds earlier requests' token sequences (prompt +
output), per tenant key (None: the default tenant), within a total token budget; ``CorpusView``
puts it beside one request's own ``SuffixIndex`` with the protocol tree drafting reads
(``match`` / ``walk`` / ``continuations``, ``tree_drafters._Round``). Off by default everywhere:
the reference engine's ``hybrid@corpus=TOKENS`` / ``suffix-tree@corpus=TOKENS`` (``registry.py``)
and the DLITE worker's ``corpus_tokens`` setting (``batch.BatchLookup``).

Storage: segments, each one ``SuffixIndex`` over the documents of one tenant joined by unique
negative separators (no match crosses a document; a separator is never proposed). New documents go
into the tenant's newest segment until it holds ``max_tokens / segments`` tokens; when the corpus
holds more than ``max_tokens`` the oldest segment goes (its documents, the oldest, all at once): no
index is ever rebuilt or edited, memory stays within the budget (+ one document). A document that
continues an earlier one of its tenant (a multi-turn conversation's next request, a retracted
request's rest) adds only its new tail, after the last ``max_match`` tokens of the earlier one as
context; a document identical to one held (or to a held one's earlier part) adds nothing (documents
are found by a rolling hash of each prefix).

Matching: the corpus follows the request's own tokens -- per segment, the longest suffix of the
request's tokens (at most ``max_match``) that occurs in it (``walk`` from the previous round's
match: O(1) per new token; O(max_match) after the segment changed). A node's corpus continuations
are those of the segments with the longest match (counts summed), from matches of at least
``min_match`` tokens (shorter ones back off to nothing: in a large corpus they say little).
Ranking: the request's own continuations first (exactly what the index alone gives), then the
corpus's tokens that differ, as ``LookupStep(..., corpus=True)`` (``contested`` where the request's
own tokens continue otherwise): ``Calibration.p_lookup`` scores them with its corpus rule
(``chooser.py``).

Pure python; imports neither torch nor sglang.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence

from sglang_dlite.errors import DLiteInputError
from sglang_dlite.drafting.suffix import DEFAULT_MAX_MATCH, LookupStep, SuffixIndex

DEFAULT_SEGMENTS = 4  # the budget in this many segments: eviction drops a quarter of it, the oldest
DEFAULT_MIN_MATCH = 4  # corpus continuations only after a match of at least this many tokens
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003


class _Segment:
    """One tenant's documents in one suffix index; ``keys``: the prefix keys held here."""

    __slots__ = ("serial", "tenant", "index", "version", "keys", "documents")

    def __init__(self, serial: int, tenant, max_match: int):
        self.serial, self.tenant = serial, tenant
        self.index = SuffixIndex(max_match=max_match)
        self.version = 0  # bumped on each document: a match into it may have moved (state splits)
        self.keys: list = []
        self.documents = 0


class SharedCorpus:
    """Earlier requests' tokens per tenant within ``max_tokens`` (documents + separators)."""

    def __init__(self, max_tokens: int, segments: int = DEFAULT_SEGMENTS, max_match: int = DEFAULT_MAX_MATCH,
                 min_match: int = DEFAULT_MIN_MATCH):
        if int(max_tokens) < 1 or int(segments) < 1 or int(min_match) < 1:
            raise DLiteInputError(f"a shared corpus needs max_tokens >= 1, segments >= 1 and min_match >= 1 (got "
                                  f"{max_tokens}, {segments}, {min_match}).")
        self.max_tokens, self.max_match, self.min_match = int(max_tokens), int(max_match), int(min_match)
        self.segment_tokens = max(1, self.max_tokens // int(segments))
        self.segments: List[_Segment] = []  # oldest first
        self._active: Dict[object, _Segment] = {}  # tenant -> the segment new documents go to
        self._docs: Dict[object, dict] = {}  # tenant -> {(length, prefix hash): the segment holding it}
        self._serial = itertools.count(1)
        self._sep = itertools.count(1)
        self.stats = {"documents": 0, "tokens_added": 0, "duplicates": 0, "continued": 0, "evicted_segments": 0}

    # ------------------------------------------------------------------ size
    @property
    def num_tokens(self) -> int:
        return sum(len(s.index) for s in self.segments)

    def memory_bytes(self) -> int:
        """A rough estimate (``SuffixIndex.memory_bytes`` of every segment; tracemalloc read ~2x it)."""
        return sum(s.index.memory_bytes() for s in self.segments)

    def tenant_segments(self, tenant=None) -> List[_Segment]:
        return [s for s in self.segments if s.tenant == tenant]

    # ------------------------------------------------------------------ adding
    def add(self, tokens: Sequence[int], tenant=None) -> int:
        """One finished request's tokens. Returns how many tokens the corpus took (0: it held them)."""
        toks = [int(t) for t in tokens]
        if not toks:
            return 0
        docs = self._docs.setdefault(tenant, {})
        h, prefix_len, hashes = 0, 0, []
        for i, t in enumerate(toks):  # the longest held document this one continues
            h = (h * _HASH_BASE + t + 1) % _HASH_MOD
            hashes.append(h)
            if (i + 1, h) in docs:
                prefix_len = i + 1
        if prefix_len == len(toks):
            self.stats["duplicates"] += 1
            return 0
        if prefix_len:  # (the earlier one's key stays: held while its segment is)
            self.stats["continued"] += 1
            toks = toks[max(0, prefix_len - self.max_match):]
        keep = self.segment_tokens - 1  # one segment's worth (+ its separator), the newest tokens
        if len(toks) > keep:
            toks = toks[len(toks) - keep:]
        seg = self._active.get(tenant)
        if seg is None or seg not in self.segments or len(seg.index) + len(toks) + 1 > self.segment_tokens:
            seg = self._active[tenant] = _Segment(next(self._serial), tenant, self.max_match)
            self.segments.append(seg)
        seg.index.extend(toks)
        seg.index.append(-next(self._sep))  # the document's end: unique, so no match crosses it
        seg.version += 1
        seg.documents += 1
        key = (len(hashes), hashes[-1])
        docs[key] = seg
        seg.keys.append(key)
        self.stats["documents"] += 1
        self.stats["tokens_added"] += len(toks)
        self._evict()
        return len(toks)

    def _evict(self) -> None:
        total = self.num_tokens
        while total > self.max_tokens and self.segments:
            seg = self.segments.pop(0)
            total -= len(seg.index)
            docs = self._docs.get(seg.tenant, {})
            for k in seg.keys:
                if docs.get(k) is seg:
                    del docs[k]
            if not docs:
                self._docs.pop(seg.tenant, None)
            if self._active.get(seg.tenant) is seg:
                del self._active[seg.tenant]
            self.stats["evicted_segments"] += 1

    # ------------------------------------------------------------------ matching
    def view(self, own: SuffixIndex, tenant=None, cursor: Optional[dict] = None) -> "CorpusView":
        """The request's index ``own`` with this corpus's continuations beside it. ``cursor``: a dict
        the caller keeps per request (its matches, advanced incrementally round to round)."""
        return CorpusView(self, own, tenant, {} if cursor is None else cursor)

    def _advance(self, seg: _Segment, toks: list, cur) -> list:
        """The segment's match of the request's tokens ``toks``: [version, tokens seen, v, m]."""
        n = len(toks)
        if cur is None or cur[0] != seg.version or cur[1] > n or n - cur[1] > self.max_match:
            start, v, m = max(0, n - self.max_match), 0, 0  # the cap makes the last max_match tokens enough
        else:
            _, start, v, m = cur
        walk = seg.index.walk
        for t in toks[start:n]:
            v, m = walk(v, m, t)
        return [seg.version, n, v, m]


class CorpusView:
    """One request's ``SuffixIndex`` + the corpus: the tree-drafting protocol over match pairs
    (the own index's (v, m), a tuple of each segment's (v, m)). Index upkeep (``extend``,
    ``append``, ``tokens``) goes to the own index: a view can stand where the index stands."""

    def __init__(self, corpus: SharedCorpus, own: SuffixIndex, tenant, cursor: dict):
        self.corpus, self.own = corpus, own
        self.segs = corpus.tenant_segments(tenant)
        self.cursor = cursor
        if cursor.get("ref") is not own.tokens:  # another token list (a rebuilt index): start over
            cursor.clear()
            cursor["ref"] = own.tokens
        self.offered = 0  # corpus branches offered this view (a diagnostic)

    # upkeep: the own index
    @property
    def tokens(self) -> list:
        return self.own.tokens

    def __len__(self) -> int:
        return len(self.own)

    def extend(self, tokens: Sequence[int]) -> None:
        self.own.extend(tokens)

    def append(self, c: int) -> None:
        self.own.append(c)

    def memory_bytes(self) -> int:
        return self.own.memory_bytes()

    def propose(self, k: int, start=None, min_match: int = 1):
        """The own index's chain (the corpus branches trees only)."""
        return self.own.propose(k, None if start is None else start[0], min_match)

    # tree drafting
    def match(self):
        mats = self.cursor.setdefault("segs", {})
        toks = self.own.tokens
        corp = []
        for seg in self.segs:
            cur = mats[seg.serial] = self.corpus._advance(seg, toks, mats.get(seg.serial))
            corp.append((cur[2], cur[3]))
        for serial in [s for s in mats if s not in {g.serial for g in self.segs}]:
            del mats[serial]  # evicted segments
        return self.own.match(), tuple(corp)

    def walk(self, own_match, corp_match, c: int):
        return self.own.walk(*own_match, c), self._walk_corpus(corp_match, c)

    def _walk_corpus(self, corp_match, c: int):
        return tuple(seg.index.walk(v, m, c) for seg, (v, m) in zip(self.segs, corp_match))

    def continuations(self, own_match, corp_match, k: int, min_match: int = 1):
        """The own index's continuations (as ``SuffixIndex.continuations``), then up to ``k`` of
        the corpus's that differ, most frequent first: ``[(LookupStep, the match pair after it)]``."""
        out = [(step, (nxt, self._walk_corpus(corp_match, step.token)))
               for step, nxt in self.own.continuations(*own_match, k, min_match)]
        seen = {step.token for step, _ in out}
        merged, total, best_m = {}, 0, 0
        for seg, (v, m) in zip(self.segs, corp_match):
            if m < self.corpus.min_match:
                continue
            conts = seg.index.continuations(v, m, k + len(seen) + 1, self.corpus.min_match)
            if not conts or conts[0][0].match_len < best_m:
                continue
            if conts[0][0].match_len > best_m:  # a longer context wins: drop shorter segments' counts
                merged, total, best_m = {}, 0, conts[0][0].match_len
            total += conts[0][0].total
            for s, _ in conts:
                if s.token >= 0 and s.token not in seen:  # separators are never proposed
                    merged[s.token] = merged.get(s.token, 0) + s.count
        ranked = sorted(merged.items(), key=lambda kv: -kv[1])[:k]
        for tok, cnt in ranked:
            step = LookupStep(tok, cnt, total, best_m, corpus=True, contested=bool(seen))
            out.append((step, self.walk(own_match, corp_match, tok)))
        self.offered += len(ranked)
        return out
