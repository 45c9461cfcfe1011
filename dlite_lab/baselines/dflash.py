"""DFlash-style drafter (baseline) and its DSpark-style variant.

DFlash: five target layers fused on the feature axis, ``c_p = ctx_norm(fc([h^{l1}_p; ...; h^{l5}_p]))``,
injected as keys/values into every drafter layer (each layer projects c_p with its own k/v
projections, RoPE at the global position p). The drafter keeps those context keys/values as its
own KV cache over the whole context. One round drafts a block [anchor, MASK x K] at global
positions a..a+K (a = the anchor's position), attention bidirectional inside the block and over
all cached context positions < a; rows 1..K give the K draft tokens in one parallel pass::

    x     = [E anchor, m, m, ..., m]                                (K+1 rows)
    layer: h = input_norm(x);  q, k_blk, v_blk from h
           x = x + o_proj(attn(q, [k_ctx ; k_blk], [v_ctx ; v_blk]))
           x = x + MLP(post_norm(x))
    logits_k = LM_head(final_norm(x_k)),  k = 1..K

DSpark: the same backbone plus a rank-r Markov logit head, a V-sized bias per step from the
previous token (the anchor for step 1, then the previous draft token): drafting is sequential over
the K steps (one r x V product each)::

    logits_k += W_out · E_markov[t_{k-1}]      (E_markov: V x r, W_out: r x V, zero-initialized)

The context K/V of position p depends on the target feature at p only, so the cache is exact to
extend incrementally; it is cropped to the committed, unchanged prefix each round.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dlite_lab.reference.drafters import DraftRequest
from sglang_dlite.model.layers import RMSNorm  # the same norm layer as DLite's
from dlite_lab.baselines.common import (
    MLP, Attention, BaselineConfig, BaselineDrafter, CacheState, KVCacheEngineDrafter, attend, init_weights,
)


class DFlashConfig(BaselineConfig):
    model_type = "dlite-dflash"

    def __init__(self, num_layers: int = 2, **kwargs):
        kwargs.setdefault("architectures", ["DFlashDrafter"])
        super().__init__(num_layers=num_layers, **kwargs)

    @staticmethod
    def default_layer_ids(num_target_layers: int) -> list:
        """DFlash's [1, 9, 17, 25, 33] of 36 layers, mapped proportionally (30 -> [1, 7, 14, 21, 27])."""
        L = num_target_layers
        return sorted({min(L - 1, max(0, round(x * (L - 1) / 35))) for x in (1, 9, 17, 25, 33)})


class DSparkConfig(DFlashConfig):
    model_type = "dlite-dspark"

    def __init__(self, markov_rank: int = 64, **kwargs):
        self.markov_rank = int(markov_rank)
        kwargs.setdefault("architectures", ["DSparkDrafter"])
        super().__init__(**kwargs)

    def validate(self):
        super().validate()
        if self.markov_rank < 1:
            self.invalid(f"markov_rank={self.markov_rank} must be >= 1.")


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H = cfg.target_hidden_size
        self.input_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.attn = Attention(H, H, cfg)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, x, pos, k_ctx=None, v_ctx=None, mask=None, cache=None):
        """The block's rows attend to the context keys/values ``k_ctx``, ``v_ctx`` and to their own;
        inference passes the context's ``cache`` instead: the block's keys join it for this pass only
        (no copy)."""
        h = self.input_norm(x)
        q = self.attn.q(h, pos)
        k, v = self.attn.kv(h, pos)
        if cache is None:
            o = attend(q, torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2), mask)
        else:
            base = cache.len
            cache.append(k[0], v[0])
            try:
                o = attend(q, *cache.view())
            finally:
                cache.crop(base)
        x = x + self.attn.out(o)
        return x + self.mlp(self.post_norm(x))


