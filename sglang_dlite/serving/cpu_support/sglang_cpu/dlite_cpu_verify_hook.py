"""CPU-ONLY, TEST-ONLY: chain verify for sglang's ``torch_native`` attention backend.

``TorchNativeAttnBackend`` has no TARGET_VERIFY mode: ``ForwardBatch.init_new`` leaves
``extend_prefix_lens`` / ``extend_seq_lens`` unset for it. This wraps ``forward_extend`` so that a
TARGET_VERIFY forward writes the W = tokens/requests verify tokens' K/V into their reserved slots
and attends, per request, W queries over the committed prefix (seq_lens) + the verify tokens with
a causal mask: exactly a chain verify. If the verify input carries a draft-only tree mask
(``custom_mask`` of bs*W*W, sglang's NGRAM worker on a CPU device), each verify token instead
sees the prefix + its tree ancestors and itself: a tree verify. (The backend's own extend path
would build a query the length of the whole context, O(context^2) per verify; this is
O(W * context), like decode.) The KV index and masks are planned once per forward (the first
layer): a batch of similar contexts attends as one padded batch (``attend_padded``: one ``sdpa`` per
layer); otherwise request by request, a request whose slots are one contiguous run read as a view
of the pool, not gathered; grouped-query heads are folded into the query (``attend``).
sglang's EAGLE3 draft extend (``DRAFT_EXTEND_V2``: every request extends its draft KV by the same W
tokens) takes the same path with a causal mask, instead of the backend's O(context^2) extend.
The setting ``cpu_attention: "same"`` gives sglang's plain DECODE forward the same attention and its prefill
(EXTEND / MIXED) forwards ``attend_prefill``, for like-for-like speed comparisons
(``cpu_attention_enabled``): the backend's own prefill pads every request's query to its whole context,
so a request that hits the radix cache with 1 000 tokens and brings 200 new ones pays for 1 200
queries; ``attend_prefill`` computes the 200 (~3x less attention at that split on a 2-core CPU).
Installed lazily (on first import of the backend) by ``sitecustomize`` in this folder; never used on
a CUDA deployment.
"""

TARGET_MODULE = "sglang.srt.layers.attention.torch_native_backend"


