"""How much DLITE drafts under load: per request (the opt-out) and per batch (the off-switches).

- **Opt-out.** A request whose ``sampling_params.custom_params`` holds ``"dlite_speculate": false``
  (``/generate``; the OpenAI routes take it as ``extra_body={"custom_params": {...}}``) decodes with
  no drafts: its verify rows after the anchor are padding that acceptance never takes, so every
  round commits exactly the target's next token (output identical to no speculation). If every
  request of a round opted out, the round drafts nothing at all (a one-row verify per request).
- **Hard off-switch** (setting ``max_batch_size``): a decode batch of more running requests runs no
  drafter pass and no lookup; it verifies the anchors alone (one row per request: plain decoding
  through the verify path).
- **Soft limit** (``soft_batch_size``): a larger batch verifies at most ``soft_num_drafts`` drafts
  per request (0: as the hard switch).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_dlite.settings import ServingOptions

OPT_OUT_KEY = "dlite_speculate"


def opted_out(req) -> bool:
    """Whether this request asked to decode without speculation (``"dlite_speculate": false``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and params.get(OPT_OUT_KEY) is False


class LoadPolicy:
    def __init__(self, options: ServingOptions):
        self.hard = options.max_batch_size
        self.soft = options.soft_batch_size
        self.soft_num_drafts = options.soft_num_drafts

    def num_drafts(self, batch_size: int, num_drafts: int) -> int:
        """Drafts per request this round, at most, for a batch of ``batch_size`` (0: no drafter pass)."""
        if self.hard is not None and batch_size > self.hard:
            return 0
        if self.soft is not None and batch_size > self.soft:
            return min(num_drafts, self.soft_num_drafts)
        return num_drafts

    @staticmethod
    def opted_out_rows(reqs: Sequence, device) -> Optional[torch.Tensor]:
        """[B] bool of the requests that opted out, or None when none did (the common case)."""
        flags = [opted_out(r) for r in reqs]
        if not any(flags):
            return None
        return torch.tensor(flags, dtype=torch.bool, device=device)
