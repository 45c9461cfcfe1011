"""CPU-ONLY, TEST-ONLY stand-in for sglang's ``sgl_kernel`` CPU build (not on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` a few sglang modules import these names at module level. This
pure-torch version provides the three that a Llama/Qwen3 target with chain verify needs and
registers no ``torch.ops.sgl_kernel`` ops, so sglang's layers take their native torch paths.

It lives under ``cpu_support/sglang_cpu`` and is put on ``PYTHONPATH`` only by the test fixtures
and the CPU demo (``sglang_dlite.commands.demo``). A CUDA deployment never sees it: there the real
``sglang-kernel`` wheel provides ``sgl_kernel``.
"""

import torch

__version__ = "0.0.0+dlite-cpu-standin"
IS_DLITE_CPU_STANDIN = True


def _segments(start_offset, end_offset):
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    out = 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        n = int(e) - int(s)
        yield i, int(s), int(e), out, n
        out += max(n, 0)


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len=None):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[packed segment i]."""
    rows = req_pool_indices.tolist()
    for i, s, e, o, n in _segments(start_offset, end_offset):
        if n > 0:
            req_to_token[rows[i], s:e] = out_cache_loc[o:o + n].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len=None):
    """out_cache_loc[packed segment i] = req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    rows = req_pool_indices.tolist()
    for i, s, e, o, n in _segments(start_offset, end_offset):
        if n > 0:
            out_cache_loc[o:o + n] = req_to_token[rows[i], s:e].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every layer buffer (raw pointer + row stride in bytes): row tgt_loc[i] = row src_loc[i].

    sglang calls it at KV-pool warm-up and for KV moves; plain memmove per row (CPU memory).
    """
    import ctypes

    ptrs = [int(p) for p in data_ptrs.tolist()]
    strd = [int(s) for s in strides.tolist()]
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for ptr, st in zip(ptrs, strd):
        for t, s in pairs:
            if t != s:
                ctypes.memmove(ptr + int(t) * st, ptr + int(s) * st, st)


def assign_draft_cache_locs_contiguous_cpu(*args, **kwargs):
    raise NotImplementedError("draft KV cache locations: not used by DLITE (no draft KV).")


def __getattr__(name):
    """Any other kernel name imports (sglang imports many at module level) but fails if called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the DLite CPU test stand-in "
            f"(cpu_support/sglang_cpu/sgl_kernel); it covers Llama/Qwen3 targets with DLITE only."
        )

    missing.__name__ = name
    return missing
