"""CPU-ONLY, TEST-ONLY: bf16 linear layers through oneDNN with prepacked weights.

On a Xeon with AMX, sglang packs every unquantized linear weight once after loading and runs
``sgl_kernel.weight_packed_linear`` (``UnquantizedLinearMethod``: ``use_intel_amx_backend``). On
a CPU without AMX (this project's machines: avx512_bf16 only) it falls back to ``F.linear``,
which re-lays the weight out on every call: a 4-token GEMM then costs ~1.1-1.5x a 1-token GEMV
and the verify of a speculative round pays for it. This stand-in does what sglang's AMX path
does, with the kernel torch ships: ``torch.ops.mkldnn._reorder_linear_weight`` once after
loading, ``torch.ops.mkldnn._linear_pointwise`` per call (SmolLM2-135M, 2 threads, 30 layers:
M = 1 21 -> 15 ms, M = 4 24 -> 16 ms). Every forward uses it, with or without speculation, so
speed ratios compare like with like. bf16 CPU weights only: float32 runs (the exact-equality
tests) keep ``F.linear`` bit for bit. ``SGLANG_DLITE_CPU_PACKED_LINEAR=0`` turns it off. Never
used on a CUDA deployment or where sglang's own AMX path is active.
"""

import os

TARGET_MODULE = "sglang.srt.layers.quantization.unquant"
BATCH_HINT = 4  # oneDNN's layout hint; measured no different from 1 or 64 for M = 1..1024


def enabled() -> bool:
    return os.environ.get("SGLANG_DLITE_CPU_PACKED_LINEAR", "1") not in ("", "0")


def pack(weight):
    """The oneDNN-packed copy of a [out, in] bf16 CPU weight, or None where it does not apply."""
    import torch

    if (weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def packed_linear(x, packed, bias=None):
    """``F.linear(x, weight, bias)`` through the packed weight; x [..., in] bf16."""
    import torch

    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


def patch(module) -> None:
    cls = module.UnquantizedLinearMethod
    if getattr(cls, "_dlite_packed_patched", False) or not enabled():
        return
    orig_after, orig_apply = cls.process_weights_after_loading, cls.apply
    use_amx = getattr(module, "use_intel_amx_backend", lambda layer: False)

    def process_weights_after_loading(self, layer):
        orig_after(self, layer)
        w = getattr(layer, "weight", None)
        if not use_amx(layer):
            packed = pack(w)
            if packed is not None:  # the packed copy is valid for this exact weight tensor version
                layer._dlite_packed = (packed, w.data_ptr(), w._version)

    def apply(self, layer, x, bias=None):
        entry = getattr(layer, "_dlite_packed", None)
        if entry is None or x.dtype != entry[0].dtype:
            return orig_apply(self, layer, x, bias)
        packed, ptr, version = entry
        w = layer.weight
        if w.data_ptr() != ptr or w._version != version:  # weights were updated in place: repack
            packed = pack(w)
            layer._dlite_packed = (packed, w.data_ptr(), w._version)
        return packed_linear(x, packed, bias)

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply
    cls._dlite_packed_patched = True


def install_lazy() -> None:
    from post_import import on_import

    on_import(TARGET_MODULE, patch)
