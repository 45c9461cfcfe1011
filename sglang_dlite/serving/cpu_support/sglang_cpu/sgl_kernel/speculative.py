"""CPU-ONLY, TEST-ONLY stand-in for ``sgl_kernel.speculative`` (sglang's NGRAM verify metadata).

On a non-CUDA, non-XPU device ``sglang/kernels/ops/speculative/reconstruct_tree.py`` imports
``reconstruct_indices_from_tree_mask`` from here. This pure-torch version follows the contract in
that module's docstring (per batch ``b``, node ``tid``, ``n = draft_token_num``):

* ``ancestors[i, j] = tree_mask[b, i, j] & (j < i)``
* ``positions[b, tid] = #ancestors(tid) + verified_seq_len[b]``
* ``retrieve_index[b, tid] = b * n + tid``
* ``parent[tid] = max{j < tid : ancestors[tid, j]}`` else -1
* ``retrieve_next_token[b, tid] = min{k > tid : ancestors[k, tid]}`` else -1 (first child)
* ``retrieve_next_sibling[b, tid] = min{k > tid : parent[k] == parent[tid]}`` else -1,
  and -1 when ``parent[tid] < 0``.

Outputs are written in place. Never used on a CUDA deployment (the real ``sglang-kernel`` wheel,
or sglang's own CUDA op, provides it there).
"""

import torch


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, batch_size,
                                       draft_token_num):
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    m = tree_mask.reshape(-1)[: bs * n * n].reshape(bs, n, n).to(torch.bool)
    idx = torch.arange(n, device=m.device)
    row, col = idx[:, None], idx[None, :]
    anc = m & (col < row)  # [bs, i, j]: j is a strict ancestor of i

    depth = anc.sum(-1)  # [bs, n]
    pos = depth.to(torch.int64) + verified_seq_len[:bs].to(torch.int64)[:, None]
    positions.view(-1)[: bs * n].copy_(pos.reshape(-1).to(positions.dtype))

    ridx = torch.arange(bs * n, device=m.device, dtype=torch.int64).view(bs, n)
    retrieve_index.view(-1)[: bs * n].copy_(ridx.reshape(-1).to(retrieve_index.dtype))

    big = torch.full((), n, dtype=torch.int64, device=m.device)
    neg = torch.full((), -1, dtype=torch.int64, device=m.device)
    # parent[b, i] = largest j < i with anc[b, i, j]
    parent = torch.where(anc, col.expand(n, n), neg).amax(-1)  # [bs, n]
    # first child of tid = smallest k > tid with anc[b, k, tid]
    first_child = torch.where(anc, row.expand(n, n), big).amin(-2)  # [bs, n] indexed by tid
    next_token = torch.where(first_child < n, first_child, neg)
    # next sibling of tid = smallest k > tid with parent[k] == parent[tid]
    same = (parent[:, :, None] == parent[:, None, :]) & (row > col)  # [bs, k, tid]
    first_sib = torch.where(same, row.expand(n, n), big).amin(-2)  # [bs, n] indexed by tid
    next_sib = torch.where((parent >= 0) & (first_sib < n), first_sib, neg)

    retrieve_next_token.view(-1)[: bs * n].copy_(next_token.reshape(-1).to(retrieve_next_token.dtype))
    retrieve_next_sibling.view(-1)[: bs * n].copy_(next_sib.reshape(-1).to(retrieve_next_sibling.dtype))
