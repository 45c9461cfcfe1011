"""EAGLE-3-style drafter (baseline): three target layers fused on the feature axis, one decoder
layer with its own KV cache over the whole context, global positions, autoregressive drafting.

Drafter position p pairs the target's fused feature at p with the token at p+1 and predicts the
token at p+2 (EAGLE's one-token shift)::

    f_p   = fc([h^{l1}_p ; h^{l2}_p ; h^{l3}_p])                 3H -> H
    x_p   = [embed_norm(E t_{p+1}) ; feat_norm(f_p)]              2H  (q, k, v read this)
    o_p   = f_p + o_proj(attn(q_p, k_{<=p}, v_{<=p}))             H   (RoPE at global p)
    y_p   = o_p + MLP(post_norm(o_p));  logits = LM_head(final_norm(y_p))

Drafting from committed tokens t_0..t_{T-1} (target features for positions < T-1): the cache holds
k, v of pairs 0..T-2; step 0 queries pair T-2 (token t_{T-1} = the anchor) -> d_1; step k >= 1 feeds
its own previous output y as the feature with token d_k at position T-2+k -> d_{k+1}. The draft
steps' keys are temporary; only committed pairs stay cached (cropped when the context changes).

Training (``training_forward``) is the training-time-test unroll: the context pairs of a sequence
are encoded in one causal pass, then K steps run for many anchors at once exactly as inference
runs them (own outputs as features, ground-truth tokens), so the gradient sees its own errors.
"""

from __future__ import annotations

from typing import Optional

import torch

from dlite_lab.reference.drafters import DraftRequest
from sglang_dlite.errors import DLiteInputError
from dlite_lab.baselines.common import (
    MLP, Attention, BaselineConfig, BaselineDrafter, CacheState, KVCacheEngineDrafter, attend, init_weights,
)