class DFlashDrafter(BaselineDrafter):
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.ctx_norm = self.hidden_norm()
        self.mask_embed = nn.Parameter(torch.randn(config.target_hidden_size) * 0.02)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        init_weights(self, config.num_layers)

    # ------------------------------------------------------------------ building blocks
    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, L, T, H] target features -> [B, T, H] fused context features c_p."""
        return self.ctx_norm(self.fuse(hidden))

    def block_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[B, N] anchors -> [B, N*(K+1), H] rows [E anchor, mask x K] per block."""
        K = self.config.block_size
        a = self.embed(anchor_ids)[..., None, :]
        m = self.mask_embed.to(a.dtype).expand(*anchor_ids.shape, K, a.shape[-1])
        x = torch.cat([a, m], dim=-2)
        return x.reshape(anchor_ids.shape[0], -1, x.shape[-1])

    def step_bias(self, prev_ids: torch.Tensor) -> Optional[torch.Tensor]:
        return None  # DSpark adds its Markov bias here

    # ------------------------------------------------------------------ training
    def training_forward(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                         anchor_positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, N, K, V] of N blocks per sequence, in one pass.

        hidden: [B, L=5, T, H] outputs of the capture layers (HF hidden_states[l+1]) at every
        position; input_ids: [B, T]; anchor_positions: [B, N] index a of each block's anchor
        (0 <= a <= T-1). Block n sees the target features of positions < a only (exactly what the
        engine gives it), its anchor token and K masks; logits[b, n, k] predicts input_ids[b, a+1+k]
        (labels and validity: ``common.anchor_targets``). DSpark's Markov bias is teacher-forced
        with the ground-truth previous tokens input_ids[a+k].
        """
        B, T, N = self.check_training_inputs(hidden, input_ids, anchor_positions)
        K, dev = self.config.block_size, hidden.device
        c = self.context(hidden)
        ctx_pos = torch.arange(T, device=dev)
        anchors = torch.gather(input_ids, 1, anchor_positions)
        x = self.block_inputs(anchors)
        blk_pos = (anchor_positions[..., None] + torch.arange(K + 1, device=dev)).reshape(B, -1)
        row_anchor = anchor_positions.repeat_interleave(K + 1, dim=1)  # [B, N(K+1)]
        row_block = torch.arange(N, device=dev).repeat_interleave(K + 1)
        ctx_mask = ctx_pos[None, None, :] < row_anchor[..., None]  # [B, R, T]
        blk_mask = (row_block[:, None] == row_block[None, :]).expand(B, -1, -1)
        mask = torch.cat([ctx_mask, blk_mask], dim=2)
        for layer in self.layers:
            k_ctx, v_ctx = layer.attn.kv(c, ctx_pos)
            x = layer(x, blk_pos, k_ctx, v_ctx, mask)
        x = x.view(B, N, K + 1, -1)[:, :, 1:]
        logits = self.lm_logits(x)
        prev = torch.gather(input_ids, 1, (anchor_positions[..., None] + torch.arange(K, device=dev))
                            .clamp(max=T - 1).reshape(B, -1)).view(B, N, K)
        bias = self.step_bias(prev)
        return logits if bias is None else logits + bias


class DSparkDrafter(DFlashDrafter):
    config_class = DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_embed = nn.Parameter(torch.randn(config.vocab_size, config.markov_rank) * 0.02)
        self.markov_out = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        nn.init.zeros_(self.markov_out.weight)

    def step_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """V-sized logit bias from the previous token: [...] ids -> [..., V]."""
        w = self.markov_out.weight if self.train_vocab is None else self.markov_out.weight[self.train_vocab]
        return F.linear(F.embedding(prev_ids, self.markov_embed), w)


class DFlashEngineDrafter(KVCacheEngineDrafter):
    """Engine adapter (DFlash and DSpark): the context K/V cache lives in ``req.state``."""

    def encode(self, st: CacheState, req: DraftRequest, n: int, rows: torch.Tensor) -> None:
        """The context K/V of positions n..end-1 (the ones with target features) into the cache."""
        m, end = self.model, req.hidden_end
        if end > n:
            c = m.context(rows)
            pos = torch.arange(n, end, device=c.device)
            for layer, cache in zip(m.layers, st.kv):
                k, v = layer.attn.kv(c, pos)
                cache.append(k[0], v[0])

    @torch.no_grad()
    def draft(self, req: DraftRequest):
        m, K = self.model, self.num_drafts
        st = self.sync(req)
        a = len(req.tokens) - 1
        anchor = torch.tensor([[req.tokens[-1]]], device=m.fc.weight.device)
        x = m.block_inputs(anchor)
        pos = torch.arange(a, a + K + 1, device=x.device)
        for layer, cache in zip(m.layers, st.kv):
            x = layer(x, pos, cache=cache)
        logits = m.lm_logits(x[:, 1:]).float()[0]  # [K, V]

        def step(i, prev):  # DFlash: independent per position; DSpark: biased by the previous token
            bias = m.step_bias(prev)
            return logits[i:i + 1] if bias is None else logits[i:i + 1] + bias.float()

        return self.sample_steps(req, step, anchor[:, 0])
