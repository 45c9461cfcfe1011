"""From logits to the target's sampling law: temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import torch


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Temperature + top-k + top-p filtered distribution over the last dim, in fp32 (one request's
    parameters for every row)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0 or top_k > 0:
        lead = probs.shape[:-1]
        flat = probs.reshape(-1, probs.shape[-1])
        n = flat.shape[0]
        k = torch.full((n,), top_k if top_k > 0 else flat.shape[-1], dtype=torch.int64)
        pp = torch.full((n,), float(top_p))
        probs = filter_top_k_top_p(flat[:, None], k, pp)[:, 0].reshape(*lead, -1)
    return probs


def filter_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """probs ``[B, W, V]`` with per-request top-k (int, ``[B]``) and top-p (float, ``[B]``) filters,
    renormalized. Keeps the smallest set of most likely tokens whose mass reaches top_p (the most
    likely token always stays). Skips the sort when no request filters."""
    V = probs.shape[-1]
    k = top_ks.to(probs.device).clamp(min=1, max=V)
    pp = top_ps.to(probs.device).float()
    if bool((k >= V).all()) and bool((pp >= 1.0).all()):
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=probs.device)[None, None, :]
    cum = sorted_p.cumsum(-1)
    keep = (rank < k.view(-1, 1, 1)) & ((cum - sorted_p) <= pp.view(-1, 1, 1))
    keep[..., 0] = True
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)
