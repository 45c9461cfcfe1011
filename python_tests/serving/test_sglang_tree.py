"""Tree rounds in sglang's DLITE worker (``serving/rounds.py``: ``TreeRounds``).

The verify layout (padded trees, positions, the CPU's draft-only mask and the prefix + tree mask)
against ``DraftTree``; which rounds are tree rounds; and in a real sglang engine on the CPU
(the tiny "sticky" Llama and its copy-trained drafter): hybrid tree rounds give exactly the
reference output, next to chains in the same engine, with no KV slot leaked (the scheduler's
strict idle memory check). The shipped drafter's tree rounds equal the reference engine's round
for round in test_sglang_lossless.
"""

from __future__ import annotations

import json
import time
import types

import pytest
import torch

import sglang_fixtures as F
from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.settings import ServingOptions
from sglang_dlite.serving.rounds import TreeRounds, tree_arrays, verify_mask
from sglang_dlite.drafting.tree import DraftTree, greedy_tree_accept

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
MAX_NEW = [24, 20, 28]


def _tree():
    #        0(anchor 9)
    #      /     \
    #   1(4)     2(5)
    #    |        |
    #   3(6)     4(7)
    #    |
    #   5(8)
    return DraftTree((9, 4, 5, 6, 7, 8), (-1, 0, 0, 1, 2, 3))


def test_padded_tree_layout_matches_the_tree():
    small, chain = _tree(), DraftTree.chain(3, [1, 2])
    tokens, depths, anc, parents = tree_arrays([small, chain], 6)
    assert tokens[0].tolist() == list(small.tokens)
    assert tokens[1].tolist() == [3, 1, 2, 3, 3, 3]  # padding nodes carry the root's token
    assert depths[0].tolist() == small.depths and depths[1].tolist() == [0, 1, 2, 1, 1, 1]
    assert torch.equal(anc[0], small.ancestry())
    assert torch.equal(anc[1, :3, :3], chain.ancestry())
    assert parents[0].tolist() == list(small.parents) and parents[1].tolist() == [-1, 0, 1, 0, 0, 0]
    for i in (3, 4, 5):  # a padding node sees the root and itself, nothing sees it
        assert anc[1, i].nonzero().flatten().tolist() == [0, i]
        assert anc[1, :, i].sum() == 1


def test_verify_mask_draft_only_and_with_the_prefix():
    tokens, depths, anc, _ = tree_arrays([_tree()], 6)
    assert torch.equal(verify_mask(anc, [4], "cpu", draft_only=True), anc.reshape(-1))
    full = verify_mask(anc, [4], "cpu", draft_only=False).view(6, 4 + 6)
    assert full[:, :4].all()  # every node sees the committed prefix
    assert torch.equal(full[:, 4:], anc[0])
    # brute force: node i attends to exactly the nodes on its root path
    t = _tree()
    for i in range(len(t)):
        assert full[i, 4:].nonzero().flatten().tolist() == sorted(t.path(i))


def test_the_tree_layout_is_what_sglangs_tree_contract_reads():
    """sglang's NGRAM verify derives positions and the tree's links from the same [N, N] mask
    (``reconstruct_indices_from_tree_mask``; its contract, ported in the CPU stand-ins): from the
    mask a tree round passes, it gets the round's positions (prefix + depth) and the first-child /
    next-sibling links the tree round's grammar traversal walks (``verify_logits.tree_links``)."""
    import random

    from sglang_dlite.serving.cpu_support.sglang_cpu.sgl_kernel.speculative import reconstruct_indices_from_tree_mask
    from sglang_dlite.serving.verify_logits import tree_links

    rng = random.Random(0)
    trees = [_tree(), DraftTree.chain(3, [1, 2, 4, 5, 6])]
    for _ in range(4):  # random trees of 6 nodes (siblings distinct)
        par = [-1] + [rng.randrange(i) for i in range(1, 6)]
        trees.append(DraftTree((9, *range(10, 15)), par))
    tokens, depths, anc, parents = tree_arrays(trees, 6)
    B, N = len(trees), 6
    prefix = torch.tensor([4, 7, 1, 30, 2, 5])
    pos, ridx = torch.zeros(B * N, dtype=torch.int64), torch.zeros(B * N, dtype=torch.int64)
    nxt, sib = torch.zeros(B * N, dtype=torch.int64), torch.zeros(B * N, dtype=torch.int64)
    reconstruct_indices_from_tree_mask(verify_mask(anc, prefix.tolist(), "cpu", draft_only=True), prefix, pos, ridx,
                                       nxt, sib, B, N)
    assert torch.equal(pos.view(B, N), prefix[:, None] + depths)
    first, sibling = tree_links(parents, [len(t) for t in trees])
    assert torch.equal(nxt.view(B, N), first) and torch.equal(sib.view(B, N), sibling)


