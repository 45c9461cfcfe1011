"""The reference engine's lookup drafters: ``suffix`` (the lookup alone) and ``hybrid`` (lookup
and DLite, chosen per request every round; see ``chooser.py``).

Both draft deterministically (DLite's greedy chain, the lookup's most frequent continuation), so
sampled requests use the deterministic-draft rejection rule (q one-hot): lossless at any
temperature. A chain may be shorter than K (the lookup ran out, or the length cut): the engine
then verifies fewer tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..drafters import DLiteEngineDrafter, DraftRequest
from ..proposal import DraftProposal
from .chooser import Calibration, choose, default_calibration, lookup_only, needs_dlite
from .suffix import DEFAULT_MAX_MATCH, SuffixIndex


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
            ctx, valid, history, offset = self.dlite.context_inputs(req)
            anchor = torch.tensor([req.tokens[-1]], device=req.hidden.device)
            prop = self.dlite.model.propose(ctx, valid, anchor, history=history, round_offset=offset,
                                            return_confidence=True)
            c = choose(idx, n, self.cal, prop.tokens[0].tolist(), prop.confidence[0].tolist(),
                       lookup=lk, min_reach=self.min_reach, log=log)
        if log is not None:
            log.update(source=c.source, tokens=c.tokens, score=c.score, split=c.split)
            self.round_log.append(log)
        return _proposal(c.tokens, c.source, c.score)
