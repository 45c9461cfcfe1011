"""The DLite drafter: a history-free parallel backbone plus a low-rank RNN head. Pure torch.

One round, as the shipped drafter runs it (see ``ops/reference.py`` for the exact row layout)::

    target hidden states of L layers at the last C committed positions   (L*C rows)
    + the anchor token (last committed token)                            (1 row)
    + K draft placeholders                                               (K rows)
      -> depth embeddings mark "hidden state of target layer l" vs "token"
      -> local RoPE positions 0..C+K, never the global position
      -> a few pre-norm transformer layers (bidirectional or causal inside the block)
      -> low-rank RNN head: a gated rank-r recurrence in hidden space over the K positions, fed the
         previous draft token (``head_input="token"``)
      -> final norm + the target's frozen LM head (its drafting-vocabulary rows), position by
         position: each draft feeds the next step of the head.

The drafter keeps no KV cache and nothing between rounds: its inputs are bounded (S rows) and
independent of the context length. This module is the served design only (``history="none"``,
``head_input="token"``: what ``DLiteConfig()`` builds); the ablations (the history-aware teacher,
the sliding-window and hidden-state-head variants) subclass it in the lab
(``dlite_lab/ablations.py``). Its layers are in ``layers.py``; ``propose`` answers a ``DraftProposal``.

This module imports no sglang: the SGLang plugin, the reference engine and training all use it.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from sglang_dlite import ops
from sglang_dlite.model.config import DLiteConfig
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.model.layers import DLiteLayer, RMSNorm
from sglang_dlite.model.proposal import DraftProposal
from sglang_dlite.model.sampling import logits_to_probs
from sglang_dlite.model.checkpoint import TargetBoundMixin
from sglang_dlite.model.checkpoint import load_checkpoint as _load_checkpoint


class LowRankRNNHead(nn.Module):
    """Restores the causal dependency inside the block with a rank-r recurrence in hidden space.

    For block positions i = 0..K-1 with backbone outputs z_i, t_{-1} = the anchor token, s_{-1} = 0:
        a_i = sigmoid(W_g z_i + b_g)                       gate      [r]
        u_i = W_e emb(t_{i-1})                             input: the previous draft token   [r]
        s_i = a_i * s_{i-1} + (1 - a_i) * u_i              state     [r]
        y_i = z_i + W_o s_i                                corrected hidden state [H]
    (W_e is ``in_proj``; the lab's hidden-state-head ablation feeds it z_{i-1} instead.)
    W_o starts at zero, so an untrained head is the identity.
    """

    def __init__(self, cfg: DLiteConfig):
        super().__init__()
        H, r = cfg.target_hidden_size, cfg.rnn_rank
        self.gate_proj = nn.Linear(H, r, bias=True)
        self.in_proj = nn.Linear(H, r, bias=False)
        self.out_proj = nn.Linear(r, H, bias=False)
        nn.init.zeros_(self.out_proj.weight)

    def step(self, state, z_i, prev_token_embed):
        """One step: (s_{i-1} [B, r] float32, z_i, emb(t_{i-1})) -> (s_i, y_i)."""
        a = torch.sigmoid(self.gate_proj(z_i).float())
        s = a * state + (1 - a) * self.in_proj(prev_token_embed).float()
        return s, z_i + self.out_proj(s.to(z_i.dtype))


class DLiteDrafter(TargetBoundMixin, nn.Module):
    config_class = DLiteConfig

    def __init__(self, config: DLiteConfig):
        super().__init__()
        config.validate()
        self.check_design(config)
        self.config = cfg = config
        H, L = cfg.target_hidden_size, cfg.num_capture_layers
        self.ctx_norm_weight = nn.Parameter(torch.ones(L, H))
        self.depth_embed = nn.Parameter(torch.randn(L + 1, H) * 0.02)
        self.mask_embed = nn.Parameter(torch.randn(H) * 0.02)
        self.layers = nn.ModuleList(DLiteLayer(cfg) for _ in range(cfg.num_layers))
        self.head = LowRankRNNHead(cfg)
        self.final_norm = RMSNorm(H, cfg.rms_norm_eps)
        for layer in self.layers:
            for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.up_proj):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (layer.o_proj, layer.down_proj):
                nn.init.normal_(lin.weight, std=0.02 / (2 * cfg.num_layers) ** 0.5)
        self._init_target_buffers()  # the target's frozen embedding + LM head (bind_target)
        # Drafting vocabulary (training/draft_vocab.py): token ids, saved with the checkpoint; the
        # matching rows of the target's LM head are gathered at bind time (never saved).
        if cfg.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("draft_head_weight", torch.empty(0), persistent=False)
        pos = ops.round_positions(L, cfg.num_context_positions, cfg.block_size)
        cos, sin = ops.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def check_design(cls, cfg: DLiteConfig) -> None:
        """The served design: no history, the token-fed head. Ablations are the lab's subclass."""
        if cfg.history_window != 0 or cfg.head_input != "token":
            raise DLiteConfigError(
                f"history={cfg.history!r}, head_input={cfg.head_input!r} is an ablation of DLite, not its "
                "served design (history 'none', head_input 'token'); build or load it with "
                "dlite_lab.ablations.AblationDrafter (the source checkout's lab).")

    # ------------------------------------------------------------------ backbone
    def _local_attend(self, context_valid):
        cfg = self.config

        def attend(layer, q, k, v):
            return ops.round_attention(
                q, k, v, self.rope_cos.to(q.dtype), self.rope_sin.to(q.dtype), context_valid,
                cfg.num_capture_layers, cfg.block_size, cfg.block_attention == "causal",
            )

        return attend

    def backbone(self, context_hidden, context_valid, anchor_ids) -> torch.Tensor:
        """Returns the backbone outputs of the anchor and the K placeholder rows: [B, K+1, H]."""
        x = self.round_inputs(context_hidden, context_valid, anchor_ids)
        return self.run_layers(x, self._local_attend(context_valid))

    def round_inputs(self, context_hidden, context_valid, anchor_ids) -> torch.Tensor:
        """The round's S = L*C + 1 + K input rows (checked): normed, depth-embedded context rows,
        the anchor's embedding and K mask rows."""
        self._check_bound()
        cfg = self.config
        self._check_inputs(context_hidden, context_valid, anchor_ids)
        dtype = self.mask_embed.dtype
        with ops.nvtx_range("dlite.assemble"):
            anchor = F.embedding(anchor_ids, self.embed_weight).to(dtype)
            return ops.assemble_round_inputs(
                context_hidden.to(dtype), anchor, self.ctx_norm_weight, self.depth_embed, self.mask_embed,
                cfg.block_size, cfg.rms_norm_eps,
            )

    def run_layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The backbone's layers over the round's rows with the attention ``attend``; the anchor's
        and the K placeholders' outputs [B, K+1, H]."""
        cfg = self.config
        with ops.nvtx_range("dlite.backbone"):
            for layer in self.layers:
                x = layer(x, attend)
        return x[:, cfg.num_capture_layers * cfg.num_context_positions:]

    def _check_inputs(self, context_hidden, context_valid, anchor_ids):
        cfg = self.config
        L, C, H = cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size
        if context_hidden.dim() != 4 or tuple(context_hidden.shape[1:]) != (L, C, H):
            raise DLiteInputError(
                f"context_hidden must be [batch, {L} layers, {C} positions, {H}], got {tuple(context_hidden.shape)}."
            )
        B = context_hidden.shape[0]
        if tuple(context_valid.shape) != (B, C) or context_valid.dtype != torch.bool:
            raise DLiteInputError(f"context_valid must be a bool tensor [{B}, {C}], got {context_valid.dtype} {tuple(context_valid.shape)}.")
        if tuple(anchor_ids.shape) != (B,):
            raise DLiteInputError(f"anchor_ids must be [{B}], got {tuple(anchor_ids.shape)}.")

    # ------------------------------------------------------------------ drafting vocabulary
    def set_draft_vocab(self, ids: Optional[torch.Tensor]) -> "DLiteDrafter":
        """Draft among these token ids only (sorted, unique, in range), or None for all tokens."""
        if ids is None:
            self.config.draft_vocab_size = 0
            if "draft_vocab" in self._buffers:
                del self._buffers["draft_vocab"]
            self.draft_head_weight = torch.empty(0, device=self.mask_embed.device)
            return self
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
        self._check_draft_vocab(ids)
        self.config.draft_vocab_size = int(ids.numel())
        self.register_buffer("draft_vocab", ids.to(self.mask_embed.device))
        if self.lm_head_weight.numel():
            self._gather_draft_head()
        return self

    def _gather_draft_head(self) -> None:
        """The bound LM head's rows of the drafting vocabulary (a copy: [N, H])."""
        self.draft_head_weight = self.lm_head_weight[self.draft_vocab.to(self.lm_head_weight.device)]

    def _check_draft_vocab(self, ids: torch.Tensor) -> None:
        V = self.config.vocab_size
        if ids.numel() < 1 or ids.numel() > V:
            raise DLiteConfigError(f"the drafting vocabulary has {ids.numel()} ids; it needs 1..{V}.")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise DLiteConfigError(f"the drafting vocabulary has ids outside [0, {V}): built for another target?")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise DLiteConfigError("the drafting vocabulary must be sorted ascending without duplicates.")

    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().bind_target(embed_weight, lm_head_weight)
        if self.config.draft_vocab_size:
            self._check_draft_vocab(self.draft_vocab)
            self._gather_draft_head()
        return self

    # ------------------------------------------------------------------ vocabulary projection
    def lm_logits(self, y: torch.Tensor, vocab: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits over the whole vocabulary (training and scoring), or over the token ids ``vocab``
        only (the frozen LM head's rows for them: the training-time vocabulary subset)."""
        w = self.lm_head_weight if vocab is None else self.lm_head_weight[vocab]
        return F.linear(self.final_norm(y), w.to(y.dtype))

    def _draft_head(self) -> torch.Tensor:
        """The vocabulary rows greedy drafting projects onto, in the drafter's dtype. A drafter run in
        another dtype than its target's weights (a float32 drafter beside a bf16 target on a CPU,
        where fp32 GEMVs are the faster ones) gets a cast copy, made once and remade when the bound
        weight changes."""
        w = self.draft_head_weight if self.config.draft_vocab_size else self.lm_head_weight
        dt = self.mask_embed.dtype
        if w.dtype == dt:
            return w
        key = (w.data_ptr(), w._version, dt)
        if getattr(self, "_head_cast_key", None) != key:
            self._head_cast, self._head_cast_key = w.to(dt), key
        return self._head_cast

    def draft_logits(self, y: torch.Tensor) -> torch.Tensor:
        """Logits over the drafting vocabulary (the whole vocabulary without one)."""
        return F.linear(self.final_norm(y), self._draft_head().to(y.dtype))

    def greedy_drafts(self, y: torch.Tensor) -> torch.Tensor:
        """Greedy draft token ids of head outputs ``y`` [..., D]: the fused final norm + projection
        onto the drafting vocabulary + argmax, mapped back to token ids."""
        idx = ops.lm_head_argmax(y, self.final_norm.weight, self.final_norm.eps, self._draft_head().to(y.dtype))
        return self._draft_ids(idx)

    def confident_drafts(self, y: torch.Tensor):
        """(greedy draft token ids, the softmax probability of each) of head outputs ``y`` [..., D],
        from one unfused projection (the logits are written once)."""
        logits = self.draft_logits(y).float()
        top, idx = logits.max(-1)
        return self._draft_ids(idx), torch.exp(top - torch.logsumexp(logits, -1))

    def ranked_drafts(self, y: torch.Tensor, k: int):
        """(the k likeliest draft token ids [..., k], their softmax probabilities [..., k]) of head
        outputs ``y`` [..., D]; entry 0 is the greedy draft."""
        probs = torch.softmax(self.draft_logits(y).float(), -1)
        top, idx = probs.topk(min(int(k), probs.shape[-1]), -1)
        return self._draft_ids(idx), top

    def sampled_drafts(self, y: torch.Tensor, temperature: float, top_p: float,
                       generator: Optional[torch.Generator]):
        """(draft token ids sampled at ``temperature`` / ``top_p``, the law each was sampled from
        over the whole vocabulary) of head outputs ``y`` [..., D]."""
        probs = logits_to_probs(self.draft_logits(y).float(), temperature, top_p)
        flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        return self._draft_ids(flat.view(probs.shape[:-1])), self._full_vocab_probs(probs)

    def _draft_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the drafting vocabulary -> token ids."""
        return self.draft_vocab[idx] if self.config.draft_vocab_size else idx

    def _full_vocab_probs(self, p: torch.Tensor) -> torch.Tensor:
        """A distribution over the drafting vocabulary, as one over the whole vocabulary."""
        if not self.config.draft_vocab_size:
            return p
        full = p.new_zeros(*p.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self.draft_vocab, p)

    # ------------------------------------------------------------------ training / scoring
    def forward(self, context_hidden, context_valid, anchor_ids, feedback_tokens: Optional[torch.Tensor] = None,
                vocab: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Training/scoring forward: logits [B, K, V] for the K draft positions (or [B, K, |vocab|]
        over the token ids ``vocab``: the training-time vocabulary subset).

        ``feedback_tokens`` [B, K] (the token-fed head): the tokens the head consumes at positions
        0..K-1 are [anchor, feedback_tokens[:, :-1]] (teacher forcing).
        """
        return self.lm_logits(self.head_states(context_hidden, context_valid, anchor_ids, feedback_tokens), vocab)

    def head_states(self, context_hidden, context_valid, anchor_ids,
                    feedback_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The head's outputs [B, K, D] for the K draft positions, before the final norm and the
        vocabulary projection (``forward``'s arguments)."""
        return self.teacher_forced_head(self.backbone(context_hidden, context_valid, anchor_ids), anchor_ids,
                                        feedback_tokens)

    def teacher_forced_head(self, z, anchor_ids, feedback_tokens) -> torch.Tensor:
        """The token-fed head over the backbone outputs ``z`` [B, K+1, H], fed [anchor,
        feedback_tokens[:, :-1]]: [B, K, H]."""
        if feedback_tokens is None:
            raise DLiteInputError("the token-feedback head needs feedback_tokens in training.")
        prev = torch.cat([anchor_ids[:, None], feedback_tokens[:, :-1]], dim=1)
        emb = F.embedding(prev, self.embed_weight).to(z.dtype)
        state = torch.zeros(z.shape[0], self.config.rnn_rank, device=z.device)
        ys = []
        for i in range(self.config.block_size):
            state, y = self.head.step(state, z[:, 1 + i], emb[:, i])
            ys.append(y)
        return torch.stack(ys, 1)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, context_hidden, context_valid, anchor_ids, *, temperature: float = 0.0,
                top_p: float = 1.0, generator: Optional[torch.Generator] = None,
                num_drafts: Optional[int] = None, return_confidence: bool = False,
                top_k: int = 0) -> DraftProposal:
        """Draft K tokens per request (greedy when temperature == 0), or only the first
        ``num_drafts`` of the chain: the backbone still sees the whole block, but the causal head
        and the vocabulary projection stop there (the tokens equal the full chain's prefix).
        ``return_confidence`` (greedy): also the softmax probability of each draft, from the same
        vocabulary projection (unfused: the logits are written once). ``top_k`` (greedy): also the
        k likeliest tokens at every position of the greedy chain and their probabilities
        (``DraftProposal.top_tokens`` / ``top_probs``; a tree's DLite branches, ``drafting/hybrid.py``).

        The token-fed head drafts position by position: each step's draft (fused final norm +
        drafting-vocabulary projection + argmax when greedy) is the next step's input."""
        n = self.num_drafts(num_drafts)
        z = self.backbone(context_hidden, context_valid, anchor_ids)
        return self.draft_chain(z, anchor_ids, n, temperature, top_p, generator, return_confidence, top_k)

    def num_drafts(self, num_drafts: Optional[int]) -> int:
        """``num_drafts`` checked against K (None: K)."""
        K = self.config.block_size
        if num_drafts is not None and not 1 <= num_drafts <= K:
            raise DLiteInputError(f"num_drafts={num_drafts} must be in [1, K={K}].")
        return K if num_drafts is None else num_drafts

    def draft_chain(self, z, anchor_ids, n: int, temperature: float, top_p: float, generator,
                    return_confidence: bool, top_k: int) -> DraftProposal:
        """``propose`` after the backbone (outputs ``z`` [B, K+1, H]): the token-fed head drafts
        position by position, each draft the next step's input."""
        state = torch.zeros(z.shape[0], self.config.rnn_rank, device=z.device)
        prev = anchor_ids
        toks, probs, confs, ranked = [], [], [], []
        for i in range(n):
            emb = F.embedding(prev, self.embed_weight).to(z.dtype)
            state, y = self.head.step(state, z[:, 1 + i], emb)
            if temperature > 0:
                prev, p = self.sampled_drafts(y, temperature, top_p, generator)
                probs.append(p)
            elif top_k > 0:
                ids, top = self.ranked_drafts(y, top_k)
                prev = ids[:, 0]
                ranked.append((ids, top))
                confs.append(top[:, 0])
            elif return_confidence:
                prev, c = self.confident_drafts(y)
                confs.append(c)
            else:
                prev = self.greedy_drafts(y)
            toks.append(prev)
        return DraftProposal(torch.stack(toks, 1), torch.stack(probs, 1) if probs else None,
                             confidence=torch.stack(confs, 1) if confs else None,
                             top_tokens=torch.stack([r[0] for r in ranked], 1) if ranked else None,
                             top_probs=torch.stack([r[1] for r in ranked], 1) if ranked else None)

    @torch.no_grad()
    def head_branch(self, z: torch.Tensor, state: torch.Tensor, i: int, prev_token: torch.Tensor, k: int):
        """One step of the token-fed head for one node of a draft tree: block position ``i``, the
        backbone outputs ``z`` [B, K+1, H] (``backbone``), the head state ``state`` [B, r] after the
        node's parent (zeros at the root) and the node's token ``prev_token`` [B]. Returns (the
        state after the node, its ``k`` likeliest next tokens [B, k], their softmax probabilities
        over the drafting vocabulary [B, k]). No backbone re-run: a tree costs one head step and one
        vocabulary projection per expanded node."""
        if self.config.head_input != "token":
            raise DLiteConfigError("tree drafting branches the token-fed head (head_input='token'), not "
                                   f"head_input={self.config.head_input!r}.")
        if not 0 <= i < self.config.block_size:
            raise DLiteInputError(f"block position {i} outside [0, K={self.config.block_size}).")
        emb = F.embedding(prev_token, self.embed_weight).to(z.dtype)
        state, y = self.head.step(state, z[:, 1 + i], emb)
        ids, top = self.ranked_drafts(y, k)
        return state, ids, top


def load_checkpoint(path: str):
    """Read and validate (config, state dict) from a DLite checkpoint folder."""
    return _load_checkpoint(path, DLiteConfig)


SHIPPED_DRAFTER_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "checkpoints", "dlite-smollm2-135m")


def shipped_drafter_path() -> Optional[str]:
    """The committed default DLite checkpoint for SmolLM2-135M-Instruct, if present."""
    ok = os.path.isfile(os.path.join(SHIPPED_DRAFTER_DIR, "model.safetensors"))
    return SHIPPED_DRAFTER_DIR if ok else None


def load_dlite(path: Optional[str], target, drafter_class=None, **config_overrides) -> DLiteDrafter:
    """A DLite drafter bound to a HF target: from ``path``, else the shipped default, else a
    randomly initialized one (with a warning: tau will be ~1 until it is trained).
    ``drafter_class``: DLiteDrafter or a subclass (the lab's ablations)."""
    cls = drafter_class or DLiteDrafter
    path = path or shipped_drafter_path()
    if path:
        model = cls.from_pretrained(path)
    else:
        warnings.warn(
            "no trained DLite checkpoint is shipped in this build: using a randomly initialized "
            "drafter (acceptance length ~1). Train one with `sglang-dlite train`.", stacklevel=2,
        )
        torch.manual_seed(0)
        model = cls(DLiteConfig.for_target(target, **config_overrides)).eval()
    return model.bind_hf_target(target)
