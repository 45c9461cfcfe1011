"""What the reference engine asks a drafter each round, and the drafters it can use.

A drafter sees a ``DraftRequest`` (the committed tokens and the target's captured hidden states)
and returns a ``DraftProposal`` of at most ``num_drafts`` tokens (DLite: its block size K). The DLite adapter reads only the last C positions
(plus the history the config allows, for the teacher / window ablations).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from .config import DLiteConfig
from .model import DLiteDrafter
from .model_variants import History
from .proposal import DraftProposal
from .speculation.context import last_rows


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
    # ``generate`` ends (tokens: the session's prompt + output); lookup/corpus.py's corpus learns from it.


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

    def draft(self, req: DraftRequest) -> DraftProposal:
        ctx, valid, history, offset = self.context_inputs(req)
        anchor = torch.tensor([req.tokens[-1]], device=req.hidden.device)
        return self.model.propose(
            ctx, valid, anchor, temperature=req.temperature, top_p=req.top_p,
            generator=req.generator, history=history, round_offset=offset,
        )


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


# ---------------------------------------------------------------------------- drafter specs
SHIPPED_DRAFTER_DIR = os.path.join(os.path.dirname(__file__), "checkpoints", "dlite-smollm2-135m")


def shipped_drafter_path() -> Optional[str]:
    """The committed default DLite checkpoint for SmolLM2-135M-Instruct, if present."""
    ok = os.path.isfile(os.path.join(SHIPPED_DRAFTER_DIR, "model.safetensors"))
    return SHIPPED_DRAFTER_DIR if ok else None


def load_dlite(path: Optional[str], target, **config_overrides) -> DLiteDrafter:
    """A DLite drafter bound to a HF target: from ``path``, else the shipped default, else a
    randomly initialized one (with a warning: tau will be ~1 until it is trained)."""
    path = path or shipped_drafter_path()
    if path:
        model = DLiteDrafter.from_pretrained(path)
    else:
        warnings.warn(
            "no trained DLite checkpoint is shipped in this build: using a randomly initialized "
            "drafter (acceptance length ~1). Train one with `sglang-dlite train`.", stacklevel=2,
        )
        torch.manual_seed(0)
        model = DLiteDrafter(DLiteConfig.for_target(target, **config_overrides)).eval()
    return model.bind_hf_target(target)

