"""Draft-step ops behind one dispatcher.

Each op has a torch reference in ``reference.py`` (the spec); compiled kernels from ``csrc/``
(C++ for the CPU, CUDA for Ampere/Hopper; built by ``make build-ext``) replace it when available.

``set_ops_mode`` picks the path (the serving setting ``ops``; ``using_ops`` for a block):
    auto   (default) CUDA kernel for CUDA tensors, C++ kernel for CPU tensors (except where the
           reference measured faster: ``CPU_TORCH_FASTER_BELOW``), else the reference
    torch  always the torch reference
    cpp    the C++ CPU kernels (error if not built, or if the tensors are not on the CPU)
    cuda   the CUDA kernels (error if not built with CUDA, or if the tensors are not on a GPU)

Autograd: the compiled ops have no backward. Any call that needs a gradient (grad mode on and an
input requiring grad) runs the torch reference, whatever the mode, so training is unaffected.
In ``auto`` mode, inputs the kernels do not take (mixed or non-float dtypes) also use the reference.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from sglang_dlite.errors import DLiteInputError, MissingDependencyError
from sglang_dlite.ops import _ext, limits
from sglang_dlite.ops.cpu_linear import cpu_has_native_bf16, pack_cpu_linears  # noqa: F401  (re-exported)
from sglang_dlite.ops import reference as _ref
from sglang_dlite.ops.reference import (  # noqa: F401  (re-exported: the model uses these helpers directly)
    apply_rope,
    rms_norm,
    rope_cos_sin,
    round_attention_mask,
    round_positions,
)

MODES = ("auto", "torch", "cpp", "cuda")
_mode = "auto"  # the path every op takes (set_ops_mode)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_last_impl: dict = {}

# Where torch's own kernels beat the C++ CPU kernel, ``auto`` takes the reference: (op, dtype) ->
# the row count below which torch is faster. bf16 lm_head_argmax at SmolLM2's shapes (V=49152,
# H=576), 1 thread, C++/torch time, three runs of bench/lm_head_dispatch.py: 1 row 1.17/1.02/1.01x
# (even), 2 rows 0.66/0.65x, 4 rows 0.54/0.53/0.55x, 7 rows (batch 1, K=7) 0.49/0.54/0.49x, 14-56
# rows 0.99-1.01x. fp32: the C++ kernel at every row count (0.39-0.95x; it was 3-7x slower than
# torch until its weight prefetch stopped using the non-temporal hint).
CPU_TORCH_FASTER_BELOW = {("lm_head_argmax", torch.bfloat16): 2}


def set_ops_mode(mode: str) -> str:
    """The path every op takes from now on, in this process (one of ``MODES``); returns the one before."""
    global _mode
    m = str(mode).strip().lower() or "auto"
    if m not in MODES:
        raise DLiteInputError(f"ops mode {mode!r} is not understood; use one of {', '.join(MODES)}.")
    prev, _mode = _mode, m
    return prev


def ops_mode() -> str:
    return _mode


@contextmanager
def using_ops(mode: str):
    """``set_ops_mode(mode)`` for the block, the mode before it restored after."""
    prev = set_ops_mode(mode)
    try:
        yield
    finally:
        set_ops_mode(prev)


def last_impl(op: str):
    """Which path ('torch', 'cpp' or 'cuda') the last call of ``op`` took (tests, benchmarks)."""
    return _last_impl.get(op)


def available_impls() -> list:
    """Paths usable in this process: always 'torch', plus 'cpp' / 'cuda' when built."""
    out = ["torch"]
    if _ext.has_cpu():
        out.append("cpp")
    if _ext.has_cuda():
        out.append("cuda")
    return out


def build_status() -> str:
    """One line for logs and benchmark reports: which compiled ops are loaded, or why none are."""
    return _ext.status()


def torch_faster_on_cpu(op: str, dtype: torch.dtype, rows: int) -> bool:
    """Whether ``auto`` runs the torch reference instead of the C++ CPU kernel for this call."""
    return rows < CPU_TORCH_FASTER_BELOW.get((op, dtype), 0)


def _pick(op: str, floats, device: torch.device, rows: int = 0) -> str:
    mode = ops_mode()
    if mode == "torch":
        return "torch"
    if torch.is_grad_enabled() and any(t.requires_grad for t in floats):
        return "torch"  # no backward in the compiled ops: autograd through the reference
    if mode == "auto":
        dt = floats[0].dtype
        if dt not in _FLOATS or any(t.dtype != dt for t in floats):
            return "torch"
        if device.type == "cuda" and _ext.has_cuda():
            return "cuda"
        if device.type == "cpu" and _ext.has_cpu():
            return "torch" if torch_faster_on_cpu(op, dt, rows) else "cpp"
        return "torch"
    if mode == "cpp":
        if not _ext.has_cpu():
            raise MissingDependencyError(
                f"ops mode cpp but the C++ ops are unavailable ({_ext.unavailable_reason()}); "
                f"{_ext.BUILD_HINT}, or use ops mode auto or torch."
            )
        if device.type != "cpu":
            raise DLiteInputError(
                f"ops mode cpp runs CPU kernels, but {op} got tensors on {device}; "
                f"use ops mode cuda or auto for GPU tensors."
            )
        return "cpp"
    # mode == "cuda"
    if not torch.cuda.is_available():
        raise MissingDependencyError(f"ops mode cuda but torch sees no CUDA device (torch {torch.__version__}).")
    if not _ext.has_cuda():
        raise MissingDependencyError(
            "ops mode cuda but the CUDA ops are not built: build them on a CUDA machine with "
            "`make build-ext` (needs a CUDA torch and nvcc), or use ops mode auto or torch."
        )
    if device.type != "cuda":
        raise DLiteInputError(f"ops mode cuda runs GPU kernels, but {op} got tensors on {device}.")
    return "cuda"


def _run(op: str, floats, ref_fn, args, rows: int = 0, impl: str | None = None):
    impl = impl or _pick(op, floats, floats[0].device, rows)
    _last_impl[op] = impl
    if impl == "torch":
        return ref_fn(*args)
    return getattr(torch.ops.sglang_dlite, op)(*args)


def assemble_round_inputs(context_hidden, anchor_embeds, ctx_norm_weight, depth_embed, mask_embed,
                          block_size: int, eps: float):
    args = (context_hidden, anchor_embeds, ctx_norm_weight, depth_embed, mask_embed, int(block_size), float(eps))
    return _run("assemble_round_inputs", args[:5], _ref.assemble_round_inputs, args)


def round_attention(q, k, v, cos, sin, context_valid, num_layers: int, block_size: int, causal: bool):
    args = (q, k, v, cos, sin, context_valid, int(num_layers), int(block_size), bool(causal))
    impl = _pick("round_attention", (q, k, v), q.device)
    if impl == "cuda" and q.dim() == 4:
        rows, head_dim = q.shape[1], q.shape[3]
        limit = limits.device_smem_optin(q.device)
        if limits.round_attention_plan(rows, head_dim, limit) is None:
            if ops_mode() == "auto":
                impl = "torch"  # the kernel cannot stage even 32 keys of this head size here
            else:
                raise DLiteInputError(
                    f"round_attention: a round of {rows} rows with head_dim {head_dim} needs "
                    f"{limits.round_attention_smem_bytes(min(rows, limits.WARP), head_dim)} B of shared memory "
                    f"per block even in 32-key tiles; this GPU allows {limit} B. "
                    f"Use ops mode auto (falls back to torch) or torch.")
    return _run("round_attention", (q, k, v), _ref.round_attention, args, impl=impl)


def lowrank_rnn_scan(gate_logits, inputs):
    return _run("lowrank_rnn_scan", (gate_logits, inputs), _ref.lowrank_rnn_scan, (gate_logits, inputs))


def lm_head_argmax(hidden, norm_weight, eps: float, lm_head_weight):
    """Greedy drafting's final norm + vocabulary projection + argmax (fused in C++/CUDA)."""
    args = (hidden, norm_weight, float(eps), lm_head_weight)
    rows = hidden.numel() // max(hidden.shape[-1], 1)
    return _run("lm_head_argmax", (hidden, norm_weight, lm_head_weight), _ref.lm_head_argmax, args, rows)


