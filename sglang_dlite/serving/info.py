"""Per-request drafter state carried between rounds, and the verify input.

A DLite request needs, for its next round, only:
  * the bonus token (the anchor: last committed token, not yet in the target KV), and
  * the target's captured hidden states of the last C committed positions, with a validity flag.
Both live in ``DLiteDraftInput``: ``bonus_tokens`` [B] and ``hidden_states`` [B, C, L*H + 1]
(the last column is 1.0 for a valid context slot, 0.0 for a missing one). That fixed per-request
shape lets sglang's overlap ``FutureMap`` relay it like EAGLE's hidden states, and makes
``filter_batch`` / ``merge_batch`` plain row selects / concatenations. No draft KV, no draft pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


def pack_context(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Context rows [B, C, L*H] and validity [B, C] -> the carried layout [B, C, L*H + 1]."""
    return torch.cat([rows, valid[..., None].to(rows.dtype)], dim=-1)


def unpack_context(state: torch.Tensor, L: int, H: int):
    """The carried layout -> (the drafter's context [B, L, C, H], validity [B, C] bool)."""
    B, C = state.shape[:2]
    return state[..., :-1].reshape(B, C, L, H).permute(0, 2, 1, 3), state[..., -1] > 0.5


@dataclass
class DLiteDraftInput(SpecInput):
    bonus_tokens: torch.Tensor
    hidden_states: torch.Tensor
    new_seq_lens: Optional[torch.Tensor] = None
    # Relay fields the overlap FutureMap reads on every draft input (unused by DLITE).
    topk_p: Optional[torch.Tensor] = None
    topk_index: Optional[torch.Tensor] = None
    # Filled by the scheduler after dispatch (overlap mode).
    future_indices: Optional[torch.Tensor] = None

    def __post_init__(self):
        super().__init__(spec_input_type=SpecInputType.DFLASH_DRAFT)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    @classmethod
    def create_idle_input(cls, device, width: int = 1, num_ctx: int = 1, dtype=torch.float32):
        return cls(
            bonus_tokens=torch.empty((0,), dtype=torch.int64, device=device),
            hidden_states=torch.empty((0, num_ctx, width), dtype=dtype, device=device),
            new_seq_lens=torch.empty((0,), dtype=torch.int64, device=device),
        )

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: Optional[List[int]] = None):
        if self.future_indices is not None:
            self.future_indices = self.future_indices[new_indices]
            return
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.hidden_states = self.hidden_states[new_indices]
        if self.new_seq_lens is not None:
            self.new_seq_lens = self.new_seq_lens[new_indices]

    def merge_batch(self, other: "DLiteDraftInput"):
        if self.future_indices is not None or other.future_indices is not None:
            assert self.future_indices is not None and other.future_indices is not None, (
                "DLITE: merging a relayed (overlap) draft input with a materialized one"
            )
            self.future_indices = torch.cat([self.future_indices, other.future_indices])
            return
        self.bonus_tokens = torch.cat([self.bonus_tokens, other.bonus_tokens])
        self.hidden_states = torch.cat([self.hidden_states, other.hidden_states])
        if self.new_seq_lens is not None and other.new_seq_lens is not None:
            self.new_seq_lens = torch.cat([self.new_seq_lens, other.new_seq_lens])
        else:
            self.new_seq_lens = None


@dataclass
class DLiteVerifyInput(DFlashVerifyInput):
    """Chain verify of [anchor, d_1..d_K] per request: DFlash's linear verify input (causal, no
    custom mask, FULL hidden capture), reused so every attention backend that supports DFlash
    verify (FlashInfer, FA3, Triton, torch_native with the CPU hook) runs DLITE verify."""
