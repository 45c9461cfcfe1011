"""The batched float32 (or bf16) Llama forward under ``gen-data --engine fast``: a HF
``LlamaForCausalLM``'s weights rearranged for batched decoding plus a preallocated static KV cache.

* **Static KV cache** ``[layers, slots, kv_heads, max_len, head_dim]``, allocated once; a slot's
  cache is written in place (no per-step concatenation as in HF's dynamic cache).
* ``extend`` (prefill a slot) and ``verify`` (one token per slot, or a few for ``spec_regen``): one
  GEMM per weight for the whole batch; attention per slot exactly to the
  slot's length through the C++ ``kv_cache_attention`` kernel (``attention="auto"|"kernel"``), or
  chunked SDPA with masks (``"sdpa"``, the fallback without the compiled ops).
* fp32 (default) or bf16 weights/activations (RMSNorm and softmax in fp32, as HF does).
* fp32 weights **packed once for MKL's sgemm** (``MklPackedLinear``): unpacked
  ``x @ W.T`` re-lays every weight out on every step; packed, a verify step's 4-96 rows run the
  weight GEMMs 1.15-1.5x faster (``packed=False`` keeps the plain matmuls, for A/B).

The slot/turn driver that uses it is ``fast_regen.FastRegenerator``.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from sglang_dlite import ops
from sglang_dlite.errors import DLiteInputError, MissingDependencyError



def _mkl_packable(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2


def mkl_available() -> bool:
    """Whether torch ships MKL's packed sgemm (``torch.ops.mkl._mkl_linear``, what inductor's CPU
    freezing uses for float32 linears)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class MklPackedLinear:
    """``F.linear(x, weight, bias)`` for a float32 [out, in] CPU weight packed once for MKL's sgemm.

    ``F.linear`` (MKL's unpacked sgemm) re-lays the weight out on every call, which for the few
    rows of a decode or verify step is a large part of the cost: SmolLM2-135M's 30 layers + LM
    head, 1 thread, best of 3 interleaved, M = 4 / 8 / 32 / 64 rows: 92 / 128 / 131 / 191 ms
    unpacked vs 71 / 83 / 110 / 150 ms packed (1.15-1.5x; ``bench/gen_throughput.py``'s
    fast-spec vs fast-spec-unpacked rows measure the end-to-end effect).
    The pack does not depend on the row count, so one packed copy (~1.05x the weight's bytes)
    serves every M. The result equals ``F.linear``'s bit for bit from ~16 rows up; below, MKL's
    unpacked path takes another kernel and they differ in the last bits (as any two GEMM shapes).
    Above ``MAX_ROWS`` rows (a prefill) the packing gains nothing (200-400 rows: 0.97-1.02x,
    noisy) and ``F.linear`` runs instead.
    """

    __slots__ = ("weight", "bias", "packed")
    MAX_ROWS = 128

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor = None):
        if not _mkl_packable(weight):
            raise ValueError(f"MklPackedLinear needs a 2-D float32 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}.")
        if not mkl_available():
            raise RuntimeError("this torch build has no MKL packed sgemm (torch.ops.mkl._mkl_linear); "
                               "use F.linear (MklPackedLinear.maybe returns it).")
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)

    @classmethod
    def maybe(cls, weight: torch.Tensor, bias: torch.Tensor = None):
        """A packed linear where MKL packing applies (float32 CPU weight, MKL present), else a
        closure over ``F.linear``: the same call either way."""
        if _mkl_packable(weight) and mkl_available():
            return cls(weight, bias)
        return functools.partial(F.linear, weight=weight, bias=bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"MklPackedLinear: input is {x.dtype}, the packed weight float32.")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if x2.shape[0] == 0:
            return x.new_empty(*shape[:-1], self.weight.shape[0])
        if x2.shape[0] > self.MAX_ROWS:
            out = F.linear(x2, self.weight, self.bias)
        else:
            out = torch.ops.mkl._mkl_linear(x2, self.packed, self.weight, self.bias, x2.shape[0])
        return out.view(*shape[:-1], out.shape[-1])


