"""CPU-ONLY, TEST-ONLY: chain verify for sglang's ``torch_native`` attention backend.

``TorchNativeAttnBackend`` has no TARGET_VERIFY mode: ``ForwardBatch.init_new`` leaves
``extend_prefix_lens`` / ``extend_seq_lens`` unset for it. This wraps ``forward_extend`` so that a
TARGET_VERIFY forward writes the W = tokens/requests verify tokens' K/V into their reserved slots
and attends, per request, W queries over the committed prefix (seq_lens) + the verify tokens with
a causal mask: exactly a chain verify. If the verify input carries a draft-only tree mask
(``custom_mask`` of bs*W*W, sglang's NGRAM worker on a CPU device), each verify token instead
sees the prefix + its tree ancestors and itself: a tree verify. (The backend's own extend path
would build a query the length of the whole context, O(context^2) per verify; this is
O(W * context), like decode.) Installed lazily (on first import of the backend) by
``sitecustomize`` in this folder; never used on a CUDA deployment.
"""

import importlib.abc
import sys

TARGET_MODULE = "sglang.srt.layers.attention.torch_native_backend"


def patch(module) -> None:
    cls = module.TorchNativeAttnBackend
    if getattr(cls, "_dlite_verify_patched", False):
        return
    orig = cls.forward_extend
    sdpa = module.scaled_dot_product_attention
    KVWriteLoc = module.KVWriteLoc

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        fb = forward_batch
        if not fb.forward_mode.is_target_verify():
            return orig(self, q, k, v, layer, fb, save_kv_cache)
        import torch

        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        bs = fb.batch_size
        width = q.shape[0] // max(bs, 1)
        hq, hk = layer.tp_q_head_num, layer.tp_k_head_num
        q_ = q.view(-1, hq, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], hq * layer.v_head_dim))
        o_ = o.view(-1, hq, layer.v_head_dim)
        kbuf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vbuf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        r2t = self.req_to_token_pool.req_to_token
        prefixes = fb.seq_lens.tolist()
        rows = fb.req_pool_indices.tolist()
        steps = torch.arange(width)
        tree = _tree_mask(fb, bs, width)
        for i in range(bs):
            pre = int(prefixes[i])
            total = pre + width
            locs = r2t[rows[i], :total]
            kk = kbuf[locs].movedim(0, 1)  # [Hkv, total, D]
            vv = vbuf[locs].movedim(0, 1)
            qq = q_[i * width:(i + 1) * width].movedim(0, 1)  # [Hq, W, D]
            if kk.dtype != qq.dtype:
                kk, vv = kk.to(qq.dtype), vv.to(qq.dtype)
            if tree is None:
                # verify token j sees the committed prefix and verify tokens 0..j (causal chain)
                mask = torch.arange(total)[None, :] <= (pre + steps)[:, None]
            else:
                # tree verify (NGRAM): the committed prefix + the node's ancestors and itself
                mask = torch.cat([torch.ones(width, pre, dtype=torch.bool), tree[i]], dim=1)
            out = sdpa(qq[None], kk[None], vv[None], attn_mask=mask, scale=layer.scaling,
                       enable_gqa=hq != hk)
            o_[i * width:(i + 1) * width] = out[0].movedim(0, 1)
        return o

    cls.forward_extend = forward_extend
    cls._dlite_verify_patched = True


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


class _PostImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def install_lazy() -> None:
    mod = sys.modules.get(TARGET_MODULE)
    if mod is not None:
        patch(mod)
    elif not any(isinstance(f, _PostImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport())