def kv_cache_attention(q, k_cache, v_cache, starts, lens, scale: float):
    """The fast regeneration engine's decode / verify attention over its static KV cache (see
    ``reference.kv_cache_attention``). The C++ kernel takes float32 CPU tensors, head_dim a multiple
    of 16 up to 256; ``auto`` runs the reference for anything else, or when the loaded library
    predates the op."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise DLiteInputError(
            f"kv_cache_attention: q must be [N, Hq, D] and both caches [slots, Hkv, L, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}.")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1]:
        raise DLiteInputError(
            f"kv_cache_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} "
            "(head_dim must match, query heads a multiple of KV heads).")
    if starts.shape != lens.shape or starts.dim() != 1 or len(starts) > k_cache.shape[0]:
        raise DLiteInputError(
            f"kv_cache_attention: starts {tuple(starts.shape)} and lens {tuple(lens.shape)} must be [B], "
            f"B <= {k_cache.shape[0]} slots.")
    if int(lens.sum()) != q.shape[0] or bool((lens < 1).any()) or bool((starts + lens > k_cache.shape[2]).any()) \
            or bool((starts < 0).any()):
        raise DLiteInputError(
            f"kv_cache_attention: lens must be >= 1 and sum to q's {q.shape[0]} tokens, and every "
            f"row must end within the cache's {k_cache.shape[2]} positions (starts {starts.tolist()}, "
            f"lens {lens.tolist()}).")
    args = (q, k_cache, v_cache, starts, lens, float(scale))
    floats = (q, k_cache, v_cache)
    impl = _pick("kv_cache_attention", floats, q.device)
    if impl == "cpp" and ops_mode() == "auto" and not _kv_kernel_takes(q.dtype, q.shape[2]):
        impl = "torch"
    _last_impl["kv_cache_attention"] = impl
    if impl == "cuda":
        raise DLiteInputError("kv_cache_attention has no CUDA kernel (it serves the CPU regeneration engine); "
                              "use ops mode auto or torch.")
    if impl == "torch":
        return _ref.kv_cache_attention(*args)
    return torch.ops.sglang_dlite.kv_cache_attention(*args)


def kv_cache_attention_kernel_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``kv_cache_attention`` would run the C++ kernel for CPU tensors of this kind."""
    return ops_mode() in ("auto", "cpp") and _kv_kernel_takes(dtype, head_dim)


def _kv_kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """What the C++ kernel accepts (float32, head_dim a multiple of 16 up to 256) and that the
    loaded library has it."""
    return dtype == torch.float32 and head_dim % 16 == 0 and 16 <= head_dim <= 256 \
        and _ext.has_op("kv_cache_attention")


def nvtx_range(name: str):
    """An NVTX range (visible in nsys timelines) on CUDA builds; a no-op context otherwise."""
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return nullcontext()