class FastLlama:
    """Weights of a HF ``LlamaForCausalLM`` rearranged for batched decoding (fused QKV, fused
    gate/up), plus the static KV cache. Computes what HF's Llama computes, in ``dtype``."""

    ATT_CHUNK = 4

    ATTENTION = ("auto", "kernel", "sdpa")

    def __init__(self, hf_model, slots: int, max_len: int, dtype=torch.float32, capture_layers=None,
                 packed: bool = True, attention: str = "auto"):
        cfg = hf_model.config
        if getattr(cfg, "model_type", "llama") not in ("llama",):
            raise DLiteInputError(f"--engine fast supports Llama targets only (this one is {cfg.model_type!r}); use --engine hf.")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise DLiteInputError("--engine fast does not support attention/MLP biases; use --engine hf.")
        inner = hf_model.model
        self.dtype = dtype
        self.H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.kvh = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or self.H // self.nh
        self.g = self.nh // self.kvh
        self.nl = cfg.num_hidden_layers
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.hd ** -0.5
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.detach().float().clone()
        self.att_scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.capture = list(capture_layers) if capture_layers else []
        bad = [i for i in self.capture if not 0 <= i < self.nl]
        if bad:
            raise DLiteInputError(f"capture layers {bad} do not exist in a target with {self.nl} layers.")
        self._cap_index = {l: k for k, l in enumerate(self.capture)}
        d = dtype
        self.packed = bool(packed)
        # the products: a callable per weight (x [.., in] -> x @ W.T), MKL-packed where that applies
        lin = MklPackedLinear.maybe if self.packed else (lambda w: functools.partial(F.linear, weight=w))

        def product(*ws):  # of the weights stacked by rows (fused QKV, fused gate/up)
            return lin(torch.cat(ws, 0).detach().to(d).contiguous())

        self.layers = [dict(ln1=layer.input_layernorm.weight.detach().to(d),
                            ln2=layer.post_attention_layernorm.weight.detach().to(d),
                            qkv=product(layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                        layer.self_attn.v_proj.weight),
                            o=product(layer.self_attn.o_proj.weight),
                            gu=product(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight),
                            down=product(layer.mlp.down_proj.weight)) for layer in inner.layers]
        self.norm_w = inner.norm.weight.detach().to(d)
        self.embed = inner.embed_tokens.weight.detach().to(d)
        self.head_linear = product(hf_model.get_output_embeddings().weight)
        self.I = cfg.intermediate_size
        self.slots, self.max_len = slots, max_len
        # Allocated, not filled: a slot's positions are zeroed (or written) only up to the longest
        # context its attention reads (``hw``), so memory grows with the contexts actually decoded.
        self.k = torch.empty(self.nl, slots, self.kvh, max_len, self.hd, dtype=d)
        self.v = torch.empty_like(self.k)
        self.hw = [0] * slots
        # decode / verify attention: the C++ kernel (ops.kv_cache_attention: each row to its own
        # length, no masks) where it runs (float32, built library), else chunked SDPA
        if attention not in self.ATTENTION:
            raise DLiteInputError(f"attention must be one of {self.ATTENTION}, got {attention!r}.")
        has_kernel = ops.kv_cache_attention_kernel_available(d, self.hd)
        if attention == "kernel" and not has_kernel:
            raise MissingDependencyError(
                "attention='kernel' needs the C++ ops (float32, head_dim a multiple of 16 up to 256, the library built with the "
                f"kv_cache_attention op): {ops.build_status()}")
        self.kernel_attention = has_kernel if attention == "auto" else attention == "kernel"

    # ------------------------------------------------------------------ pieces
    def _rms(self, x, w):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dt)

    def _rope(self, pos):
        freqs = pos[:, None].float() * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = (emb.cos() * self.att_scaling).to(self.dtype), (emb.sin() * self.att_scaling).to(self.dtype)
        return cos[:, None], sin[:, None]  # [T, 1, hd]: one rotation for every head

    @staticmethod
    def _rot(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    def _mlp(self, x, p):
        gu = p["gu"](x)
        gate, up = gu[..., : self.I], gu[..., self.I:]
        return p["down"](F.silu(gate) * up)

    def logits(self, normed):
        return self.head_linear(normed)

    # ------------------------------------------------------------------ forward passes
    @torch.no_grad()
    def extend(self, slot: int, ids, start: int, want_features: bool):
        """Prefill ``ids`` into ``slot`` at positions start..start+T-1 (the cache must hold
        0..start-1). Returns (final-norm output of the last position [H], features [T, L+1, H] fp16
        or None)."""
        T = len(ids)
        if start + T > self.max_len:
            raise DLiteInputError(f"sequence of {start + T} tokens exceeds the fast engine's max_len {self.max_len}.")
        x = self.embed[torch.as_tensor(ids, dtype=torch.long)]  # [T, H]
        pos = torch.arange(start, start + T)
        cos, sin = self._rope(pos)
        S = start + T
        causal = torch.arange(S)[None, :] <= pos[:, None]  # [T, S]
        caps = [None] * (len(self.capture) + 1) if want_features else None  # captured layers + final norm
        self.hw[slot] = max(self.hw[slot], S)
        rows = torch.full_like(pos, slot)
        for li, p in enumerate(self.layers):
            q = self._attend_inputs(li, p, x, cos, sin, rows, pos)
            K = self.k[li, slot, :, :S][None]  # [1, kvh, S, hd]
            V = self.v[li, slot, :, :S][None]
            qh = q.transpose(0, 1)[None]  # [1, nh, T, hd]
            if start == 0:
                o = F.scaled_dot_product_attention(qh, K, V, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qh, K, V, attn_mask=causal, scale=self.scale, enable_gqa=True)
            x = self._layer_out(li, p, x, o[0].transpose(0, 1).reshape(T, self.nh * self.hd), caps)
        normed, feats = self._final(x, caps)
        return normed[-1], feats

    def _additive(self, valid):
        """A boolean attention mask as the additive 0 / -inf mask SDPA would make of it on every
        call: made once per step instead of once per layer (same result, ~10 % less attention time)."""
        return torch.zeros(valid.shape, dtype=self.dtype).masked_fill_(~valid, float("-inf"))

    def _clear_masked_tail(self, c0: int, c1: int, S: int) -> None:
        """Slots c0..c1-1 attend over key positions [0, S) under a mask; the masked positions past
        a slot's high-water mark are read too, so they must hold zeros, never garbage."""
        for b in range(c0, c1):
            if self.hw[b] < S:
                self.k[:, b, :, self.hw[b]:S] = 0
                self.v[:, b, :, self.hw[b]:S] = 0
                self.hw[b] = S

    def _attend_inputs(self, li, p, x, cos, sin, rows, pos):
        """Layer li's rotated queries [N, nh, hd] for the tokens x [N, H]; their rotated keys and
        values [N, kvh, hd] are written into the cache at (slot rows, position pos)."""
        n = x.shape[0]
        qkv = p["qkv"](self._rms(x, p["ln1"]))
        q = qkv[:, : self.nh * self.hd].view(n, self.nh, self.hd)
        k = qkv[:, self.nh * self.hd:(self.nh + self.kvh) * self.hd].view(n, self.kvh, self.hd)
        self.k[li, rows, :, pos] = self._rot(k, cos, sin)
        self.v[li, rows, :, pos] = qkv[:, (self.nh + self.kvh) * self.hd:].view(n, self.kvh, self.hd)
        return self._rot(q, cos, sin)

    def _layer_out(self, li, p, x, attn, caps):
        """The rest of layer li after attention (output projection, MLP); records the layer's
        output in caps when it is a captured layer."""
        x = x + p["o"](attn)
        x = x + self._mlp(self._rms(x, p["ln2"]), p)
        if caps is not None and li in self._cap_index:
            caps[self._cap_index[li]] = x
        return x

    def _final(self, x, caps):
        """(final-norm outputs, features [N, L+1, H] fp16 or None)."""
        normed = self._rms(x, self.norm_w)
        if caps is None:
            return normed, None
        caps[-1] = normed
        return normed, torch.stack(caps, 1).to(torch.float16)

    @torch.no_grad()
    def verify(self, ids, starts, lens, want_features: bool):
        """Several tokens for each of the slots 0..B-1 in one pass (a speculative verify):
        ``ids`` [N] the rows' tokens concatenated, slot b's ``lens[b]`` tokens at positions
        ``starts[b]..starts[b]+lens[b]-1`` (its cache holds 0..starts[b]-1). The weight GEMMs
        run on the N real tokens (no padding); attention per chunk of ATT_CHUNK slots with the
        queries padded to the chunk's longest row; one token per slot is a plain decode step.
        Returns (final-norm outputs [N, H], features [N, L+1, H] fp16 or None)."""
        B = len(lens)
        N = int(sum(lens))
        rows = torch.repeat_interleave(torch.arange(B), torch.as_tensor(lens))  # [N] slot of each token
        offs = list(itertools.accumulate(lens, initial=0))
        qi = torch.cat([torch.arange(n) for n in lens])  # [N] index of each token within its row
        pos = torch.as_tensor(starts, dtype=torch.long)[rows] + qi
        if int(pos.max()) >= self.max_len:
            raise DLiteInputError(f"sequence of {int(pos.max()) + 1} tokens exceeds the fast engine's max_len {self.max_len}.")
        x = self.embed[ids]  # [N, H]
        cos, sin = self._rope(pos)
        if self.kernel_attention:
            return self._verify_kernel(x, cos, sin, rows, pos, torch.as_tensor(starts, dtype=torch.long),
                                       torch.as_tensor(lens, dtype=torch.long), want_features)
        chunks = []
        for c0 in range(0, B, self.ATT_CHUNK):
            c1 = min(B, c0 + self.ATT_CHUNK)
            S = max(starts[b] + lens[b] for b in range(c0, c1))
            Tm = max(lens[c0:c1])
            st = torch.as_tensor(starts[c0:c1], dtype=torch.long)
            ln = torch.as_tensor(lens[c0:c1], dtype=torch.long)
            t = torch.arange(Tm)
            # query t of row b (position st_b + t) sees keys 0..st_b + t; padded queries (t >= len_b)
            # see key 0 only (their output is dropped)
            lim = torch.where(t[None] < ln[:, None], st[:, None] + t[None], torch.zeros_like(t[None]))
            valid = (torch.arange(S)[None, None, :] <= lim[:, :, None])[:, None, None]  # [c, 1, 1, Tm, S]
            valid = valid.expand(-1, -1, self.g, -1, -1).reshape(c1 - c0, 1, self.g * Tm, S)  # per query group
            # flat token index -> (row in chunk, query) of the padded layout
            sel_r = rows[offs[c0]:offs[c1]] - c0
            sel_t = qi[offs[c0]:offs[c1]]
            chunks.append((c0, c1, S, Tm, self._additive(valid), sel_r, sel_t))
            self._clear_masked_tail(c0, c1, S)  # masked positions [starts_b + len_b, S)
        caps = [None] * (len(self.capture) + 1) if want_features else None
        for li, p in enumerate(self.layers):
            q = self._attend_inputs(li, p, x, cos, sin, rows, pos)
            outs = []
            for c0, c1, S, Tm, valid, sel_r, sel_t in chunks:
                c = c1 - c0
                qp = q.new_zeros(c, Tm, self.nh, self.hd)
                qp[sel_r, sel_t] = q[offs[c0]:offs[c1]]
                # the g query heads of a KV head as g queries of that head (no K/V expansion for GQA, HF's
                # repeat_kv: KV head i serves query heads i*g .. i*g+g-1): [c, kvh, g * Tm, hd], the mask per group
                qg = qp.view(c, Tm, self.kvh, self.g, self.hd).permute(0, 2, 3, 1, 4).reshape(c, self.kvh, self.g * Tm, self.hd)
                o = F.scaled_dot_product_attention(qg, self.k[li, c0:c1, :, :S], self.v[li, c0:c1, :, :S],
                                                   attn_mask=valid, scale=self.scale)
                o = o.view(c, self.kvh, self.g, Tm, self.hd).permute(0, 3, 1, 2, 4).reshape(c, Tm, self.nh, self.hd)
                outs.append(o[sel_r, sel_t])  # [n_chunk, nh, hd]
            x = self._layer_out(li, p, x, torch.cat(outs, 0).reshape(N, self.nh * self.hd), caps)
        return self._final(x, caps)

    def _verify_kernel(self, x, cos, sin, rows, pos, starts, lens, want_features):
        """``verify``'s layers with ``ops.kv_cache_attention``: every row attends to exactly its
        own keys (no padding, no mask; the cache past a row's positions is never read)."""
        N = x.shape[0]
        caps = [None] * (len(self.capture) + 1) if want_features else None
        for li, p in enumerate(self.layers):
            q = self._attend_inputs(li, p, x, cos, sin, rows, pos)
            o = ops.kv_cache_attention(q, self.k[li], self.v[li], starts, lens, self.scale)
            x = self._layer_out(li, p, x, o.reshape(N, self.nh * self.hd), caps)
        return self._final(x, caps)

    def move_slot(self, src: int, dst: int, length: int):
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.hw[dst] = max(self.hw[dst], length)
