"""CPU-ONLY, TEST-ONLY stand-in for sglang's ``sgl_kernel`` CPU build (not on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` a few sglang modules import these names at module level. This
pure-torch version provides the three that a Llama/Qwen3 target with chain verify needs (plus
``verify_tree_greedy_cpu`` and ``speculative.reconstruct_indices_from_tree_mask`` for sglang's own
NGRAM algorithm) and registers no ``torch.ops.sgl_kernel`` ops, so sglang's layers take their
native torch paths.

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


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy tree verify (sglang NGRAM/EAGLE on a CPU device), in place, following sglang's
    ``verify_tree_greedy_kernel_triton`` (``kernels/ops/speculative/spec_tree.py``): walk the tree
    from the root; at each level accept the first child (then its siblings in order) whose draft
    token equals the target's argmax at the last accepted node; stop when none does. Writes
    ``predicts[accepted node] = target token``, ``accept_index[b, 0..m]`` (flat node indices),
    ``accept_token_num[b] = m`` and the bonus token at the last accepted node."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    ridx = retrive_index.reshape(bs, n).tolist()
    nxt = retrive_next_token.reshape(bs, n).tolist()
    sib = retrive_next_sibling.reshape(bs, n).tolist()
    tgt = target_predict.reshape(-1).tolist()
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        num, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            target = tgt[last]
            found = False
            while cur != -1:
                if cand[b][cur] == target:
                    predicts[last] = target
                    num += 1
                    accept_index[b, num] = ridx[b][cur]
                    last = ridx[b][cur]
                    found = True
                    break
                cur = sib[b][cur]
            if not found:
                break
        accept_token_num[b] = num
        predicts[last] = tgt[last]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Pack ``out_cache_loc[a]`` for the accepted entries ``a != -1`` of ``accept_index`` (row-major)
    to the front of ``accept_out_cache_loc`` (sglang ``fill_accept_out_cache_loc``, ``eagle.py``)."""
    ai = accept_index.reshape(-1).to(torch.int64)
    src = ai[ai != -1]
    accept_out_cache_loc[: src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """``bonus_tokens[i] = accept_tokens[accept_stride * i + accept_lens[i] - 1]``
    (sglang ``fill_bonus_tokens``, ``eagle.py``)."""
    bs = accept_lens.numel()
    idx = torch.arange(bs, dtype=torch.int64) * int(accept_stride) + accept_lens.to(torch.int64) - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


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