def patch(module) -> None:
    cls = module.TorchNativeAttnBackend
    if getattr(cls, "_dlite_verify_patched", False):
        return
    orig_extend, orig_decode = cls.forward_extend, cls.forward_decode
    KVWriteLoc = module.KVWriteLoc
    ours = cpu_attention_enabled()  # read once, in the scheduler process at start-up

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        fb = forward_batch
        if fb.forward_mode.is_target_verify():
            return _attend_blocks(self, q, k, v, layer, fb, save_kv_cache, KVWriteLoc, decode=False)
        if fb.forward_mode.is_draft_extend_v2() and _is_block_extend(fb, q):
            return _attend_blocks(self, q, k, v, layer, fb, save_kv_cache, KVWriteLoc, decode=False,
                                  draft_extend=True)
        if ours and fb.forward_mode.name in ("EXTEND", "MIXED") and _plain_causal(layer, fb):
            return _attend_prefill(self, q, k, v, layer, fb, save_kv_cache, KVWriteLoc)
        return orig_extend(self, q, k, v, layer, fb, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        fb = forward_batch
        if not ours or not _plain_causal(layer, fb):
            return orig_decode(self, q, k, v, layer, fb, save_kv_cache)
        return _attend_blocks(self, q, k, v, layer, fb, save_kv_cache, KVWriteLoc, decode=True)

    cls.forward_extend = forward_extend
    cls.forward_decode = forward_decode
    cls._dlite_verify_patched = True


def cpu_attention_enabled() -> bool:
    """The setting ``cpu_attention: "same"``: sglang's own DECODE forward (no speculation) also reads the KV
    cache through ``attend`` below instead of the backend's per-layer gather, and every prefill
    attends through ``attend_prefill``, so a speculative vs no-speculation comparison on a CPU
    measures the same attention code on both sides. Off by default: forwards other than DLITE's
    verify then run exactly as sglang ships them."""
    from sglang_dlite.settings import ServingOptions

    return ServingOptions.from_env().cpu_attention == "same"


def _plain_causal(layer, fb) -> bool:
    """A causal self-attention layer over the whole context: what ``attend`` / ``attend_prefill``
    compute (cross attention, encoder-only layers and sliding windows stay on the backend)."""
    return (not layer.is_cross_attention and fb.encoder_lens is None
            and getattr(getattr(layer, "attn_type", None), "name", "DECODER") == "DECODER"
            and (layer.sliding_window_size is None or layer.sliding_window_size <= -1))


PREFILL_QUERY_BLOCK = 512
"""``attend_prefill`` attends a request's new tokens this many queries at a time, each block over the
keys it can see (its prefix + the new tokens up to the block's end): the masked-out corner is never
computed beyond one block, and a block's additive mask stays small (512 x context) however long
the chunk; ~2x faster than one call at 2 048 cached + 2 048 new tokens on this CPU."""


def attend_prefill(q, kk, vv, prefix, scale, kv_heads):
    """One request's prefill: q [n, Hq, D], its n new tokens at positions prefix .. prefix + n - 1;
    kk / vv [prefix + n, Hkv, D] its whole context, new tokens last -> [n, Hq, Dv], new token j
    attending to positions 0 .. prefix + j (the causal mask of a prefill that continues a cached
    prefix). No cached prefix: one causal ``sdpa`` (its kernel skips the masked half); else blocks of
    ``PREFILL_QUERY_BLOCK`` queries with a bottom-right causal mask each."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    n = q.shape[0]
    qq, kt, vt = q.movedim(0, 1), kk.movedim(0, 1), vv.movedim(0, 1)  # [H, tokens, D]
    if kt.dtype != qq.dtype:
        kt, vt = kt.to(qq.dtype), vt.to(qq.dtype)
    gqa = q.shape[1] != kv_heads
    if prefix == 0:
        return sdpa(qq[None], kt[None], vt[None], is_causal=True, scale=scale, enable_gqa=gqa)[0].movedim(0, 1)
    out = q.new_empty((q.shape[1], n, vt.shape[-1]))
    for s in range(0, n, PREFILL_QUERY_BLOCK):
        e = min(n, s + PREFILL_QUERY_BLOCK)
        cols = prefix + e
        allowed = torch.arange(cols)[None, :] <= torch.arange(prefix + s, prefix + e)[:, None]
        mask = torch.zeros(allowed.shape, dtype=qq.dtype).masked_fill_(~allowed, float("-inf"))
        out[:, s:e] = sdpa(qq[None, :, s:e], kt[None, :, :cols], vt[None, :, :cols], attn_mask=mask, scale=scale,
                           enable_gqa=gqa)[0]
    return out.movedim(0, 1)


def _attend_prefill(self, q, k, v, layer, fb, save_kv_cache, KVWriteLoc):
    """Write the new tokens' K/V, then attend each request's new tokens over its cached prefix and
    themselves (``attend_prefill``), request by request."""
    _write_new_kv(self, layer, fb, k, v, save_kv_cache, KVWriteLoc)
    hq, hk = layer.tp_q_head_num, layer.tp_k_head_num
    q_ = q.reshape(-1, hq, layer.qk_head_dim)
    o = q.new_empty((q_.shape[0], hq * layer.v_head_dim))
    o_ = o.view(-1, hq, layer.v_head_dim)
    kbuf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    vbuf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
    r2t = self.req_to_token_pool.req_to_token
    prefixes = fb.extend_prefix_lens_cpu if fb.extend_prefix_lens_cpu is not None else fb.extend_prefix_lens.tolist()
    news = fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu is not None else fb.extend_seq_lens.tolist()
    start = 0
    for row, pre, n in zip(fb.req_pool_indices.tolist(), prefixes, news):
        pre, n = int(pre), int(n)
        kk, vv = context_kv(kbuf, vbuf, contiguous_run(r2t[row, :pre + n]))
        o_[start:start + n] = attend_prefill(q_[start:start + n], kk, vv, pre, layer.scaling, hk)
        start += n
    return o


PADDED_BATCH_LIMIT = 1.5
"""Requests attend in one padded batch (one ``sdpa`` per layer, not one per request) when the padded
context, batch size x the longest context, is at most this many times the contexts' sum: ~1.8x
faster attention per verify at 16 requests of ~1k tokens on a 2-core CPU; a very ragged batch would
spend more on padding than it saves, and runs request by request."""


class _Plan:
    """What every layer of one forward shares: per request the KV-pool index of its context
    (a ``slice`` when the request's slots are one contiguous run, as they are for a request that
    allocated its slots in order; else the slot tensor) and its attention mask; for a batch of
    similar contexts, the padded batch's KV index and mask instead. Built once per forward (the
    first layer), not once per layer; masks are additive, in the query's dtype (``sdpa`` would
    convert a bool mask at every call)."""

    def __init__(self, fb, bs, width, r2t, tree, decode, draft_extend=False):
        import torch

        self.key = (fb, fb.seq_lens, fb.req_pool_indices, fb.out_cache_loc)
        prefixes = fb.seq_lens.tolist()
        rows = fb.req_pool_indices.tolist()
        self.kv, self.masks, self._additive = [], [], {}
        steps = torch.arange(width)
        # decode: seq_lens counts the new token; draft extend: it counts the W new tokens
        pres = [int(p) - (1 if decode else width if draft_extend else 0) for p in prefixes]
        totals = [p + width for p in pres]
        tmax = max(totals, default=0)
        self.padded = bs > 1 and bs * tmax <= PADDED_BATCH_LIMIT * sum(totals)
        if self.padded:  # one [bs, tmax] KV index (padding reads slot 0, masked out) and one mask
            index = torch.zeros(bs, tmax, dtype=torch.int64)
            allowed = torch.zeros(bs, width, tmax, dtype=torch.bool)
        for i in range(bs):
            pre, total = pres[i], totals[i]
            locs = r2t[rows[i], :total]
            if tree is not None:  # tree verify: the committed prefix + the node's ancestors and itself
                mask = torch.cat([torch.ones(width, pre, dtype=torch.bool), tree[i]], dim=1)
            elif not decode:  # chain: verify token j sees the committed prefix and verify tokens 0..j
                mask = torch.arange(total)[None, :] <= (pre + steps)[:, None]
            else:  # decode: the one new token sees everything
                mask = None
            if self.padded:
                index[i, :total] = locs
                allowed[i, :, :total] = True if mask is None else mask
            else:
                self.kv.append(contiguous_run(locs))
                self.masks.append(mask)
        if self.padded:
            self.index, self.allowed, self.tmax = index.view(-1), allowed, tmax

    def matches(self, fb) -> bool:
        return all(a is b for a, b in zip(self.key, (fb, fb.seq_lens, fb.req_pool_indices, fb.out_cache_loc)))

    def additive_mask(self, i, groups, dtype):
        """Request i's mask (``i=None``: the padded batch's, [bs, 1, g*W, tmax]) repeated for the
        ``groups`` query heads that share a KV head, as 0 / -inf in ``dtype``; None: no mask."""
        import torch

        key = (i, groups, dtype)
        if key not in self._additive:
            m = self.allowed[:, None] if i is None else self.masks[i]  # [bs, 1, W, tmax] / [W, T] bool, or None
            if m is not None:  # the W rows tiled per query head of the group: rows (head, token), as attend folds q
                m = m.repeat(*[1] * (m.dim() - 2), groups, 1)
                m = torch.zeros(m.shape, dtype=dtype).masked_fill_(~m, float("-inf"))
            self._additive[key] = m
        return self._additive[key]


_plan_cache = [None]


def contiguous_run(locs):
    """``slice(first, first + n)`` when the slot ids are consecutive (a view, no copy), else the
    slot ids as an int64 index tensor (for ``index_select``)."""
    import torch

    n = locs.numel()
    if n == 0:
        return slice(0, 0)
    first = int(locs[0])
    if int(locs[-1]) - first == n - 1 and (n == 1 or bool((locs[1:] - locs[:-1] == 1).all())):
        return slice(first, first + n)
    return locs.to(torch.int64)


def context_kv(kbuf, vbuf, idx):
    """A request's keys and values from the pool: a view for a ``slice`` (``contiguous_run``), else
    ``index_select`` (~3x faster than advanced indexing, ``kbuf[idx]``, on a CPU)."""
    if isinstance(idx, slice):
        return kbuf[idx], vbuf[idx]
    return kbuf.index_select(0, idx), vbuf.index_select(0, idx)


def _write_new_kv(self, layer, fb, k, v, save_kv_cache, KVWriteLoc):
    """The forward's new tokens' K/V into their slots (``out_cache_loc``), as the backend does."""
    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc), k, v)


def attend(q, kk, vv, mask, scale, kv_heads):
    """One request: q [W, Hq, D], kk / vv [T, Hkv, D] (the context's keys / values, verify tokens
    last), mask [Hq/Hkv * W, T] (bool or additive: the W-row mask repeated per query head of a KV head) or None
    -> [W, Hq, Dv]. Grouped-query heads are folded into the query length (one KV head serves
    Hq/Hkv * W query rows), so each KV head's context is read once, not once per query head."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    width, hq, d = q.shape
    groups = hq // kv_heads
    qq = q.movedim(0, 1).reshape(kv_heads, groups * width, d)  # [Hkv, g*W, D], rows (head, token)
    if kk.dtype != qq.dtype:
        kk, vv = kk.to(qq.dtype), vv.to(qq.dtype)
    out = sdpa(qq[None], kk.movedim(0, 1)[None], vv.movedim(0, 1)[None], attn_mask=mask, scale=scale)
    return out[0].reshape(hq, width, -1).movedim(0, 1)