def test_padding_rows_are_never_accepted():
    """A round accepts along the real tree only: the target's argmax at the padding rows is not read."""
    t = _tree()
    target = torch.tensor([5, 6, 7, 0, 0, 0])  # root -> 5 (node 2) -> 7 (node 4); bonus = row 4's argmax
    assert greedy_tree_accept(t, target[: len(t)]) == ([0, 2, 4], 0)


def test_the_cost_model_cuts_trees_to_their_best_nodes():
    """Best-first trees list their nodes by falling reach: the first n are a tree and the best n.
    A cost model where every row costs as much as the round's fixed part picks few rows."""
    from sglang_dlite.drafting.hybrid import ChainBranches, grow_round_tree
    from sglang_dlite.drafting.chooser import default_calibration
    from sglang_dlite.serving.rounds import expected_by_rows, first_nodes
    from sglang_dlite.drafting.budget import VerifyWidthPolicy

    top_t = [[10 + i, 20 + i, 30 + i] for i in range(4)]
    top_p = [[0.9, 0.05, 0.02], [0.6, 0.3, 0.05], [0.5, 0.2, 0.1], [0.4, 0.3, 0.2]]
    tree, reach, _ = grow_round_tree(1, None, ChainBranches(top_t, top_p), default_calibration(), 3, 9)
    assert all(a >= b - 1e-12 for a, b in zip(reach[1:], reach[2:]))  # falling reach
    table = expected_by_rows([reach])[0]
    assert table[0] == 0.0 and len(table) == len(tree) and abs(table[-1] - sum(reach[1:])) < 1e-9
    cut = first_nodes(tree, 4)
    assert cut.tokens == tree.tokens[:4] and cut.parents == tree.parents[:4] and first_nodes(tree, 99) is tree
    pol = VerifyWidthPolicy(len(tree))
    for rows in range(1, 2 * len(tree) + 1):  # measured: each verified row costs 10x the first
        for _ in range(8):
            pol.observe(rows, 1.0 + 10.0 * rows)
    assert pol.choose_expected([table]) < len(tree)  # cheap rows would take the whole tree


def _batch(bs=2, *, greedy=True, logprob=False, grammar=False, bias=None, penalty=0.0):
    sp = types.SimpleNamespace(frequency_penalty=penalty, presence_penalty=0.0, repetition_penalty=1.0,
                               min_new_tokens=0)
    reqs = [types.SimpleNamespace(sampling_params=sp) for _ in range(bs)]
    info = types.SimpleNamespace(is_all_greedy=greedy, logit_bias=bias, has_custom_logit_processor=False)
    return types.SimpleNamespace(reqs=reqs, return_logprob=logprob, has_grammar=grammar, sampling_info=info)


def test_which_rounds_are_tree_rounds():
    w = types.SimpleNamespace(W=8, lookup=None)
    tr = TreeRounds(w, max_batch_size=2)
    assert tr.wanted(_batch(2), 2, 7, None)
    assert not tr.wanted(_batch(3), 3, 7, None)  # over tree_max_batch_size: a chain
    assert not tr.wanted(_batch(2), 2, 0, None)  # the load policy / draft gate said no drafts
    assert not tr.wanted(_batch(2), 2, 7, torch.tensor([False, True]))  # an opted-out request
    assert not tr.wanted(_batch(2, logprob=True), 2, 7, None)  # logprobs: chains
    # sampled, grammar, logit_bias, penalties: per node in the tree round (verify_logits)
    assert tr.wanted(_batch(2, greedy=False), 2, 7, None)
    assert tr.wanted(_batch(2, grammar=True), 2, 7, None)
    assert tr.wanted(_batch(2, bias=torch.zeros(2, 5)), 2, 7, None)
    assert tr.wanted(_batch(2, penalty=0.5), 2, 7, None)


