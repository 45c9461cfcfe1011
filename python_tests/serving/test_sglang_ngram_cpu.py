"""sglang's own NGRAM speculative algorithm on this CPU (the side-by-side baseline to DLITE), through
the same test-only stand-ins (``cpu_support/sglang_cpu``): greedy NGRAM output == sglang without
speculation on the real default target (SmolLM2-135M-Instruct), with drafts accepted.

What NGRAM needs beyond DLITE's chain verify, all in the stand-ins: ``sgl_kernel.speculative.
reconstruct_indices_from_tree_mask`` (tree positions / links), ``sgl_kernel.verify_tree_greedy_cpu``,
``fill_accept_out_cache_loc_cpu`` / ``fill_bonus_tokens_cpu``, and the torch_native verify hook
honouring NGRAM's draft-only tree mask. The n-gram corpus itself is sglang's C++ JIT module, built
on this CPU by tvm_ffi (g++, ~20 s the first time, then cached).
"""

from __future__ import annotations

import random

import pytest
import torch

import sglang_fixtures as F

F.activate_cpu_standins()


def _random_tree_masks(bs, n, rng):
    """NGRAM-style draft-only masks: node 0 is the root, node i hangs under a random earlier node;
    row i marks i's ancestors and i itself. Also returns each node's depth."""
    import numpy as np

    mask = np.zeros((bs, n, n), dtype=bool)
    depth = np.zeros((bs, n), dtype=np.int64)
    for b in range(bs):
        mask[b, 0, 0] = True
        for i in range(1, n):
            p = rng.randint(0, i - 1)
            mask[b, i] = mask[b, p]
            mask[b, i, i] = True
            depth[b, i] = depth[b, p] + 1
    return mask, depth


def test_reconstruct_tree_standin_matches_sglang_host_derivation():
    """The stand-in op == sglang's own host-side link derivation (``ngram_worker._derive_tree_links``)
    and the documented positions / retrieve_index contract."""
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    rng = random.Random(0)
    for _ in range(100):
        bs, n = rng.randint(1, 4), rng.randint(1, 10)
        mask, depth = _random_tree_masks(bs, n, rng)
        seq = torch.randint(0, 100, (bs,))
        pos = torch.empty(bs * n, dtype=torch.int64)
        ridx, nxt, sib = (torch.empty(bs, n, dtype=torch.int64) for _ in range(3))
        reconstruct_indices_from_tree_mask(torch.from_numpy(mask.reshape(-1)), seq, pos, ridx, nxt, sib, bs, n)
        want_nxt, want_sib = _derive_tree_links(mask.reshape(-1), bs, n)
        assert torch.equal(nxt, want_nxt) and torch.equal(sib, want_sib)
        assert torch.equal(pos.view(bs, n), torch.from_numpy(depth) + seq[:, None])
        assert torch.equal(ridx.view(-1), torch.arange(bs * n))


def test_verify_tree_greedy_standin_walks_the_tree():
    """root 0 -> {1: tok 5, 2: tok 6}; 2 -> 3 (tok 7). Target argmax: at 0 -> 6, at 2 -> 7, at 3 -> 9.
    Node 1 is skipped for its sibling 2, then 3 is accepted; the bonus is 9."""
    from sgl_kernel import verify_tree_greedy_cpu

    n = 4
    cand = torch.tensor([[4, 5, 6, 7]])
    ridx = torch.arange(n)[None]
    nxt = torch.tensor([[1, -1, 3, -1]])
    sib = torch.tensor([[-1, 2, -1, -1]])
    tgt = torch.tensor([[6, 0, 7, 9]])
    predicts = torch.zeros(n, dtype=torch.int32)
    accept_index = torch.full((1, n), -1, dtype=torch.int32)
    num = torch.empty(1, dtype=torch.int32)
    verify_tree_greedy_cpu(predicts, accept_index, num, cand, ridx, nxt, sib, tgt)
    assert num.tolist() == [2]
    assert accept_index.tolist() == [[0, 2, 3, -1]]
    assert predicts[[0, 2, 3]].tolist() == [6, 7, 9]


def _sp(n):
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


@pytest.fixture(scope="module")
def real_prompts():
    return F.default_target_chat_prompts(["Repeat this line five times: the quick brown fox jumps over the lazy dog.",
                                          "Count from 1 to 30, separated by commas."])


def test_ngram_equals_nospec_real_target(real_prompts):
    target, prompts = real_prompts
    n_new = 40
    with F.engine(target, skip_tokenizer_init=True) as e:
        want = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=_sp(n_new))]
    with F.engine(target, skip_tokenizer_init=True, speculative_algorithm="NGRAM",
                  speculative_num_draft_tokens=8) as e:
        outs = e.generate(input_ids=prompts, sampling_params=_sp(n_new))
        # one request alone as well (bs = 1 tree verify)
        solo = e.generate(input_ids=prompts[0], sampling_params=_sp(n_new))
    got = [o["output_ids"] for o in outs]
    assert got == want
    assert solo["output_ids"] == want[0]
    metas = [o["meta_info"] for o in outs]
    for m in metas:
        assert m["completion_tokens"] == n_new
    # drafts were accepted: fewer verify rounds than generated tokens
    assert sum(m["spec_verify_ct"] for m in metas) < sum(m["completion_tokens"] for m in metas), metas
