"""Training losses over the K draft positions of a batch of anchors: the offline trainer's
(``training/loop.py``: the stabilize stage is CE + TV) and the online learner's (``online.py``).

Shapes: logits ``[B, K, V]``, labels ``[B, K]`` (token ids), valid ``[B, K]`` (bool: the label
exists and lies in a loss-masked span), weights ``[K]``. Every loss is the weighted mean over
valid positions: ``sum_b,i w_i * valid_bi * l_bi / sum_b,i w_i * valid_bi`` (0 if nothing is valid).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_i = exp(-(i - 1) / gamma) for 1-based positions i = 1..K (gamma <= 0: all ones)."""
    i = torch.arange(block_size, dtype=torch.float32, device=device)
    if gamma <= 0 or math.isinf(gamma):
        return torch.ones_like(i)
    return torch.exp(-i / gamma)


def _weighted_mean(per_pos: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    w = weights.to(per_pos.dtype)[None, :] * valid.to(per_pos.dtype)
    # No `if denom <= 0` branch: it would sync the GPU every loss. With no valid position the
    # numerator is 0 and the clamped denominator gives 0 (with the same autograd graph).
    denom = w.sum().clamp_min(torch.finfo(per_pos.dtype).tiny)
    return (per_pos * w).sum() / denom


def weighted_ce(logits, labels, valid, weights) -> torch.Tensor:
    """Token-level cross-entropy, position-weighted."""
    B, K, V = logits.shape
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    ce = F.cross_entropy(logits.float().reshape(B * K, V), safe.reshape(-1), reduction="none").view(B, K)
    return _weighted_mean(ce, valid, weights)


def forward_kl(teacher_logits, student_logits, valid, weights) -> torch.Tensor:
    """KL(p_teacher || p_student) per position, position-weighted (forward KL: mass-covering):
    ``kl_to_target`` with the teacher's softmax as the target distribution."""
    return kl_to_target(F.softmax(teacher_logits.float(), dim=-1), student_logits, valid, weights)


def tv_distance(target_probs, student_logits, valid, weights) -> torch.Tensor:
    """Total variation 0.5 * sum_v |p_target(v) - p_student(v)| per position, position-weighted."""
    q = F.softmax(student_logits.float(), dim=-1)
    tv = 0.5 * (target_probs.float() - q).abs().sum(-1)
    return _weighted_mean(tv, valid, weights)


def kl_to_target(target_probs, student_logits, valid, weights) -> torch.Tensor:
    """Forward KL(p_target || q_student) per position, position-weighted: the target's whole next-token
    distribution as the label (``target_probs`` sums to 1 over the same vocabulary as the logits)."""
    p = target_probs.float()
    ls = F.log_softmax(student_logits.float(), dim=-1)
    kl = (torch.xlogy(p, p) - p * ls).sum(-1)
    return _weighted_mean(kl, valid, weights)