def test_tree_settings():
    assert ServingOptions().tree_batch_size("cpu") > 0 and ServingOptions().tree_batch_size("cuda:0") == 0
    o = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"tree_max_batch_size": 0, "tree_branches": 2}'})
    assert o.tree_batch_size("cpu") == 0 and o.tree_branches == 2
    with pytest.raises(DLiteConfigError, match="tree_branches=0: must be an integer >= 1"):
        ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"tree_branches": 0}'})
    with pytest.raises(DLiteConfigError, match="tree_max_batch_size=-2: must be a batch size >= 0, or null"):
        ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"tree_max_batch_size": -2}'})


# ---------------------------------------------------------------------------------- sglang
@pytest.fixture(scope="module")
def llama(sticky_llama_and_copy_dlite):
    target, drafter = sticky_llama_and_copy_dlite
    ref = [F.reference_greedy(target, drafter, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW)]
    return target, drafter, ref


def _sp(n):
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


def test_hybrid_tree_rounds_equal_the_reference_and_leak_no_kv(llama, monkeypatch, tmp_path):
    """Trees up to batch 2: the batch of 3 starts as chains and turns to trees as requests finish;
    the single requests are tree rounds from the start. Output identical; rounds of both kinds ran
    (the round log: a tree round verifies all W rows); idle afterwards with no leaked slot."""
    target, drafter, ref = llama
    log = tmp_path / "rounds.jsonl"
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"tree_max_batch_size": 2, "round_log": str(log)}))
    monkeypatch.setenv("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=[_sp(n) for n in MAX_NEW])
        singles = [e.generate(input_ids=p, sampling_params=_sp(n)) for p, n in zip(PROMPTS, MAX_NEW)]
        time.sleep(3)  # the scheduler idles: its strict memory check would raise on a leaked KV slot
        again = e.generate(input_ids=PROMPTS[0], sampling_params=_sp(MAX_NEW[0]))
    assert [o["output_ids"] for o in outs] == ref
    assert [o["output_ids"] for o in singles] == ref and again["output_ids"] == ref[0]
    rounds = [json.loads(x) for x in log.read_text().splitlines()]
    trees = [r for r in rounds if r["tree"]]
    assert all(r["bs"] <= 2 for r in trees) and any(r["width"] > 2 for r in trees)  # rows: the cost model's pick
    assert any(r["tree"] for r in rounds) and any(r["bs"] == 3 and r["width"] > 1 for r in rounds)  # chains at 3
    accepted = sum(sum(i * c for i, c in enumerate(o["meta_info"]["spec_correct_drafts_histogram"])) for o in singles)
    assert accepted > 0
    # the log's acceptance by output position (bench/e2e.py's tau by position) adds up to sglang's own counts
    every = sum(sum(i * c for i, c in enumerate(o["meta_info"]["spec_correct_drafts_histogram"]))
                for o in outs + singles + [again])
    assert all(len(r["pos"]) == len(r["acc"]) == r["bs"] for r in rounds)
    assert sum(sum(r["acc"]) for r in rounds) == every
    assert all(0 < p < max(MAX_NEW) for r in rounds for p in r["pos"])  # after the prefill's token, before the end


def test_the_cross_request_corpus_branches_a_later_request(llama, monkeypatch, tmp_path):
    """The setting ``corpus_tokens`` (issue 46 item 5): a request that continues as an earlier one did
    accepts more drafts once the earlier request sits in the corpus (its own index has never seen the
    continuation); without the corpus, the second run accepts what the first did. Output identical.
    A fixed verify width (every tree W rows): the timed width policy would make acceptance vary."""
    target, drafter, _ = llama
    prompt, n = PROMPTS[1], 80
    ref = F.reference_greedy(target, drafter, [prompt], n)[0]
    accepted = {}
    for corpus in (0, 20000):
        monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"tree_max_batch_size": 4, "corpus_tokens": corpus,
                                                             "verify_width": "fixed"}))
        with F.engine(target, dlite=drafter, skip_tokenizer_init=True) as e:
            runs = [e.generate(input_ids=prompt, sampling_params=_sp(n)) for _ in range(2)]
        assert all(r["output_ids"] == ref for r in runs)
        accepted[corpus] = [sum(i * c for i, c in enumerate(r["meta_info"]["spec_correct_drafts_histogram"]))
                            for r in runs]
    assert accepted[0][0] == accepted[0][1] == accepted[20000][0], accepted
    assert accepted[20000][1] > accepted[20000][0], accepted
