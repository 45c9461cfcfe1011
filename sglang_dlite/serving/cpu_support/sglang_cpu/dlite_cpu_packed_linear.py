"""CPU-ONLY, TEST-ONLY: bf16 linear layers through oneDNN with prepacked weights.

On a Xeon with AMX, sglang packs every unquantized linear weight once after loading and runs
``sgl_kernel.weight_packed_linear`` (``UnquantizedLinearMethod``: ``use_intel_amx_backend``). On
a CPU without AMX (this project's machines: avx512_bf16 only) it falls back to ``F.linear``,
which re-lays the weight out on every call: a 4-token GEMM then costs ~1.1-1.5x a 1-token GEMV
and the verify of a speculative round pays for it. This stand-in does what sglang's AMX path
does, with the kernel torch ships (``sglang_dlite.ops.cpu_linear``, which packs the drafter's
layers the same way): ``torch.ops.mkldnn._reorder_linear_weight`` once after loading,
``torch.ops.mkldnn._linear_pointwise`` per call (SmolLM2-135M, 2 threads, 30 layers:
M = 1 21 -> 15 ms, M = 4 24 -> 16 ms). Every forward uses it, with or without speculation, so
speed ratios compare like with like. bf16 CPU weights only: float32 runs (the exact-equality
tests) keep ``F.linear`` bit for bit. The setting ``cpu_packed_linear: false`` turns it off. Never
used on a CUDA deployment or where sglang's own AMX path is active.
"""

TARGET_MODULE = "sglang.srt.layers.quantization.unquant"


def enabled() -> bool:
    from sglang_dlite.settings import ServingOptions

    return ServingOptions.from_env().cpu_packed_linear


def patch(module) -> None:
    cls = module.UnquantizedLinearMethod
    if getattr(cls, "_dlite_packed_patched", False) or not enabled():
        return
    from sglang_dlite.ops.cpu_linear import can_pack, packed_for, packed_linear  # the drafter's packing too

    orig_after, orig_apply = cls.process_weights_after_loading, cls.apply
    use_amx = getattr(module, "use_intel_amx_backend", lambda layer: False)

    def process_weights_after_loading(self, layer):
        orig_after(self, layer)
        w = getattr(layer, "weight", None)
        if not use_amx(layer) and can_pack(w):
            packed_for(layer, w)  # packed once, at load
            layer._dlite_use_packed = True

    def apply(self, layer, x, bias=None):
        w = layer.weight
        if not getattr(layer, "_dlite_use_packed", False) or x.dtype != w.dtype:
            return orig_apply(self, layer, x, bias)
        return packed_linear(x, packed_for(layer, w), bias)  # repacked if the weight was updated

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply
    cls._dlite_packed_patched = True


def install_lazy() -> None:
    from post_import import on_import

    on_import(TARGET_MODULE, patch)
