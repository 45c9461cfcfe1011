"""CPU-ONLY, TEST-ONLY: chain verify for sglang's ``torch_native`` attention backend.

``TorchNativeAttnBackend`` has no TARGET_VERIFY mode: ``ForwardBatch.init_new`` leaves
``extend_prefix_lens`` / ``extend_seq_lens`` unset for it. This wraps ``forward_extend`` so that a
TARGET_VERIFY forward is run as an extend of the W = tokens/requests verify tokens per request
on top of the committed prefix (prefix = seq_lens, extend = W, kv = seq_lens + W), with the usual
causal mask: exactly a chain verify. Installed lazily (on first import of the backend) by
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

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        fb = forward_batch
        if not fb.forward_mode.is_target_verify():
            return orig(self, q, k, v, layer, fb, save_kv_cache)
        import torch

        bs = fb.batch_size
        width = q.shape[0] // max(bs, 1)
        saved = (fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens)
        prefix = fb.seq_lens
        fb.extend_prefix_lens = prefix
        fb.extend_seq_lens = torch.full_like(prefix, width)
        fb.seq_lens = prefix + width
        try:
            return orig(self, q, k, v, layer, fb, save_kv_cache)
        finally:
            fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens = saved

    cls.forward_extend = forward_extend
    cls._dlite_verify_patched = True


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
