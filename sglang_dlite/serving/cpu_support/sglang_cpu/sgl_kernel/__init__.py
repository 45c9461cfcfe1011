"""CPU-ONLY, TEST-ONLY stand-in for sglang's ``sgl_kernel`` CPU build (not on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` a few sglang modules import these names at module level. This
pure-torch version provides the three that a Llama/Qwen3 target with chain verify needs (plus
``verify_tree_greedy_cpu`` and ``speculative.reconstruct_indices_from_tree_mask`` for sglang's own
NGRAM algorithm) and registers no ``torch.ops.sgl_kernel`` ops, so sglang's layers take their
native torch paths.

It lives under ``cpu_support/sglang_cpu`` and is put on ``PYTHONPATH`` only by the test fixtures
and the CPU demo (``dlite_lab.commands.demo``). A CUDA deployment never sees it: there the real
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


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_cols):
    """sglang's EAGLE draft (DLITE keeps no draft KV): request i's ``topk * num_cols`` draft slots are
    ``req_to_token[req_pool_indices[i], seq_lens[i] : seq_lens[i] + topk * num_cols]``, copied into
    ``out_cache_loc[i * topk * num_cols : ...]`` (``assign_draft_cache_locs_contiguous`` in sglang's
    ``kernels/ops/speculative/cache_locs.py``)."""
    n = topk * num_cols
    for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[row, start:start + n].to(out_cache_loc.dtype)


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


def build_tree_kernel_efficient_cpu(parent_list, selected_index, seq_lens, tree_mask, positions, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling, topk, depth, draft_token_num,
                                    tree_mask_mode):
    """sglang's EAGLE draft tree -> verify layout, in place, following its Triton kernel
    ``sgl_build_tree_kernel_efficient_triton`` (``kernels/ops/speculative/spec_tree.py``): per request,
    node i > 0's parent is found through ``selected_index[i-1] // topk`` and ``parent_list``; writes
    retrieve_index / next_token / next_sibling (children linked newest first), positions (seq_len +
    depth) and the tree mask (mode 0: the full prefix + tree rows; mode 1: the W x W tree block only)."""
    if int(tree_mask_mode) not in (0, 1):
        raise NotImplementedError(f"CPU stand-in: tree mask mode {int(tree_mask_mode)} (bit-packed) is not "
                                  "supported; sglang uses mode 0 or 1 on a CPU device.")
    W = int(draft_token_num)
    sel, par = selected_index.tolist(), parent_list.tolist()
    lens = seq_lens.tolist()
    flat_mask = tree_mask.view(-1)
    prefix_sum = 0
    for b, seq_len in enumerate(lens):
        seq_len = int(seq_len)

        def parent_position(i):  # the verify row of node i's parent (0 = the root), or None
            tb = sel[b][i - 1] // topk
            if tb == 0:
                return 0
            want = par[b][tb]
            for pp in range(W - 1):
                if sel[b][pp] == want:
                    return pp + 1
            return None

        positions[b * W] = seq_len
        for i in range(W - 1, 0, -1):
            retrieve_index[b, i] = b * W + i
            pp = parent_position(i)
            if pp is not None:
                nxt = int(retrieve_next_token[b, pp])
                retrieve_next_token[b, pp] = i
                if nxt != -1:
                    retrieve_next_sibling[b, i] = nxt
        retrieve_index[b, 0] = b * W
        tree_base = W * W * b + (prefix_sum * W if int(tree_mask_mode) == 0 else 0)
        for x in range(W):
            row = tree_base + ((seq_len + W) * x + seq_len + 1 if int(tree_mask_mode) == 0 else W * x + 1)
            flat_mask[row - 1] = True
            flat_mask[row:row + W - 1] = False
            if x == 0:
                continue
            cur, depth_x = x - 1, 0
            for _ in range(int(depth)):
                depth_x += 1
                flat_mask[row + cur] = True
                tb = sel[b][cur] // topk
                if tb == 0:
                    break
                want, found = par[b][tb], False
                for cp in range(W - 1):
                    if sel[b][cp] == want:
                        cur, found = cp, True
                        break
                if not found:
                    break
            positions[b * W + x] = seq_len + depth_x
        prefix_sum += seq_len


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
