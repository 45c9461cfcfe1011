"""Self-speculative regeneration (``gen-data --engine fast --spec-drafts K``): the batched fast
engine verifies drafts instead of decoding one token per step.

Every step, each active row proposes up to K drafts from a suffix index over its *own* tokens
(``drafting.suffix.SuffixIndex``: prompt + everything generated so far, a SAM extended token by
token), cut where the calibrated probability that a draft is still reached falls below
``min_reach`` (``drafting.chooser``'s table, fitted on training prompts); rows without a
confident match draft nothing and decode one token as before; which drafts a step verifies is
``select_drafts``. The round itself is ``FastRegenerator._step`` (one
``FastLlama.verify`` pass over every row's ``[last token, d_1 .. d_k]``, then ``accept_round``), so
the text is the target's own greedy text whatever the drafts: a draft only decides how many
positions are scored in one pass.

Features (captured layers + final norm) come from the verify pass: the rows of the committed
inputs (the previous last token and the accepted drafts), the same positions a plain step captures.
Everything else (shard format, turns, continuous batching, compaction) is ``FastRegenerator``'s.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from sglang_dlite.drafting.chooser import default_calibration, lookup_only
from sglang_dlite.drafting.suffix import SuffixIndex
from sglang_dlite.drafting.tau import tau
from sglang_dlite.drafting.budget import reaches
from dlite_lab.training.fast_regen import FastRegenerator


# The fixed cost of one step in units of one more verified row (SmolLM2-135M fp32, 1 thread on this
# CPU, contexts ~600). With the C++ KV-cache attention a step of B slots and R verified rows costs
# ~130 + 3.4 B + 2.4 R ms (fitted on B = 16..64, R = B..4B): attention is per slot (each slot's
# cache read once, whatever its rows), so at B = 32 everything but the drafts' rows is ~240 ms, ~100
# rows. Regenerating 32 conversations: 75.2 tok/CPU-s at 24, 78.9 at 60, 80.8 at 100. With chunked
# SDPA attention (padded per chunk, so it grows with the rows) a step cost ~100 + 4.2 B ms: ~24 rows.
FIXED_ROWS = {"kernel": 100.0, "sdpa": 24.0}



def select_drafts(chains: Sequence[Sequence[float]], fixed_rows: Optional[float]) -> List[int]:
    """How many drafts of each request's chain to verify in a round of ragged rows. ``chains[b]``:
    request b's ``reaches`` (decreasing). A round costs about ``fixed_rows + rows`` row-units
    (``fixed_rows``: its fixed cost, e.g. streaming the weights once, in units of one more
    verified row). Draft positions are taken in decreasing reach while each one's expected tokens
    per row-unit (its reach) beats the round's expected tokens per row-unit so far, i.e. the
    prefixes that maximise (B + sum of reaches) / (fixed_rows + B + drafts); ``fixed_rows`` None:
    every draft."""
    if fixed_rows is None:
        return [len(c) for c in chains]
    flat = sorted((-r, b, j) for b, c in enumerate(chains) for j, r in enumerate(c))
    B = len(chains)
    tokens, units, take = float(B), float(fixed_rows + B), [0] * B
    for r, b, j in flat:
        r = -r
        if r * units <= tokens:
            break
        if j == take[b]:  # a chain's positions are taken in order (reach decreases along it)
            take[b] += 1
            tokens += r
            units += 1
    return take


class SpecRegenerator(FastRegenerator):
    """``FastRegenerator`` whose decode step verifies suffix-lookup drafts (see the module doc)."""

    def __init__(self, *args, num_drafts: int = 4, min_reach: float = 0.3, max_match: int = 32,
                 fixed_rows: Union[float, str, None] = "auto", **kw):
        """``fixed_rows``: a step's fixed cost in verified rows ("auto": ``FIXED_ROWS`` of the
        engine's attention path; None or < 0: verify every candidate)."""
        if num_drafts < 1:
            raise ValueError(f"num_drafts must be >= 1 (got {num_drafts}).")
        super().__init__(*args, **kw)
        self.num_drafts, self.min_reach, self.max_match = int(num_drafts), float(min_reach), int(max_match)
        if fixed_rows == "auto":
            fixed_rows = FIXED_ROWS["kernel" if self.engine.kernel_attention else "sdpa"]
        self.fixed_rows = None if fixed_rows is None or fixed_rows < 0 else float(fixed_rows)
        self.cal = default_calibration()
        self._index: dict = {}
        self.stats = {"steps": 0, "rows": 0, "drafted": 0, "accepted": 0, "verified_tokens": 0, "committed": 0}

    def _drafts(self, row) -> list:
        idx = self._index.get(row.key)
        if idx is None:
            idx = self._index[row.key] = SuffixIndex(max_match=self.max_match)
        idx.sync(row.seq)  # committed tokens, the pending last one included
        k = min(self.num_drafts, row.room - row.gen - 1)  # the bonus token takes the last place
        if k <= 0:
            return []
        d, ps, _ = lookup_only(idx, k, self.cal)
        return list(zip(d.tokens, reaches(ps, self.min_reach)))  # [(token, reach)]

    def _select(self, cands) -> list:
        """Which drafts to verify this step: ``cands[b]``, row b's chain [(token, reach)], cut by
        ``select_drafts`` (a step costs about ``fixed_rows + rows`` row-units)."""
        take = select_drafts([[r for _, r in c] for c in cands], self.fixed_rows)
        return [[t for t, _ in c[:n]] for c, n in zip(cands, take)]

    def _propose(self, rows) -> list:
        drafts = self._select([self._drafts(r) for r in rows])
        st = self.stats
        st["steps"] += 1
        st["rows"] += len(rows)
        st["verified_tokens"] += len(rows) + sum(len(d) for d in drafts)
        return drafts

    def _tally(self, drafts: list, accepted: int, pushed: int) -> None:
        st = self.stats
        st["drafted"] += len(drafts)
        st["accepted"] += accepted
        st["committed"] += pushed

    def _finish(self, row):
        self._index.pop(row.key, None)
        return super()._finish(row)

    def summary(self) -> dict:
        st = dict(self.stats)
        st["accept_rate"] = round(st["accepted"] / max(st["drafted"], 1), 4)
        st["tokens_per_row_step"] = round(self.new_tokens / max(st["rows"], 1), 4)
        t = tau(st["committed"], st["rows"])  # every row step is a verify round of that row
        st["tau"] = None if t is None else round(t, 4)
        st["num_drafts"], st["min_reach"], st["fixed_rows"] = self.num_drafts, self.min_reach, self.fixed_rows
        return st