def attend_padded(q, kbuf, vbuf, plan, scale, kv_heads):
    """Every request at once: q [bs*W, Hq, D]; the plan's padded KV index and mask -> [bs, W, Hq, Dv].
    Grouped-query heads folded into the query as in ``attend``."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    n, hq, d = q.shape
    bs = plan.allowed.shape[0]
    width, groups = n // bs, hq // kv_heads
    qq = q.view(bs, width, hq, d).transpose(1, 2).reshape(bs, kv_heads, groups * width, d)
    kk = kbuf.index_select(0, plan.index).view(bs, plan.tmax, kv_heads, -1).transpose(1, 2)
    vv = vbuf.index_select(0, plan.index).view(bs, plan.tmax, kv_heads, -1).transpose(1, 2)
    if kk.dtype != qq.dtype:
        kk, vv = kk.to(qq.dtype), vv.to(qq.dtype)
    out = sdpa(qq, kk, vv, attn_mask=plan.additive_mask(None, groups, qq.dtype), scale=scale)
    return out.reshape(bs, hq, width, -1).transpose(1, 2)


def _is_block_extend(fb, q) -> bool:
    """An EAGLE draft extend (``DRAFT_EXTEND_V2``) in the block layout ``_attend_blocks`` reads: every
    request extends by the same W tokens right after its prefix, and ``seq_lens`` counts them."""
    bs = fb.batch_size
    lens, prefixes = fb.extend_seq_lens, fb.extend_prefix_lens
    if bs < 1 or lens is None or prefixes is None or q.shape[0] % bs:
        return False
    width = q.shape[0] // bs
    return bool((lens == width).all()) and bool((prefixes + width == fb.seq_lens.to(prefixes.dtype)).all())


def _attend_blocks(self, q, k, v, layer, fb, save_kv_cache, KVWriteLoc, decode, draft_extend=False):
    """Write the new tokens' K/V, then attend each request's W = tokens/requests queries over its
    context (committed prefix + its own new tokens)."""
    _write_new_kv(self, layer, fb, k, v, save_kv_cache, KVWriteLoc)
    bs = fb.batch_size
    hq, hk = layer.tp_q_head_num, layer.tp_k_head_num
    q_ = q.reshape(-1, hq, layer.qk_head_dim)
    width = q_.shape[0] // max(bs, 1)
    o = q.new_empty((q_.shape[0], hq * layer.v_head_dim))
    o_ = o.view(-1, hq, layer.v_head_dim)
    plan = _plan_cache[0]
    if plan is None or not plan.matches(fb):
        tree = None if decode or draft_extend else _tree_mask(fb, bs, width)
        plan = _plan_cache[0] = _Plan(fb, bs, width, self.req_to_token_pool.req_to_token, tree, decode, draft_extend)
    kbuf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    vbuf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
    groups = hq // hk
    if plan.padded:
        o_.view(bs, width, hq, -1).copy_(attend_padded(q_, kbuf, vbuf, plan, layer.scaling, hk))
        return o
    for i in range(bs):
        rows = slice(i * width, (i + 1) * width)
        kk, vv = context_kv(kbuf, vbuf, plan.kv[i])
        o_[rows] = attend(q_[rows], kk, vv, plan.additive_mask(i, groups, q_.dtype), layer.scaling, hk)
    return o


def _tree_mask(fb, bs, width):
    """NGRAM's draft-only tree mask as [bs, W, W] bool (row i: node i's ancestors and itself), or
    None for a chain verify. On a CPU device sglang's NGRAM worker keeps the QLEN-style mask
    (``ngram_worker.py``: the full prefix+tree mask is built only when not ``is_cpu``)."""
    import torch

    spec = getattr(fb, "spec_info", None)
    cm = getattr(spec, "custom_mask", None)
    if cm is None:
        return None
    if cm.numel() != bs * width * width:
        raise NotImplementedError(
            f"CPU verify hook: custom_mask of {cm.numel()} elements, expected the draft-only "
            f"tree mask of bs*W*W = {bs * width * width}")
    return cm.reshape(bs, width, width).to(dtype=torch.bool, device="cpu")


def install_lazy() -> None:
    from post_import import on_import

    on_import(TARGET_MODULE, patch)
