"""Pieces the KV-cache baselines share: their config (on the drafter config base), a Llama-style
layer, a growable KV cache, the model base, sampling, and the engine adapters' cache bookkeeping.

Everything here is pure torch and imports no sglang.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from sglang_dlite.model.drafter_config import DrafterConfig
from dlite_lab.reference.drafters import DraftRequest
from sglang_dlite.errors import DLiteInputError
from sglang_dlite.model.layers import RMSNorm
from sglang_dlite.model.proposal import DraftProposal
from sglang_dlite.ops.reference import apply_rope, rope_cos_sin
from sglang_dlite.model.sampling import logits_to_probs
from sglang_dlite.model.checkpoint import TargetBoundMixin


# ---------------------------------------------------------------------------- config
class BaselineConfig(DrafterConfig):
    """The EAGLE-3 / DFlash / DSpark baselines' config: the drafter config base's fields and checks
    (``drafter_config.py``, shared with DLite), plus how many capture layers a baseline fuses."""

    model_type = "dlite-baseline"
    num_capture_layers_expected = None  # EAGLE-3: exactly 3 (no annotation: not a config field)
    retrain_hint = "Train one for this target (`make train-baselines`)."

    def __init__(self, **kwargs):  # explicit: transformers would generate a dataclass __init__
        super().__init__(**kwargs)

    def validate(self) -> None:
        super().validate()
        ids = self.target_layer_ids
        if self.num_capture_layers_expected and len(ids) != self.num_capture_layers_expected:
            self.invalid(f"target_layer_ids={ids}: this drafter fuses exactly {self.num_capture_layers_expected} layers.")


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA projections; the attention itself is ``attend`` (keys may come from a cache)."""

    def __init__(self, in_dim: int, out_dim: int, cfg: BaselineConfig):
        super().__init__()
        d = cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(in_dim, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(in_dim, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_dim, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, out_dim, bias=False)
        self.theta = cfg.rope_theta

    def rope(self, x, positions):
        cos, sin = rope_cos_sin(positions, self.d, self.theta)
        return apply_rope(x, cos, sin)

    def q(self, x, positions):
        B, S, _ = x.shape
        return self.rope(self.q_proj(x).view(B, S, self.nh, self.d), positions)

    def kv(self, x, positions):
        """Keys (RoPE applied at ``positions``) and values, head-major: [B, nkv, S, d] each."""
        B, S, _ = x.shape
        k = self.rope(self.k_proj(x).view(B, S, self.nkv, self.d), positions)
        return k.transpose(1, 2), self.v_proj(x).view(B, S, self.nkv, self.d).transpose(1, 2)

    def out(self, o):
        return self.o_proj(o.reshape(*o.shape[:2], -1))


def attend(q, k, v, mask: Optional[torch.Tensor] = None):
    """q [B, Sq, nh, d]; k/v head-major [B, nkv, Sk, d]; mask bool [Sq, Sk] or [B, Sq, Sk]
    (True = visible). Returns [B, Sq, nh, d].

    GQA without copying keys: the rep = nh/nkv query heads of a group are stacked along the query
    axis of their key/value head (query head h reads key/value head h // rep)."""
    B, Sq, nh, d = q.shape
    nkv = k.shape[1]
    rep = nh // nkv
    qg = q.transpose(1, 2).reshape(B, nkv, rep * Sq, d)
    if mask is not None:
        mask = mask.repeat(1, rep, 1)[:, None] if mask.dim() == 3 else mask.repeat(rep, 1)
    o = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
    return o.view(B, nh, Sq, d).transpose(1, 2)


def init_weights(module: nn.Module, num_layers: int) -> None:
    for name, p in module.named_parameters():
        if p.dim() == 2 and not name.endswith("embed"):
            std = 0.02 / (2 * num_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, std=std)


# ---------------------------------------------------------------------------- KV cache
class KVCache:
    """One layer's keys/values of one request, head-major [nkv, T, d] each (attention reads them
    without a copy), grown by doubling (amortized O(1) append, like a paged allocator) and cropped
    by moving the length back."""

    def __init__(self, nkv: int, d: int, dtype=torch.float32, device="cpu", capacity: int = 256):
        self.k = torch.empty(nkv, capacity, d, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.len = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [nkv, S, d]."""
        n = k.shape[1]
        if self.len + n > self.k.shape[1]:
            cap = max(2 * self.k.shape[1], self.len + n)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], cap, old.shape[2])
                new[:, : self.len] = old[:, : self.len]
                setattr(self, name, new)
        self.k[:, self.len:self.len + n] = k
        self.v[:, self.len:self.len + n] = v
        self.len += n

    def crop(self, n: int) -> None:
        self.len = min(self.len, max(0, n))

    def view(self):
        """[1, nkv, T, d] views of the valid part."""
        return self.k[None, :, : self.len], self.v[None, :, : self.len]

    def used_bytes(self) -> int:
        return 2 * self.len * self.k.shape[0] * self.k.shape[2] * self.k.element_size()


# ---------------------------------------------------------------------------- binding / checkpoints
class BaselineDrafter(TargetBoundMixin, nn.Module):
    """What the baseline models share beyond the target binding (``TargetBoundMixin``, DLite's too):
    ``fc`` fusing the captured target layers, the final norm before the target's LM head, the token
    embedding in the drafter's dtype and the LM head over the training vocabulary subset. Subclasses
    add their layers, then call ``init_weights``."""

    def __init__(self, config: BaselineConfig):
        super().__init__()
        config.validate()
        self.config = config
        H = config.target_hidden_size
        self.fc = nn.Linear(config.num_capture_layers * H, H, bias=False)
        self.final_norm = self.hidden_norm()
        self._init_target_buffers()

    def hidden_norm(self) -> RMSNorm:
        """A new RMS-norm over the target's hidden size (DLite's norm layer)."""
        return RMSNorm(self.config.target_hidden_size, self.config.rms_norm_eps)

    def embed(self, ids):
        return F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, L, T, H] target features -> [B, T, H]: concatenated on the feature axis, then ``fc``."""
        B, L, T, H = hidden.shape
        return self.fc(hidden.to(self.fc.weight.dtype).permute(0, 2, 1, 3).reshape(B, T, L * H))

    # Training-time vocabulary subset (token ids; None = the full vocabulary): logits over those
    # rows of the frozen LM head only, as DLite's trainer does (``--vocab-subset``). Never saved.
    train_vocab = None

    def lm_logits(self, h):
        w = self.lm_head_weight if self.train_vocab is None else self.lm_head_weight[self.train_vocab]
        return F.linear(self.final_norm(h), w.to(h.dtype))

    def check_training_inputs(self, hidden, input_ids, anchors, min_anchor: int = 0):
        """Refuse an unbound model or inputs of the wrong shape; returns (B, T, N)."""
        self._check_bound()
        L, H = self.config.num_capture_layers, self.config.target_hidden_size
        if hidden.dim() != 4 or hidden.shape[1] != L or hidden.shape[3] != H:
            raise DLiteInputError(f"hidden must be [B, {L} capture layers, T, {H}], got {tuple(hidden.shape)}.")
        B, _, T, _ = hidden.shape
        if tuple(input_ids.shape) != (B, T):
            raise DLiteInputError(f"input_ids must be [{B}, {T}], got {tuple(input_ids.shape)}.")
        if anchors.dim() != 2 or anchors.shape[0] != B:
            raise DLiteInputError(f"anchor_positions must be [{B}, N], got {tuple(anchors.shape)}.")
        if anchors.numel() and (int(anchors.min()) < min_anchor or int(anchors.max()) > T - 1):
            raise DLiteInputError(f"anchor positions must lie in [{min_anchor}, {T - 1}].")
        return B, T, anchors.shape[1]


# ---------------------------------------------------------------------------- training helpers
def anchor_targets(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """Labels of ``training_forward``: targets[b, n, k] = input_ids[b, anchors[b, n] + 1 + k] and
    a validity mask (False where that position is past the end of the sequence)."""
    T = input_ids.shape[1]
    idx = anchors[..., None] + 1 + torch.arange(block_size, device=anchors.device)
    valid = idx < T
    tgt = torch.gather(input_ids, 1, idx.clamp(max=T - 1).reshape(input_ids.shape[0], -1)).view(idx.shape)
    return tgt, valid


# ---------------------------------------------------------------------------- engine adapters
class CacheState:
    """A KV baseline's per-conversation state, kept in ``DraftRequest.state[key]``.

    ``kv[i]`` covers drafter positions 0..n-1 (n = ``kv[0].len``); ``tokens`` is the committed token
    list those positions were encoded from (the engine's own list object while it only grows)."""

    def __init__(self, num_layers: int, nkv: int, d: int, dtype, device):
        self.kv = [KVCache(nkv, d, dtype, device) for _ in range(num_layers)]
        self.tokens: list = []
        self.tokens_len = 0  # len(tokens) when last synced
        self.tail: list = []  # tokens[-4:] when last synced (cheap identity check)

    @property
    def n(self) -> int:
        return self.kv[0].len

    def crop(self, n: int) -> None:
        for c in self.kv:
            c.crop(n)

    def used_bytes(self) -> int:
        return sum(c.used_bytes() for c in self.kv)


def valid_cached_prefix(st: CacheState, tokens: list) -> int:
    """How many leading committed tokens still equal the ones the cache was built from.

    Fast path: the engine extends its session's token list in place between rounds and replaces
    it (a new list object) when it truncates or starts a new turn; a same-object list that has
    only grown and still ends the way it did is unchanged on the synced prefix."""
    m = st.tokens_len
    if st.tokens is tokens and len(tokens) >= m and tokens[max(0, m - 4):m] == st.tail:
        return m
    return len(os.path.commonprefix([st.tokens[:m], tokens]))


def mark_synced(st: CacheState, tokens: list) -> None:
    st.tokens, st.tokens_len, st.tail = tokens, len(tokens), tokens[-4:]


class KVCacheEngineDrafter:
    """What the engine adapters of the KV baselines share: the per-request ``CacheState`` in
    ``req.state[state_key]`` (created on first use, one K/V cache per drafter layer), its size, its
    sync to the committed tokens and the sequential sampling of the drafts. Subclasses implement
    ``encode(state, req, n, rows)`` (positions n.. into the cache, ``rows`` their captured target
    features [1, L, hidden_end - n, H]) and ``draft``."""

    pair_shift = 0  # drafter position p is encoded from tokens[:p + 1 + pair_shift] (EAGLE-3: 1)

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.state_key = cfg.model_type
        self.num_drafts = cfg.block_size  # K
        self.capture_layer_ids = list(cfg.target_layer_ids)
        self.hidden_rows_needed = None  # must see every position once, to encode it into its cache
        self.last_logits: Optional[torch.Tensor] = None  # [K, V] of the last draft (tests)

    def state(self, req: DraftRequest) -> CacheState:
        """This request's cache state (created empty on the first round)."""
        st = req.state.get(self.state_key)
        if st is None:
            cfg, w = self.model.config, self.model.fc.weight
            st = req.state[self.state_key] = CacheState(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                        w.dtype, w.device)
        return st

    def memory_bytes(self, state: dict) -> int:
        """Drafter-owned bytes kept per request between rounds (its KV cache)."""
        st = state.get(self.state_key)
        return 0 if st is None else st.used_bytes()

    def sync(self, req: DraftRequest) -> CacheState:
        """Crop the cache to the positions whose tokens are still committed and unchanged, then
        ``encode`` the positions after them that have target features; returns the state."""
        st, shift = self.state(req), self.pair_shift
        n = max(0, min(st.n, req.hidden_end - shift, valid_cached_prefix(st, req.tokens) - shift))
        if n < req.hidden_start:
            raise DLiteInputError(
                f"the {self.model.config.name} cache needs target features from position {n}, but the engine "
                f"kept only positions >= {req.hidden_start} (this drafter sets hidden_rows_needed=None)."
            )
        st.crop(n)
        self.encode(st, req, n, req.hidden[None, :, n - req.hidden_start:])
        mark_synced(st, req.tokens)
        return st

    def sample_steps(self, req: DraftRequest, step, prev: Optional[torch.Tensor] = None) -> DraftProposal:
        """The proposal of ``num_drafts`` sequential draft steps: ``step(i, prev) -> logits [1, V]`` of
        draft i, given the token drafted before it (``prev``: the caller's start value at i = 0).
        Greedy at temperature 0, else sampled with top-p (the probabilities go with the proposal)."""
        toks, probs, logits_all = [], [], []
        for i in range(self.num_drafts):
            logits = step(i, prev).float()
            logits_all.append(logits[0])
            if req.temperature <= 0:
                prev, p = logits.argmax(-1), None
            else:
                p = logits_to_probs(logits, req.temperature, req.top_p)
                prev = torch.multinomial(p, 1, generator=req.generator).squeeze(1)
            toks.append(prev)
            probs.append(p)
        self.last_logits = torch.stack(logits_all)
        return DraftProposal(torch.stack(toks, dim=1), None if probs[0] is None else torch.stack(probs, dim=1))