class Eagle3Config(BaselineConfig):
    model_type = "dlite-eagle3"
    num_capture_layers_expected = 3

    def __init__(self, num_layers: int = 1, **kwargs):
        kwargs.setdefault("architectures", ["Eagle3Drafter"])
        super().__init__(num_layers=num_layers, **kwargs)

    def validate(self):
        super().validate()
        if self.num_layers != 1:
            self.invalid("the EAGLE-3 baseline has exactly one decoder layer (num_layers=1).")

    @staticmethod
    def default_layer_ids(num_target_layers: int) -> list:
        """Low / middle / high layer: (2, L/2, L-3) as EAGLE-3 (30 layers -> [2, 15, 27])."""
        L = num_target_layers
        ids = {min(2, L - 1), L // 2, max(L - 3, 0)}
        return sorted(ids) if len(ids) == 3 else list(range(min(3, L)))


class Eagle3Drafter(BaselineDrafter):
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        H = config.target_hidden_size
        self.embed_norm, self.feat_norm = self.hidden_norm(), self.hidden_norm()
        self.attn = Attention(2 * H, H, config)
        self.post_norm = self.hidden_norm()
        self.mlp = MLP(H, config.intermediate_size)
        init_weights(self, 1)

    # ------------------------------------------------------------------ building blocks
    def layer_input(self, feat: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.embed_norm(self.embed(token_ids)), self.feat_norm(feat)], dim=-1)

    def finish(self, feat: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        y = feat + self.attn.out(attn_out)
        return y + self.mlp(self.post_norm(y))

    # ------------------------------------------------------------------ training
    def training_forward(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                         anchor_positions: torch.Tensor, num_steps: Optional[int] = None) -> torch.Tensor:
        """Training-time-test unroll at N anchors per sequence. Returns logits [B, N, K, V].

        hidden: [B, L=3, T, H] outputs of the capture layers (HF hidden_states[l+1]) at every
        position of the sequences; input_ids: [B, T]; anchor_positions: [B, N] index a of each
        anchor (last committed token), 1 <= a <= T-1. logits[b, n, k] predicts input_ids[b, a+1+k]
        (labels and validity: ``common.anchor_targets``).

        Step 0 encodes every pair of the sequence in parallel (keys/values of the whole context,
        one causal pass) and queries pair a-1. Step k >= 1 runs, for all anchors at once, what
        inference runs: its input is the previous step's output as the feature with the token
        input_ids[a+k] (teacher forcing: the ground truth, as EAGLE-3), at position a-1+k, and it
        attends to the context pairs <= a-1 plus the chain's own keys of steps 1..k. The gradient
        flows through the unroll (training-time test). EAGLE-3 weights step k by 0.8**k.
        """
        B, T, N = self.check_training_inputs(hidden, input_ids, anchor_positions, min_anchor=1)
        K, dev = num_steps or self.config.block_size, hidden.device
        P = T - 1  # pairs (f_p, t_{p+1}), p = 0..T-2
        feat0 = self.fuse(hidden[:, :, :P])
        x0 = self.layer_input(feat0, input_ids[:, 1:])
        k0, v0 = self.attn.kv(x0, torch.arange(P, device=dev))  # [B, nkv, P, d]
        pos = anchor_positions - 1  # [B, N]: the chain's current position
        feat = torch.gather(feat0, 1, pos[..., None].expand(-1, -1, feat0.shape[-1]))
        x = torch.gather(x0, 1, pos[..., None].expand(-1, -1, x0.shape[-1]))
        ctx_mask = torch.arange(P, device=dev)[None, None, :] <= pos[..., None]  # [B, N, P]
        own = torch.eye(N, dtype=torch.bool, device=dev)[None].expand(B, -1, -1)
        ks, vs, ys = [k0], [v0], []
        for step in range(K):
            if step > 0:
                tok = torch.gather(input_ids, 1, (anchor_positions + step).clamp(max=T - 1))
                x = self.layer_input(feat, tok)
                k, v = self.attn.kv(x, pos)
                ks.append(k)
                vs.append(v)
            mask = torch.cat([ctx_mask] + [own] * step, dim=2)
            y = self.finish(feat, attend(self.attn.q(x, pos), torch.cat(ks, 2), torch.cat(vs, 2), mask))
            ys.append(y)
            feat, pos = y, pos + 1
        return self.lm_logits(torch.stack(ys, dim=2))


class Eagle3EngineDrafter(KVCacheEngineDrafter):
    """Engine adapter: keeps the drafter's KV cache over the whole context in ``req.state``."""

    pair_shift = 1  # pair p uses tokens[:p+2]; the last pair is always re-encoded (its query starts the draft)

    def encode(self, st: CacheState, req: DraftRequest, n: int, rows: torch.Tensor) -> None:
        """Encode pairs n..end-1 (end = len(tokens) - 1: the pairs with a feature) into the cache;
        the last pair's layer input is left in ``st.last``."""
        m, end = self.model, req.hidden_end
        if end < 1:
            raise DLiteInputError("EAGLE-3 drafting needs at least one committed position with a target feature.")
        feat = m.fuse(rows)
        toks = torch.tensor(req.tokens[n + 1:end + 1], device=feat.device)[None]
        x = m.layer_input(feat, toks)
        k, v = m.attn.kv(x, torch.arange(n, end, device=feat.device))
        st.kv[0].append(k[0], v[0])
        st.last = (feat[:, -1:], x[:, -1:], end - 1)

    @torch.no_grad()
    def draft(self, req: DraftRequest):
        m = self.model
        st = self.sync(req)
        feat, x, p = st.last
        cache = st.kv[0]
        base = cache.len

        def step(i, prev):
            nonlocal feat, x, p
            pos = torch.tensor([p], device=x.device)
            if i > 0:
                x = m.layer_input(feat, prev[:, None])
                k, v = m.attn.kv(x, pos)
                cache.append(k[0], v[0])
            kk, vv = cache.view()
            feat, p = m.finish(feat, attend(m.attn.q(x, pos), kk, vv)), p + 1
            return m.lm_logits(feat[:, -1])

        try:
            return self.sample_steps(req, step)
        finally:
            cache.crop(base)  # draft keys are temporary
