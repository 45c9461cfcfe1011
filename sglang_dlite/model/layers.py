"""Building blocks shared by the DLite drafter (``model.py``), its ablation variants
(``dlite_lab/ablations.py``) and the KV-cache baselines (``baselines/``, which use ``RMSNorm``). Pure torch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sglang_dlite import ops
from sglang_dlite.model.config import DLiteConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class DLiteLayer(nn.Module):
    """One pre-norm transformer layer of the DLite backbone (GQA attention + SwiGLU MLP). The
    attention itself is passed in, ``attend(layer, q, k, v) -> [B, S, heads, head_dim]``: the
    drafter's round attention (local RoPE, block mask) or a history variant's."""

    def __init__(self, cfg: DLiteConfig):
        super().__init__()
        H, d = cfg.target_hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(H, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, H, bias=False)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)

    def kv(self, x):
        """This layer's keys and values of extra rows ``x`` [B, S, H] (the history variants' rows
        before the round), without RoPE: [B, S, kv_heads, head_dim] each."""
        B, S, _ = x.shape
        h = self.input_norm(x)
        k = self.k_proj(h).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(B, S, self.num_kv_heads, self.head_dim)
        return k, v

    def forward(self, x, attend):
        B, S, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(B, S, self.num_kv_heads, self.head_dim)
        x = x + self.o_proj(attend(self, q, k, v).reshape(B, S, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
