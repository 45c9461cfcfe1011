"""The DLite drafter's ablation variants: ``AblationDrafter``, the served ``DLiteDrafter``
(``sglang_dlite/model/dlite.py``) with the same parameters and other inputs chosen by the config.
Used by training (the history-aware teacher of the warm-up stage, and every drafter the lab trains:
with the served config it is the served drafter) and by the baselines / ablations
(``baselines/registry.py``); the product serves none of them.

- ``history="full"`` / ``"window:W"``: the history-aware teacher / the sliding-window ablation. The
  round's attention also sees the target features of positions before the context window, injected
  as keys/values into every layer (DFlash-style) at their absolute positions (``history_attend``).
- ``head_input="hidden"``: the low-rank RNN head fed the previous position's backbone output instead
  of the previous draft token. Every input of the head then exists after the backbone pass: one scan
  over the K positions (the ``lowrank_rnn_scan`` kernel), one batched vocabulary projection
  (``hidden_head``, ``propose_hidden_head``). The method's reading of the head and the config's
  default once; the shipped drafter feeds the token instead, which keeps later drafts alive (held-out
  acceptance at positions 2-7, docs/results.md; tau within noise at equal training time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_dlite import ops
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.model.config import DLiteConfig
from sglang_dlite.model.dlite import DLiteDrafter, load_dlite
from sglang_dlite.model.proposal import DraftProposal


# ---------------------------------------------------------------------------- history variants
@dataclass
class History:
    """Target features of positions before the round's context window (teacher/window only).

    hidden: [Bh, L, T, H] (Bh = 1 broadcasts one sequence's history to every anchor);
    positions: [Bh, T] absolute positions; valid: [B, T] which history slots each row may see.
    """

    hidden: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


def history_attend(drafter, context_valid, history: History, round_offset):
    """The backbone's attention for the teacher / window variants (torch only): the round's rows,
    at absolute positions ``round_offset + local position``, also see the history rows (the
    target's features, normalized and depth-embedded like the context rows)."""
    if round_offset is None:
        raise DLiteInputError("history variants need round_offset (absolute position of context slot 0).")
    cfg = drafter.config
    L, C, K = cfg.num_capture_layers, cfg.num_context_positions, cfg.block_size
    Lh = history.hidden.shape[1]
    hidden = history.hidden.to(drafter.mask_embed.dtype)
    h_in = ops.rms_norm(hidden, drafter.ctx_norm_weight[None, :, None, :], cfg.rms_norm_eps)
    h_in = h_in + drafter.depth_embed[:Lh, None, :]
    hist_inputs = h_in.reshape(hidden.shape[0], -1, hidden.shape[-1])  # [Bh, L*T, H]

    local = ops.round_positions(L, C, K, device=round_offset.device)
    pos = round_offset[:, None] + local[None]  # [B, S] absolute positions
    cos, sin = ops.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
    hpos = history.positions[:, None, :].expand(-1, L, -1).reshape(history.positions.shape[0], -1)
    hcos, hsin = ops.rope_cos_sin(hpos, cfg.head_dim, cfg.rope_theta)
    local_mask = ops.round_attention_mask(context_valid, L, K, cfg.block_attention == "causal")
    hist_valid = history.valid.repeat(1, L)  # [B, L*T]
    B, S = pos.shape
    mask = torch.cat([hist_valid[:, None, :].expand(B, S, -1), local_mask], dim=2)[:, None]

    def attend(layer, q, k, v):
        hk, hv = layer.kv(hist_inputs)  # [Bh, L*T, Hkv, d]
        Hq = q.shape[2]
        q = ops.apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))
        k = ops.apply_rope(k, cos.to(q.dtype), sin.to(q.dtype))
        hk = ops.apply_rope(hk, hcos.to(q.dtype), hsin.to(q.dtype))
        if hk.shape[0] != B:
            hk, hv = hk.expand(B, -1, -1, -1), hv.expand(B, -1, -1, -1)
        keys = torch.cat([hk, k], dim=1).repeat_interleave(Hq // k.shape[2], dim=2)
        vals = torch.cat([hv, v], dim=1).repeat_interleave(Hq // k.shape[2], dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2)

    return attend


# ---------------------------------------------------------------------------- hidden-state head
def hidden_head(head, z_prev: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The low-rank RNN head fed backbone outputs: u_i = W_u z_{i-1} (``model.LowRankRNNHead``'s
    recurrence otherwise). z_prev = [anchor row, rows 0..K-2], z = rows 0..K-1: [B, K, H]."""
    s = ops.lowrank_rnn_scan(head.gate_proj(z), head.in_proj(z_prev))
    return z + head.out_proj(s)


def propose_hidden_head(drafter, z, n: int, temperature: float, top_p: float, generator,
                        return_confidence: bool, top_k: int = 0) -> DraftProposal:
    """``DLiteDrafter.propose`` after the backbone (outputs ``z`` [B, K+1, H]), hidden-state head:
    the first ``n`` drafts from one scan and one vocabulary projection over all n positions."""
    with ops.nvtx_range("dlite.head"):
        y = hidden_head(drafter.head, z[:, :n], z[:, 1:n + 1])
    with ops.nvtx_range("dlite.projection"):
        if temperature > 0:
            return DraftProposal(*drafter.sampled_drafts(y, temperature, top_p, generator))
        if top_k > 0:
            ids, top = drafter.ranked_drafts(y, top_k)
            return DraftProposal(ids[..., 0], None, confidence=top[..., 0], top_tokens=ids, top_probs=top)
        if return_confidence:
            tokens, conf = drafter.confident_drafts(y)
            return DraftProposal(tokens, None, confidence=conf)
        return DraftProposal(drafter.greedy_drafts(y), None)  # fused final norm + LM head + argmax


# ---------------------------------------------------------------------------- the drafter
class AblationDrafter(DLiteDrafter):
    """``DLiteDrafter`` that also runs the ablations: ``history`` (teacher / window: the round also
    attends to the history rows, ``history_attend``) and ``head_input="hidden"`` (one scan, one
    batched projection). With the served config it computes exactly what ``DLiteDrafter`` does, and
    its checkpoints are the same format."""

    @classmethod
    def check_design(cls, cfg) -> None:
        pass  # every config DLiteConfig.validate accepts

    def backbone(self, context_hidden, context_valid, anchor_ids, history: Optional[History] = None,
                 round_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``DLiteDrafter.backbone``; ``history`` / ``round_offset``: the teacher / window variants."""
        if self.config.history_window == 0 or history is None:  # no history: the DLite path
            return super().backbone(context_hidden, context_valid, anchor_ids)
        x = self.round_inputs(context_hidden, context_valid, anchor_ids)
        return self.run_layers(x, history_attend(self, context_valid, history, round_offset))

    def forward(self, context_hidden, context_valid, anchor_ids, history: Optional[History] = None,
                round_offset=None, feedback_tokens: Optional[torch.Tensor] = None,
                vocab: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.lm_logits(self.head_states(context_hidden, context_valid, anchor_ids, history, round_offset,
                                               feedback_tokens), vocab)

    def head_states(self, context_hidden, context_valid, anchor_ids, history: Optional[History] = None,
                    round_offset=None, feedback_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        z = self.backbone(context_hidden, context_valid, anchor_ids, history, round_offset)
        if self.config.head_input == "hidden":
            return hidden_head(self.head, z[:, :-1], z[:, 1:])
        return self.teacher_forced_head(z, anchor_ids, feedback_tokens)

    @torch.no_grad()
    def propose(self, context_hidden, context_valid, anchor_ids, *, temperature: float = 0.0,
                top_p: float = 1.0, generator: Optional[torch.Generator] = None,
                history: Optional[History] = None, round_offset=None,
                num_drafts: Optional[int] = None, return_confidence: bool = False,
                top_k: int = 0) -> DraftProposal:
        n = self.num_drafts(num_drafts)
        z = self.backbone(context_hidden, context_valid, anchor_ids, history, round_offset)
        if self.config.head_input == "hidden":  # one scan, one batched projection
            return propose_hidden_head(self, z, n, temperature, top_p, generator, return_confidence, top_k)
        return self.draft_chain(z, anchor_ids, n, temperature, top_p, generator, return_confidence, top_k)


def drafter_class(config) -> type:
    """The served ``DLiteDrafter`` for the served design, ``AblationDrafter`` for an ablation's config."""
    served = config.history_window == 0 and config.head_input == "token"
    return DLiteDrafter if served else AblationDrafter


def build_drafter(config) -> DLiteDrafter:
    """A new drafter of ``config`` (``drafter_class``)."""
    return drafter_class(config)(config)


def load_drafter(path: Optional[str], target) -> DLiteDrafter:
    """``load_dlite`` of any DLite checkpoint, an ablation's too, in the class its config needs (no
    path: the shipped drafter)."""
    cls = DLiteDrafter
    if path:
        try:
            cls = drafter_class(DLiteConfig.from_pretrained(path))
        except (OSError, ValueError, DLiteConfigError):
            pass  # load_dlite names what is wrong with the folder
    return load_dlite(path, target, cls)
