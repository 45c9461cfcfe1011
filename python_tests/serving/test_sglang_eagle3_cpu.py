"""sglang's own EAGLE3 worker on this CPU, running the project's EAGLE-3-style baseline exported to
the checkpoint format sglang reads (``dlite_lab.baselines.sglang_export``): the export's layout,
its refusals, the CPU stand-ins it needs (draft attention on torch_native, the tree-build kernel),
and, on the real bundled target, that sglang's ``LlamaForCausalLMEagle3`` loaded from the export
drafts what the baseline drafts in the reference engine: the same outputs (== the target's greedy
output) and, round by round, the same number of accepted drafts.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import sglang_fixtures as F

F.activate_cpu_standins()


def test_export_renames_every_weight_and_writes_an_eagle3_llama_config(tmp_path):
    from dlite_lab.baselines.registry import shipped_checkpoint
    from dlite_lab.baselines.sglang_export import KEY_MAP, export_sglang_eagle3

    src = shipped_checkpoint("eagle3")
    out = export_sglang_eagle3(None, str(tmp_path / "e3"), dtype=torch.float32)
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(out, "model.safetensors"), "pt") as b:
        assert sorted(b.keys()) == sorted(KEY_MAP.values())
        for ours, theirs in KEY_MAP.items():
            assert torch.equal(a.get_tensor(ours).float(), b.get_tensor(theirs)), ours
    cfg = json.load(open(os.path.join(out, "config.json")))
    src_cfg = json.load(open(os.path.join(src, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == src_cfg["target_layer_ids"]
    assert cfg["rope_theta"] == src_cfg["rope_theta"]  # the drafter's own RoPE base, not the target's
    # embedding and LM head come from the target in sglang (not stored): no draft vocabulary of its own
    assert cfg["tie_word_embeddings"] is False and "draft_vocab_size" in cfg and cfg["draft_vocab_size"] is None


def test_export_refuses_a_checkpoint_that_is_not_the_eagle3_baseline(tmp_path):
    from dlite_lab.baselines.sglang_export import export_sglang_eagle3
    from sglang_dlite.model.dlite import shipped_drafter_path
    from sglang_dlite.errors import DLiteConfigError

    with pytest.raises(DLiteConfigError, match="EAGLE-3 baseline"):
        export_sglang_eagle3(shipped_drafter_path(), str(tmp_path / "x"))
    with pytest.raises(DLiteConfigError, match="not a drafter checkpoint"):
        export_sglang_eagle3(str(tmp_path), str(tmp_path / "y"))


def test_build_tree_standin_lays_out_a_chain():
    """topk 1: node i's parent is node i-1; positions seq_len + i; next-token links a chain; the
    W x W tree block lower-triangular (mode 1) or the same block after each row's prefix (mode 0)."""
    from sgl_kernel import build_tree_kernel_efficient_cpu

    bs, steps = 2, 4
    W = steps + 1
    seq_lens = torch.tensor([5, 3])
    # sglang's chain bookkeeping with topk 1 (eagle_utils.organize_draft_results): parent_list
    # [-1, 0, 1, ..., steps-2], the selected draft indices 0..W-2 (every draft, in order)
    parents = torch.cat([torch.tensor([-1]), torch.arange(steps - 1)])[None].repeat(bs, 1)
    selected = torch.arange(W - 1)[None].repeat(bs, 1)
    for mode in (0, 1):
        n_mask = (int(seq_lens.sum()) * W if mode == 0 else 0) + bs * W * W
        mask = torch.full((n_mask,), True)
        pos = torch.empty(bs * W, dtype=torch.long)
        ridx, nxt, sib = torch.full((3, bs, W), -1, dtype=torch.long)
        build_tree_kernel_efficient_cpu(parents, selected, seq_lens, mask, pos, ridx, nxt, sib, 1, steps, W, mode)
        assert pos.view(bs, W).tolist() == [[5 + i for i in range(W)], [3 + i for i in range(W)]]
        assert ridx.tolist() == [list(range(W)), list(range(W, 2 * W))]
        assert nxt.tolist() == [[1, 2, 3, 4, -1]] * bs and (sib == -1).all()
        tri = torch.tril(torch.ones(W, W, dtype=torch.bool))
        start = 0
        for b in range(bs):
            width = (int(seq_lens[b]) + W) if mode == 0 else W
            rows = mask[start:start + W * width].view(W, width)
            assert torch.equal(rows[:, width - W:], tri) and rows[:, : width - W].all()
            start += W * width


def test_tree_draft_backend_refuses_token_trees():
    from dlite_cpu_eagle_draft import TorchNativeMultiStepDraftBackend

    with pytest.raises(NotImplementedError, match="--speculative-eagle-topk 1"):
        TorchNativeMultiStepDraftBackend(None, topk=4, speculative_num_steps=3)


@pytest.fixture(scope="module")
def real_prompts():
    return F.default_target_chat_prompts(["Write a Python function that returns the squares of a list of numbers.",
                                          "Count from 1 to 30, separated by commas."])


def test_sglang_eagle3_from_the_export_drafts_what_the_baseline_drafts(real_prompts, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from dlite_lab.baselines.sglang_export import export_sglang_eagle3
    from dlite_lab.reference.engine import ReferenceEngine
    from dlite_lab.registry import make_engine_drafter

    target, prompts = real_prompts
    n_new, K = 32, 7
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ref = ReferenceEngine(hf, make_engine_drafter("eagle3", hf))
    want = [ref.generate(list(p), n_new) for p in prompts]
    assert all(r.rounds for r in want)
    draft = export_sglang_eagle3(None, str(tmp_path_factory.mktemp("e3") / "eagle3"), target, dtype=torch.float32)
    sp = {"temperature": 0.0, "max_new_tokens": n_new, "ignore_eos": True}
    with F.engine(target, skip_tokenizer_init=True, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                  speculative_eagle_topk=1, speculative_num_steps=K, speculative_num_draft_tokens=K + 1) as e:
        outs = [e.generate(input_ids=p, sampling_params=sp) for p in prompts]  # one at a time: bs 1 as the reference
    for got, ref_res in zip(outs, want):
        assert got["output_ids"] == ref_res.output_ids[:n_new]  # lossless, and the reference's own output
        meta = got["meta_info"]
        # the same drafts: the same rounds, each accepting as many drafts as in the reference engine
        accepted = [r.accepted for r in ref_res.rounds]
        hist = [accepted.count(k) for k in range(max(accepted) + 1)]
        assert meta["spec_verify_ct"] == len(ref_res.rounds), (meta, accepted)
        assert meta["spec_correct_drafts_histogram"][:len(hist)] == hist, (meta, accepted)
        assert not any(meta["spec_correct_drafts_histogram"][len(hist):])
    assert sum(r.accepted for w in want for r in w.rounds) > 0  # drafts were accepted at all
