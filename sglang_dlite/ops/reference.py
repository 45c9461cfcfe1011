"""Torch reference implementations of the draft-step ops.

These are the specification: every C++/CUDA kernel in ``csrc/`` is tested for numerical equality
against the function of the same name here. They are also the fallback path the dispatcher
(``sglang_dlite.ops``) uses when no compiled kernel is available.

Round layout (one speculation round, one request). With L captured target layers, C context
positions and K draft positions, the round sequence has S = L*C + 1 + K rows::

    rows [l*C + c]      target hidden state of layer l at context slot c  (local position c)
    row  [L*C]          the anchor token (last committed token)           (local position C)
    rows [L*C + 1 + i]  draft placeholder i, i = 0..K-1                   (local position C+1+i)

Context slot c = C-1 is the newest committed position whose hidden state the target has
produced; slots may be invalid (``context_valid[b, c] = False``) at the start of a sequence.
Positions are local to the round, so nothing here depends on the sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def round_positions(num_layers: int, num_context: int, block_size: int, device=None) -> torch.Tensor:
    """Local RoPE position of every round row: [0..C-1]*L, C, C+1..C+K."""
    ctx = torch.arange(num_context, device=device).repeat(num_layers)
    blk = torch.arange(num_context, num_context + 1 + block_size, device=device)
    return torch.cat([ctx, blk])


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos/sin tables of shape [*positions.shape, head_dim] (Llama's rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; cos/sin: [S, D] or [B, S, D]."""
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos.float() + rot.float() * sin.float()).to(x.dtype)


def assemble_round_inputs(
    context_hidden: torch.Tensor,  # [B, L, C, H] target hidden states
    anchor_embeds: torch.Tensor,  # [B, H] target token embedding of the anchor
    ctx_norm_weight: torch.Tensor,  # [L, H]
    depth_embed: torch.Tensor,  # [L+1, H]; row L marks token rows
    mask_embed: torch.Tensor,  # [H] placeholder embedding
    block_size: int,
    eps: float,
) -> torch.Tensor:
    """Build the round sequence x: [B, S, H] (layout in the module docstring)."""
    B, L, C, H = context_hidden.shape
    ctx = rms_norm(context_hidden, ctx_norm_weight[None, :, None, :], eps)
    ctx = ctx + depth_embed[:L, None, :].to(ctx.dtype)
    token_depth = depth_embed[L].to(anchor_embeds.dtype)
    anchor = (anchor_embeds + token_depth)[:, None, :]
    blk = (mask_embed.to(anchor_embeds.dtype) + token_depth).expand(B, block_size, H)
    return torch.cat([ctx.reshape(B, L * C, H).to(anchor.dtype), anchor, blk], dim=1)


def round_attention_mask(
    context_valid: torch.Tensor,  # [B, C] bool
    num_layers: int,
    block_size: int,
    causal: bool,
) -> torch.Tensor:
    """Boolean mask [B, S, S] (True = may attend) for one round sequence.

    Keys from invalid context slots are masked. ``causal`` makes the block (anchor + placeholders)
    causal; context rows then see only context rows. Every row may see itself, so no row is empty.
    """
    B, C = context_valid.shape
    L, K = num_layers, block_size
    n_ctx = L * C
    S = n_ctx + 1 + K
    key_valid = torch.cat(
        [context_valid.repeat(1, L), torch.ones(B, 1 + K, dtype=torch.bool, device=context_valid.device)], dim=1
    )
    allowed = key_valid[:, None, :].expand(B, S, S).clone()
    if causal:
        idx = torch.arange(S, device=context_valid.device)
        structural = (idx[None, :] < n_ctx) | (idx[None, :] <= idx[:, None])
        structural[:n_ctx, n_ctx:] = False
        allowed &= structural[None]
    eye = torch.eye(S, dtype=torch.bool, device=context_valid.device)
    return allowed | eye[None]


def round_attention(
    q: torch.Tensor,  # [B, S, Hq, D]  (before RoPE)
    k: torch.Tensor,  # [B, S, Hkv, D] (before RoPE)
    v: torch.Tensor,  # [B, S, Hkv, D]
    cos: torch.Tensor,  # [S, D]
    sin: torch.Tensor,  # [S, D]
    context_valid: torch.Tensor,  # [B, C] bool
    num_layers: int,
    block_size: int,
    causal: bool,
) -> torch.Tensor:
    """Local-position RoPE + masked (GQA) attention over one round. Returns [B, S, Hq, D]."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    if Hkv != Hq:
        k = k.repeat_interleave(Hq // Hkv, dim=2)
        v = v.repeat_interleave(Hq // Hkv, dim=2)
    mask = round_attention_mask(context_valid, num_layers, block_size, causal)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)


def lowrank_rnn_scan(gate_logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The sequential head's gated element-wise recurrence over K positions.

    gate_logits, inputs: [B, K, r]. With a_i = sigmoid(gate_logits[:, i]):
        s_{-1} = 0,   s_i = a_i * s_{i-1} + (1 - a_i) * inputs[:, i]
    Returns the states s: [B, K, r] (computed in fp32, returned in the input dtype).
    """
    a = torch.sigmoid(gate_logits.float())
    u = inputs.float()
    s = torch.zeros_like(u[:, 0])
    out = []
    for i in range(u.shape[1]):
        s = a[:, i] * s + (1.0 - a[:, i]) * u[:, i]
        out.append(s)
    return torch.stack(out, dim=1).to(inputs.dtype)


def lm_head_argmax(
    hidden: torch.Tensor,  # [..., H] head outputs
    norm_weight: torch.Tensor,  # [H] the drafter's final RMS-norm weight
    eps: float,
    lm_head_weight: torch.Tensor,  # [V, H] the target's LM head
) -> torch.Tensor:
    """Greedy drafting: final norm + the one batched vocabulary projection + argmax. [...] int64."""
    logits = F.linear(rms_norm(hidden, norm_weight, eps), lm_head_weight.to(hidden.dtype))
    return logits.float().argmax(-1)


def kv_cache_attention(
    q: torch.Tensor,  # [N, Hq, D] the new tokens' queries, rows concatenated
    k_cache: torch.Tensor,  # [slots, Hkv, L, D] one layer's key cache (slot b = row b)
    v_cache: torch.Tensor,  # [slots, Hkv, L, D]
    starts: torch.Tensor,  # [B] int64: row b's first new position (its cache holds 0..starts[b]-1 before them)
    lens: torch.Tensor,  # [B] int64: row b's new tokens (already written into the cache)
    scale: float,
) -> torch.Tensor:
    """Not a draft-step op: the fast regeneration engine's decode / speculative-verify attention
    (``training/fast_llama.py``). Token t of row b attends causally to keys 0..starts[b]+t of cache
    slot b; query head i uses KV head i // (Hq // Hkv). Returns [N, Hq, D]."""
    out = torch.empty_like(q)
    g = q.shape[1] // k_cache.shape[1]
    off = 0
    for b, (st, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        S = st + n
        keys = k_cache[b, :, :S].repeat_interleave(g, 0)  # [Hq, S, D]
        vals = v_cache[b, :, :S].repeat_interleave(g, 0)
        visible = torch.arange(S)[None, :] <= (st + torch.arange(n))[:, None]  # [n, S]
        o = F.scaled_dot_product_attention(q[off:off + n].transpose(0, 1), keys, vals, attn_mask=visible, scale=scale)
        out[off:off + n] = o.transpose(0, 1)
        off += n
    return out
