"""Training pipeline: losses vs hand-computed values, a tiny end-to-end run, bad input."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama, tiny_dlite_config
from dlite_lab.training import losses
from dlite_lab.training.data import DataError, load_shard, save_shard, write_manifest
from dlite_lab.training.features import compute_features, save_features


# ---------------------------------------------------------------------------- losses
def test_position_weights_hand_computed():
    w = losses.position_weights(4, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))
    assert torch.allclose(losses.position_weights(3, 0), torch.ones(3))


def test_weighted_ce_hand_computed():
    # one anchor, K=2, V=2: logits [0, 0] -> CE ln 2; logits [ln 3, 0] label 0 -> CE ln(4/3)
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    labels = torch.tensor([[1, 0]])
    valid = torch.tensor([[True, True]])
    w = torch.tensor([1.0, 0.5])
    want = (1.0 * math.log(2) + 0.5 * math.log(4 / 3)) / 1.5
    assert abs(float(losses.weighted_ce(logits, labels, valid, w)) - want) < 1e-6
    # an invalid position is ignored
    valid2 = torch.tensor([[True, False]])
    assert abs(float(losses.weighted_ce(logits, labels, valid2, w)) - math.log(2)) < 1e-6


def test_forward_kl_and_tv_hand_computed():
    # teacher p = [0.75, 0.25] (logits [ln 3, 0]); student q = [0.5, 0.5]
    t = torch.tensor([[[math.log(3.0), 0.0]]])
    s = torch.tensor([[[0.0, 0.0]]])
    valid = torch.tensor([[True]])
    w = torch.ones(1)
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert abs(float(losses.forward_kl(t, s, valid, w)) - kl) < 1e-6
    p = torch.softmax(t, -1)
    assert abs(float(losses.tv_distance(p, s, valid, w)) - 0.25) < 1e-6
    # forward KL is KL(teacher || student), not the reverse
    rev = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert abs(kl - rev) > 1e-3
    # position weights combine: two positions with TV 0.25 and 0 and weights 1, e^-1
    s2 = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    p2 = torch.softmax(torch.tensor([[[math.log(3.0), 0.0], [math.log(3.0), 0.0]]]), -1)
    w2 = losses.position_weights(2, 1.0)
    want = (1.0 * 0.25 + math.exp(-1) * 0.0) / (1 + math.exp(-1))
    assert abs(float(losses.tv_distance(p2, s2, torch.ones(1, 2, dtype=torch.bool), w2)) - want) < 1e-6


# ---------------------------------------------------------------------------- tiny data
def _tiny_data(tmp_path, target, n_seqs=6, prompt_len=6, gen_len=40, with_features=True,
               shard="tiny_00000.npz", recipe=None):
    torch.manual_seed(1)
    seqs, masks = [], []
    for _ in range(n_seqs):
        prompt = torch.randint(3, target.config.vocab_size, (1, prompt_len))
        with torch.no_grad():
            out = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=gen_len,
                                  min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
        ids = out[0].tolist()
        seqs.append(ids)
        masks.append([0] * prompt_len + [1] * (len(ids) - prompt_len))
    d = tmp_path / "data"
    d.mkdir()
    info = save_shard(str(d / shard), seqs, masks)
    write_manifest(str(d), {"recipe": recipe or {"target": "tiny"}, "shards": [info]})
    if with_features:
        layers = tiny_dlite_config(target).target_layer_ids
        off = np.cumsum([0] + [len(s) for s in seqs])
        save_features(str(d / shard), compute_features(target, seqs, layers), off, layers,
                      target.config.hidden_size)
    return str(d)


def _opts(**kw):
    from dlite_lab.training.train import TrainOptions

    c = tiny_dlite_config(make_tiny_llama())
    ov = dict(num_context_positions=c.num_context_positions, block_size=c.block_size, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=16, intermediate_size=96, rnn_rank=8)
    base = dict(steps={"teacher": 30, "distill": 20, "stabilize": 30}, lr=3e-3, batch_size=32, seqs_per_batch=2,
                eval_every=1000, eval_anchors=64, save_every=10, progress=False, config_overrides=ov, device="cpu")
    base.update(kw)
    return TrainOptions(**base)


def test_features_match_hf_hidden_states(tiny_target):
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    feats = compute_features(tiny_target, seqs, [1, 3])
    with torch.no_grad():
        hs = tiny_target(input_ids=torch.tensor([seqs[0]]), output_hidden_states=True).hidden_states
    assert np.allclose(feats[0][:, 0], hs[2][0].numpy(), atol=1e-2)
    assert np.allclose(feats[0][:, 1], hs[4][0].numpy(), atol=1e-2)
    assert np.allclose(feats[0][:, 2], hs[-1][0].numpy(), atol=1e-2)  # final-norm output


def test_tiny_end_to_end_lowers_loss(tmp_path, tiny_target):
    from dlite_lab.training.train import train_pipeline

    data = _tiny_data(tmp_path, tiny_target)
    out = str(tmp_path / "run")
    done = train_pipeline(tiny_target, data, out, _opts())
    assert set(done) == {"teacher", "distill", "stabilize"}
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    for st in ("teacher", "stabilize"):
        tr = [r["loss"] for r in recs if r.get("stage") == st and "loss" in r]
        assert tr[-1] < tr[0] * 0.9, (st, tr)
    ev = [r for r in recs if "tau_proxy" in r]
    assert ev and all(1.0 <= r["tau_proxy"] <= 8.0 for r in ev)
    assert os.path.isfile(os.path.join(out, "curve.png"))
    # the final checkpoint is a DLite (history-free) drafter that serves in the reference engine
    from dlite_lab.reference.drafters import DLiteEngineDrafter
    from dlite_lab.reference.engine import ReferenceEngine
    from sglang_dlite.model.dlite import DLiteDrafter

    m = DLiteDrafter.from_pretrained(done["stabilize"]).bind_hf_target(tiny_target)
    assert m.config.history == "none"
    eng = ReferenceEngine(tiny_target, DLiteEngineDrafter(m))
    res = eng.generate([5, 6, 7], 16)
    base = ReferenceEngine(tiny_target).generate([5, 6, 7], 16)
    assert res.output_ids == base.output_ids  # lossless
    # the model card renders from the run's numbers; the bf16 export reloads
    from dlite_lab.training.model_card import render_card
    from dlite_lab.training.recipe import export
    from dlite_lab.training.run_summary import summarize

    card = render_card(summarize(out, data))
    assert "| stabilize |" in card and "| teacher |" in card
    assert "head r = " in card and "fed the previous draft token (`head_input=token`" in card
    hidden = render_card({**summarize(out, data), "drafter_config": {"head_input": "hidden", "num_layers": 2}})
    assert "2 backbone layers" in hidden and "fed the backbone outputs (`head_input=hidden`" in hidden
    from dlite_lab.training.model_card import _autocast_label

    # training.json's bf16=None (the trainer's device default) is said in words, not printed as "None"
    assert _autocast_label(None) == "default (on with --device cuda, off on the CPU)" and _autocast_label(True) == "True"
    dest = export(done["stabilize"], str(tmp_path / "export"), card, data, draft_vocab=40)
    exported = DLiteDrafter.from_pretrained(dest)
    assert exported.config.history == "none" and exported.config.draft_vocab_size == 40
    with open(os.path.join(dest, "README.md")) as f:
        assert "- Drafting vocabulary: the 40 most frequent" in f.read()
    # the exported drafter (drafting vocabulary included) is still lossless
    eng = ReferenceEngine(tiny_target, DLiteEngineDrafter(exported.float().bind_hf_target(tiny_target)))
    assert eng.generate([5, 6, 7], 16).output_ids == base.output_ids
    # resume: finished stages are skipped, nothing is lost
    done2 = train_pipeline(tiny_target, data, out, _opts(resume=True))
    assert done2 == done


def test_resume_mid_stage_and_extend(tmp_path, tiny_target):
    """A paused stage resumes at its step (not 0); a finished one, asked for more steps with
    --resume, is extended from its checkpoint. Every step is logged exactly once."""
    from dlite_lab.training.train import train_pipeline

    data = _tiny_data(tmp_path, tiny_target, n_seqs=3)
    out = str(tmp_path / "run")

    def run(steps, **kw):
        return train_pipeline(tiny_target, data, out, _opts(stages=["stabilize"], steps={"stabilize": steps},
                                                            vocab_subset=48, log_every=1, **kw))

    assert run(10, stop_after_steps=4).get("paused") == "stabilize"
    assert torch.load(os.path.join(out, "stabilize", "ckpt.pt"), weights_only=False)["step"] == 4
    assert "stabilize" in run(10, resume=True)
    assert run(10, resume=True) == {"stabilize": os.path.join(out, "stabilize", "model")}  # done: skipped
    run(16, resume=True)  # extend the finished stage
    assert torch.load(os.path.join(out, "stabilize", "ckpt.pt"), weights_only=False)["step"] == 16
    assert json.load(open(os.path.join(out, "stabilize", "DONE.json")))["steps"] == 16
    logged = [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
    assert logged == list(range(1, 17)), logged


# ---------------------------------------------------------------------------- bad input
def test_missing_and_corrupt_shards(tmp_path, tiny_target):
    from dlite_lab.training.train import train_pipeline

    data = _tiny_data(tmp_path, tiny_target, n_seqs=2, with_features=False)
    shard = os.path.join(data, "tiny_00000.npz")
    with open(shard, "wb") as f:
        f.write(b"not a zip")
    with pytest.raises(DataError, match="corrupt"):
        load_shard(shard)
    with pytest.raises(DataError, match="corrupt"):
        train_pipeline(tiny_target, data, str(tmp_path / "r1"), _opts(stages=["stabilize"]))
    os.remove(shard)
    with pytest.raises(DataError, match="missing"):
        train_pipeline(tiny_target, data, str(tmp_path / "r2"), _opts(stages=["stabilize"]))
    with pytest.raises(DataError, match="manifest"):
        train_pipeline(tiny_target, str(tmp_path), str(tmp_path / "r3"), _opts(stages=["stabilize"]))


def test_features_computed_when_missing(tmp_path, tiny_target):
    from dlite_lab.training.train import FeatureData

    data = _tiny_data(tmp_path, tiny_target, n_seqs=2, with_features=False)
    layers = tiny_dlite_config(tiny_target).target_layer_ids
    fd = FeatureData(data, layers, model_loader=lambda: tiny_target, progress=False)
    assert fd.num_train_anchors > 0
    assert os.path.isfile(os.path.join(data, "tiny_00000.feat.npy"))


def test_anchor_tokens_all_adds_prompt_anchors_but_evaluates_on_generated_spans(tmp_path, tiny_target):
    """--anchor-tokens all: every position with a next token is a training anchor, its labels
    valid on prompt tokens too; "generated" (default) keeps only anchors whose next token the
    target generated. Held-out eval anchors stay on generated spans either way."""
    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.training.train import FeatureData, eval_groups, sample_batch

    data = _tiny_data(tmp_path, tiny_target, n_seqs=3, prompt_len=6, gen_len=10)
    layers = tiny_dlite_config(tiny_target).target_layer_ids
    gen = FeatureData(data, layers, heldout_mod=0)
    full = FeatureData(data, layers, heldout_mod=0, anchor_tokens="all")
    # sequences of 16 tokens: anchors n in 1..14 whose next token is generated = 5..14 (10);
    # all = 1..14 (14); one sequence is held out
    assert [a.tolist() for a in map(gen.train_anchors, gen.train_idx)] == [list(range(5, 15))] * 2
    assert [a.tolist() for a in map(full.train_anchors, full.train_idx)] == [list(range(1, 15))] * 2
    assert (gen.num_train_anchors, full.num_train_anchors) == (20, 28)
    # eval anchors identical in both modes, all on generated spans
    eg, ef = eval_groups(gen, 64), eval_groups(full, 64)
    assert [(s, a.tolist()) for s, a in eg] == [(s, a.tolist()) for s, a in ef]
    assert all(int(a.min()) >= 5 for _, a in ef)
    # label validity: prompt-side labels only count with all_tokens
    C, K = 2, 3
    b_gen = full.group(0, np.array([1, 3]), C, K, 0, False)
    b_all = full.group(0, np.array([1, 3]), C, K, 0, False, all_tokens=True)
    assert b_gen["valid"].tolist() == [[False, False, False], [False, False, True]]
    assert b_all["valid"].all()
    rng = np.random.default_rng(0)
    groups = sample_batch(full, rng, batch_size=28, seqs_per_batch=2)
    assert min(int(a.min()) for _, a in groups) < 5  # prompt-side anchors are sampled
    with pytest.raises(DLiteInputError, match="anchor_tokens"):
        FeatureData(data, layers, anchor_tokens="prompt")


def test_train_with_all_anchor_tokens_lowers_the_loss(tmp_path, tiny_target):
    from dlite_lab.training.train import train_pipeline

    data = _tiny_data(tmp_path, tiny_target, n_seqs=3)
    out = str(tmp_path / "run")
    train_pipeline(tiny_target, data, out, _opts(stages=["stabilize"], anchor_tokens="all", steps={"stabilize": 40}))
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
    assert recs[-1]["loss"] < recs[0]["loss"]


def test_kl_to_target_hand_computed():
    # target p = [0.75, 0.25, 0] (a zero-probability token adds nothing); student q = [0.5, 0.5, 0]-ish
    p = torch.tensor([[[0.75, 0.25, 0.0]]])
    s = torch.tensor([[[0.0, 0.0, -1e4]]])
    valid = torch.tensor([[True]])
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert abs(float(losses.kl_to_target(p, s, valid, torch.ones(1))) - kl) < 1e-6
    # equals forward_kl given the target's logits; zero when the student matches the target
    assert abs(float(losses.forward_kl(torch.log(p.clamp_min(1e-30)), s, valid, torch.ones(1))) - kl) < 1e-5
    assert abs(float(losses.kl_to_target(p, torch.log(p.clamp_min(1e-30)), valid, torch.ones(1)))) < 1e-6


def test_kl_only_stabilize_lowers_the_loss_and_is_in_the_card(tmp_path, tiny_target, monkeypatch):
    from dlite_lab.training import loop
    from dlite_lab.training.model_card import render_card
    from dlite_lab.training.run_summary import summarize
    from dlite_lab.training.train import train_pipeline

    def no_ce(*a, **k):
        raise AssertionError("a loss term with weight 0 was computed")

    monkeypatch.setattr(loop, "weighted_ce", no_ce)
    monkeypatch.setattr(loop, "tv_distance", no_ce)
    data = _tiny_data(tmp_path, tiny_target, n_seqs=3)
    out = str(tmp_path / "run")
    train_pipeline(tiny_target, data, out, _opts(stages=["stabilize"], ce_weight=0.0, tv_weight=0.0, kl_weight=1.0,
                                                 steps={"stabilize": 40}, vocab_subset=64))
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
    assert recs[-1]["loss"] < recs[0]["loss"] * 0.9
    assert "forward KL (x1.0)" in render_card(summarize(out, data))


def test_empty_prompt_source(tmp_path):
    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.training.prompts import load_prompts

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DLiteInputError, match="no prompts"):
        load_prompts(f"jsonl:{empty}", 0, 2)
    with pytest.raises(DLiteInputError, match="unknown prompt source"):
        load_prompts("nosuch:3", 0, 2)


def test_mismatched_drafter_config(tiny_target):
    from sglang_dlite.model.config import DLiteConfig
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.model.dlite import DLiteDrafter

    m = DLiteDrafter(DLiteConfig(target_hidden_size=32, vocab_size=tiny_target.config.vocab_size,
                                 target_num_layers=6, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                                 rnn_rank=4))
    with pytest.raises(DLiteConfigError, match="does not match the target"):
        m.bind_hf_target(tiny_target)


def test_disk_full_keeps_finished_shards(tmp_path, monkeypatch):
    d = tmp_path / "d"
    d.mkdir()
    save_shard(str(d / "a_00000.npz"), [[1, 2, 3]], [[0, 1, 1]])

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(DataError, match="free disk space"):
        save_shard(str(d / "a_00001.npz"), [[1, 2]], [[0, 1]])
    assert not os.path.exists(d / "a_00001.npz")
    ids, mask, off = load_shard(str(d / "a_00000.npz"))
    assert ids.tolist() == [1, 2, 3]


def test_gen_data_end_to_end_resumes_and_survives_a_too_long_prompt(tmp_path):
    """`sglang-dlite gen-data` on a tiny random target with the real SmolLM2 tokenizer: a shard
    with features, a conversation whose first prompt exceeds --max-len (regression: it used to
    crash the worker when saving features), and a rerun that regenerates nothing."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sglang_dlite.cli import main
    from sglang_dlite.model.bundled_target import prepare_default_target
    from dlite_lab.training.features import load_features

    tok = AutoTokenizer.from_pretrained(str(prepare_default_target(verbose=False)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    target = tmp_path / "target"
    LlamaForCausalLM(cfg).save_pretrained(target)
    tok.save_pretrained(target)
    convs = [{"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "x"},
                           {"role": "user", "content": "Again."}]},
             {"messages": [{"role": "user", "content": "word " * 200}]},  # longer than --max-len
             {"messages": [{"role": "user", "content": "Count to three."}]}]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    out = tmp_path / "data"
    argv = ["gen-data", "--target", str(target), "--prompts", f"jsonl:{src}", "--out", str(out),
            "--shard-size", "3", "--max-new-tokens", "6", "--max-len", "96", "--threads", "1",
            "--capture-layers", "1,2"]
    assert main(argv + ["--budget-min", "0"]) == 0  # budget spent before the first shard: nothing
    assert not (out / "manifest.json").exists() or not json.loads((out / "manifest.json").read_text())["shards"]
    assert main(argv) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert len(man["shards"]) == 1
    path = str(out / man["shards"][0]["file"])
    ids, mask, off = load_shard(path)
    lens = np.diff(off)
    gen = [int(mask[off[s]:off[s + 1]].sum()) for s in range(3)]
    assert gen[1] == 0 and gen[0] > 0 and gen[2] > 0  # the too-long one generated nothing
    feats = load_features(path, [1, 2], len(ids))
    assert feats is not None and feats.shape == (len(ids), 3, 32)
    assert not np.any(feats[off[1]:off[2]]) and np.any(feats[off[0]:off[0] + lens[0] - 1])
    mtime = os.path.getmtime(path)
    assert main(argv) == 0  # resumed: nothing to do
    assert os.path.getmtime(path) == mtime


def test_feature_caches_of_two_layer_sets_coexist(tmp_path, tiny_target):
    """A baseline with other capture layers computes its own cache beside DLite's, never over it."""
    from dlite_lab.training.features import ensure_features, load_features

    data = _tiny_data(tmp_path, tiny_target)
    man = json.loads(open(os.path.join(data, "manifest.json")).read())
    path = os.path.join(data, man["shards"][0]["file"])
    ids, _, off = load_shard(path)
    dl_layers = tiny_dlite_config(tiny_target).target_layer_ids
    before = np.array(load_features(path, dl_layers, len(ids)))
    other = [0, 2, 5]
    assert load_features(path, other, len(ids)) is None
    assert ensure_features(data, man["shards"], lambda: tiny_target, other, progress=False) == 1
    mine = load_features(path, other, len(ids))
    assert mine is not None and mine.shape[1] == len(other) + 1
    with torch.no_grad():
        hs = tiny_target(input_ids=torch.tensor([ids[:off[1]].tolist()]), output_hidden_states=True).hidden_states
    assert np.allclose(mine[: off[1] - 1, 1], hs[3][0, :-1].numpy(), atol=1e-2)
    assert np.array_equal(np.array(load_features(path, dl_layers, len(ids))), before)  # untouched
    assert ensure_features(data, man["shards"], lambda: tiny_target, other, progress=False) == 0
    # several sets in one pass: same rows as one set at a time
    from dlite_lab.training.features import ensure_feature_sets

    assert ensure_feature_sets(data, man["shards"], lambda: tiny_target, [other, [1, 4], [3]], progress=False) == 1
    both = load_features(path, [1, 4], len(ids))
    assert np.allclose(both[: off[1] - 1, 1], hs[5][0, :-1].numpy(), atol=1e-2)
    assert np.allclose(np.array(load_features(path, [3], len(ids)))[:, 1], np.array(mine)[:, 3], atol=1e-3)


def test_init_from_target_layers_copies_weights_and_checks_shapes(tiny_target):
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.model.dlite import DLiteDrafter
    from dlite_lab.training.train import init_from_target_layers

    d = DLiteDrafter(tiny_dlite_config(tiny_target, intermediate_size=128))  # = the tiny target's shapes
    init_from_target_layers(d, tiny_target, [3, 4])
    src = tiny_target.model.layers[4]
    assert torch.equal(d.layers[1].q_proj.weight, src.self_attn.q_proj.weight)
    assert torch.equal(d.layers[1].down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(d.layers[0].post_norm.weight, tiny_target.model.layers[3].post_attention_layernorm.weight)
    with pytest.raises(DLiteConfigError, match="out of range"):
        init_from_target_layers(d, tiny_target, [3, 9])
    with pytest.raises(DLiteConfigError, match="names 1 layers"):
        init_from_target_layers(d, tiny_target, [3])
    other = DLiteDrafter(tiny_dlite_config(tiny_target))  # intermediate 96 != 128
    with pytest.raises(DLiteConfigError, match="intermediate size must equal"):
        init_from_target_layers(other, tiny_target, [3, 4])


def test_init_from_drafter_continues_a_trained_run_and_refuses_another_drafter(tmp_path, tiny_target):
    """--init-from-drafter: a second run starts from the first run's trained weights (its first loss is
    the first run's last, not a fresh drafter's), and a checkpoint of another shape is refused by name."""
    import argparse

    from sglang_dlite.errors import DLiteConfigError, DLiteInputError
    from sglang_dlite.model.dlite import DLiteDrafter
    from dlite_lab.training.train import add_arguments, init_from_drafter, options_from_args, train_pipeline

    data = _tiny_data(tmp_path, tiny_target, n_seqs=3)

    def losses_of(out):
        return [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]

    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    train_pipeline(tiny_target, data, first, _opts(stages=["stabilize"], steps={"stabilize": 40}))
    trained = os.path.join(first, "stabilize", "model")
    train_pipeline(tiny_target, data, second, _opts(stages=["stabilize"], steps={"stabilize": 10}, init_drafter=trained))
    a, b = losses_of(first), losses_of(second)
    assert b[0] < a[0] and abs(b[0] - a[-1]) < 0.5 * (a[0] - a[-1])
    with open(os.path.join(second, "stabilize", "model", "training.json")) as f:
        assert json.load(f)["run"]["options"]["init_drafter"] == trained
    from dlite_lab.training.model_card import render_card
    from dlite_lab.training.run_summary import summarize

    card = render_card(summarize(second, data))
    assert f"Started from the trained drafter {trained} (`--init-from-drafter`)." in card

    src = DLiteDrafter.from_pretrained(trained)
    fresh = DLiteDrafter(src.config)
    init_from_drafter(fresh, trained)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in src.state_dict().items())
    other = DLiteDrafter(tiny_dlite_config(tiny_target, rnn_rank=4))
    with pytest.raises(DLiteConfigError, match="different drafter.*rnn_rank"):
        init_from_drafter(other, trained)
    with pytest.raises(DLiteConfigError, match="no DLite checkpoint folder"):
        init_from_drafter(fresh, str(tmp_path / "nowhere"))

    def parse(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return options_from_args(p.parse_args(["--data", "d", "--out", "o", *argv]))

    assert parse("--single-stage", "--init-from-drafter", trained).init_drafter == trained
    with pytest.raises(DLiteInputError, match="add --single-stage"):
        parse("--init-from-drafter", trained)
    with pytest.raises(DLiteInputError, match="pass one"):
        parse("--single-stage", "--init-from-drafter", trained, "--init-from-target-layers", "1,2")


def test_time_budget_replans_warmup_and_cosine(tmp_path, tiny_target):
    """A stage whose step count is an upper bound (budget-bound): the warm-up is 5 % of the schedule
    as re-planned for the budget, so the learning rate peaks early and the cosine completes.
    Regression: the warm-up used to be 5 % of the *requested* steps, so a 20 000-step request cut
    to ~650 steps by its budget never left warm-up."""
    from dlite_lab.training.train import train_pipeline

    data = _tiny_data(tmp_path, tiny_target)
    out = str(tmp_path / "run")
    opts = _opts(stages=["stabilize"], steps={"teacher": 1, "distill": 1, "stabilize": 100000},
                 time_budget_s={"stabilize": 4.0}, lr=1e-3)
    train_pipeline(tiny_target, data, out, opts)
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"lr"' in x]
    lrs = [r["lr"] for r in recs if r.get("stage") == "stabilize"]
    assert len(lrs) >= 3
    assert max(lrs) > 0.8e-3  # reached (near) the peak: warm-up ended
    assert lrs[-1] < 0.3e-3  # and the cosine decayed before the budget ran out


def _heldout_setup(tmp_path, tiny_target):
    """A tiny regenerated data set, its held-out anchors and a random history-free drafter."""
    from sglang_dlite.model.dlite import DLiteDrafter
    from dlite_lab.training.train import FeatureData, eval_groups

    data = _tiny_data(tmp_path, tiny_target, n_seqs=4)
    cfg = tiny_dlite_config(tiny_target)
    fd = FeatureData(data, cfg.target_layer_ids, heldout_mod=0)
    torch.manual_seed(3)
    model = DLiteDrafter(cfg).bind_hf_target(tiny_target).eval()
    return cfg, fd, model, eval_groups(fd, 64)


def test_bench_heldout_tau_matches_the_trainers_evaluation(tmp_path, tiny_target):
    """bench/heldout_tau.py scores a drafter on a fixed held-out anchor set exactly as the
    trainer's evaluate() does (same tau, same per-position acceptance), with a CI around it;
    history-aware checkpoints are refused with a clear message."""
    import importlib.util

    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.ablations import AblationDrafter
    from dlite_lab.training.train import evaluate

    spec = importlib.util.spec_from_file_location("heldout_tau", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "heldout_tau.py"))
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    cfg, fd, model, groups = _heldout_setup(tmp_path, tiny_target)
    got = ht.heldout_tau(model, fd, groups, bf16=False)
    ref = evaluate(model, fd, groups, autocast=lambda: torch.autocast("cpu", enabled=False))
    assert got["anchors"] == ref["eval_anchors"] == sum(len(a) for _, a in groups)
    assert got["tau"] == pytest.approx(ref["tau_proxy"], abs=1e-4)
    assert got["acc_per_pos"] == pytest.approx(ref["acc_per_pos"], abs=1e-4)
    assert got["tau_ci95"][0] <= got["tau"] <= got["tau_ci95"][1]
    # per prompt source (the shard name's prefix): one source here, so the same numbers as the pool
    (name, src), = got["by_source"].items()
    assert name == "tiny" and src["anchors"] == got["anchors"]
    assert src["tau"] == pytest.approx(got["tau"], abs=1e-4) and src["pos1"] == pytest.approx(got["acc_per_pos"][0], abs=1e-4)
    # two sources: each mean over its own anchors; a score count that does not match gives no breakdown
    fake = type("D", (), {"seqs": [(0, 0, 0, 0, "agent_00001.npz:3"), (0, 0, 0, 0, "sharegpt_00000.npz:0")]})()
    two = ht.by_source(np.array([3.0, 1.0, 1.0, 2.0, 1.0]), fake, [(0, [5, 9]), (1, [4, 6, 8])])
    assert two == {"agent": {"tau": 2.0, "pos1": 0.5, "anchors": 2},
                   "sharegpt": {"tau": pytest.approx(4 / 3, abs=1e-4), "pos1": pytest.approx(1 / 3, abs=1e-4), "anchors": 3}}
    assert ht.by_source(np.array([1.0]), fake, [(0, [5, 9])]) == {}
    teacher = AblationDrafter(tiny_dlite_config(tiny_target, history="full")).bind_hf_target(tiny_target)
    with pytest.raises(DLiteInputError, match="history-free"):
        ht.heldout_tau(teacher, fd, groups, bf16=False)


def test_heldout_scoring_drafts_over_the_drafting_vocabulary(tmp_path, tiny_target):
    """A drafter with a drafting vocabulary (a shipped export) is scored as it drafts: one whose
    vocabulary lacks every label accepts nothing, one with every id scores as no vocabulary, and
    each scored draft is what propose() drafts (the argmax over those ids)."""
    from dlite_lab.training.dataset import concat_groups
    from dlite_lab.training.evaluation import GreedyTally, greedy_scores, scored_drafts

    cfg, fd, model, groups = _heldout_setup(tmp_path, tiny_target)
    off = torch.autocast("cpu", enabled=False)
    tau, acc = greedy_scores(model, fd, groups, lambda: off)
    V = cfg.vocab_size
    model.set_draft_vocab(torch.arange(V))
    tau_all, acc_all = greedy_scores(model, fd, groups, lambda: off)
    assert torch.equal(tau, tau_all) and acc == acc_all
    b = concat_groups([fd.group(si, a, cfg.num_context_positions, cfg.block_size, 0, False) for si, a in groups])
    labels = set(b["labels"][b["valid"]].tolist())
    model.set_draft_vocab(torch.tensor([i for i in range(V) if i not in labels]))
    tau_none, acc_none = greedy_scores(model, fd, groups, lambda: off)
    assert float(tau_none.max()) == 1.0 and max(acc_none) == 0.0
    keep = torch.arange(0, V, 2)
    model.set_draft_vocab(keep)
    with torch.no_grad():
        drafted = model.propose(b["context_hidden"], b["context_valid"], b["anchor_ids"]).tokens
        scored = scored_drafts(model, b)
    assert torch.equal(scored, drafted) and bool((scored % 2 == 0).all())
    want = GreedyTally(cfg.block_size)
    want.add(drafted, b["labels"], b["valid"])
    tau_keep, acc_keep = greedy_scores(model, fd, groups, lambda: off)
    assert torch.equal(tau_keep, want.result()[0]) and acc_keep == pytest.approx(want.result()[1])


def test_bench_heldout_tau_scores_a_kv_baseline_per_anchor(tmp_path, tiny_target):
    """bench/heldout_tau.py scores an EAGLE-3 checkpoint on the same held-out anchors as DLite:
    per anchor, 1 + the leading drafts of its unroll equal to the data's next tokens inside the
    generated span (recomputed here one anchor at a time, by hand), with the per-position rates."""
    import importlib.util

    from dlite_lab.baselines.registry import load_kv_baseline
    from dlite_lab.baselines.train import sequence_inputs, train_kv_baseline
    from dlite_lab.training.train import FeatureData, eval_groups

    spec = importlib.util.spec_from_file_location("heldout_tau", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "heldout_tau.py"))
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    data = _tiny_data(tmp_path, tiny_target, n_seqs=4)
    ck = str(tmp_path / "e3")
    train_kv_baseline("eagle3", tiny_target, data, ck, steps=3, lr=5e-3, batch_size=16, seqs_per_batch=2,
                      progress=False)
    m = load_kv_baseline("eagle3", ck, tiny_target)
    K, L = m.config.block_size, m.config.num_capture_layers
    fd = FeatureData(data, m.config.target_layer_ids, model_loader=lambda: tiny_target, heldout_mod=0, progress=False)
    for k0, (ids, mask, feats) in enumerate(list(fd.shards)):  # a 3-token user turn inside each answer
        mask = np.array(mask)
        for kk, start, length, _, _ in fd.seqs:
            if kk == k0:
                mask[start + length // 2:start + length // 2 + 3] = 0
        fd.shards[k0] = (ids, mask, feats)
    groups = eval_groups(fd, 64)

    def by_hand():
        taus, hits, n = [], [0] * K, [0] * K
        for si, anchors in groups:
            k0, start, length, _, _ = fd.seqs[si]
            ids, mask, _ = fd.shards[k0]
            for a in anchors:
                hidden, x, anc, _, _, _ = sequence_inputs(fd, si, [a], K, L)
                with torch.no_grad():
                    draft = m.training_forward(hidden, x, anc)[0, 0].argmax(-1).tolist()
                run, tau = True, 1
                for k in range(K):
                    pos = a + 1 + k
                    if pos >= length or mask[start + pos] != 1:
                        run = False
                        continue
                    ok = draft[k] == int(ids[start + pos])
                    hits[k] += ok
                    n[k] += 1
                    run = run and ok
                    tau += run
                taus.append(tau)
        return sum(taus) / len(taus), [h / max(c, 1) for h, c in zip(hits, n)], len(taus)

    for oracle in (False, True):
        if oracle:
            # a drafter right on the first (anchor % (K + 1)) positions, wrong after: every tau
            # from 1 to K + 1 occurs, and the end of each generated span must stop acceptance
            real = m.training_forward

            def fake(hidden, x, anc, num_steps=None):
                out = torch.zeros(*real(hidden, x, anc).shape)
                for j, a in enumerate(anc[0].tolist()):
                    for k in range(K):
                        pos = a + 1 + k
                        tok = int(x[0, pos]) if pos < x.shape[1] else 0
                        out[0, j, k, tok if k < a % (K + 1) else (tok + 1) % out.shape[-1]] = 1.0
                return out

            m.training_forward = fake
        got = ht.heldout_tau(m, fd, groups, bf16=False)
        tau, acc, count = by_hand()
        assert got["anchors"] == count
        assert got["tau"] == pytest.approx(tau, abs=1e-4)
        assert got["acc_per_pos"] == pytest.approx(acc, abs=1e-4)
    assert got["tau"] > 2.0  # the oracle's drafts are accepted: the comparison is not all-misses


def test_sequence_prompt_ids_follow_gen_datas_plan():
    """Which conversation each gen-data sequence came from, rebuilt from the manifest recipe,
    agrees with gen-data's own shard plan; a shorter prompt list is the longer one's prefix."""
    import argparse

    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.training.gen_data import plan_shards
    from dlite_lab.training.prompts import prompt_ids, sequence_prompt_ids

    recipe = {"prompts": ["bfcl:12", "bfcl:30"], "seed": 3, "shard_size": 8, "max_turns": 2}
    conv = sequence_prompt_ids(recipe)
    plan = plan_shards(argparse.Namespace(prompts=["bfcl:30"], seed=3, max_turns=2, shard_size=8))
    assert len(conv) == 30 == sum(len(c) for _, _, c in plan)
    for fname, _, convs in plan:
        assert [conv[f"{fname}:{s}"] for s in range(len(convs))] == [c["id"] for c in convs]
    seen = prompt_ids(["bfcl:12"], 3)
    assert {k for k, v in conv.items() if v in seen} == {f"bfcl_{k // 8:05d}.npz:{k % 8}" for k in range(12)}
    assert prompt_ids(["bfcl:12"], 4) != seen  # another seed draws other prompts
    assert sequence_prompt_ids(recipe, names={"sharegpt"}) == {}
    with pytest.raises(DLiteInputError, match="shard_size"):
        sequence_prompt_ids({"prompts": ["bfcl:3"], "seed": 0})


def test_bench_heldout_tau_drops_prompts_another_run_trained_on(tmp_path, tiny_target):
    """--exclude-prompts: held-out sequences whose conversation another run's prompts include
    are dropped (a clean A/B against that run's drafter); nothing left is an error."""
    import importlib.util

    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.training.prompts import prompt_ids, sequence_prompt_ids
    from dlite_lab.training.train import FeatureData

    spec = importlib.util.spec_from_file_location("heldout_tau", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "heldout_tau.py"))
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    recipe = {"prompts": ["bfcl:6"], "seed": 3, "shard_size": 6, "max_turns": 2}
    data = _tiny_data(tmp_path, tiny_target, n_seqs=6, gen_len=12, shard="bfcl_00000.npz", recipe=recipe)
    fd = FeatureData(data, tiny_dlite_config(tiny_target).target_layer_ids, heldout_mod=0)
    fd.eval_idx = list(range(6))
    info = ht.drop_seen_prompts(fd, data, ["bfcl:4"], 3)
    assert fd.eval_idx == [4, 5] and info["heldout_sequences_after"] == 2
    fd.eval_idx = list(range(6))
    with pytest.raises(DLiteInputError, match="nothing clean"):
        ht.drop_seen_prompts(fd, data, ["bfcl:6"], 3)
    # several runs (each with its own seed): --exclude-prompts/--exclude-seed and every --exclude-run
    args = ht.parse_args(["--drafter", "x", "--exclude-prompts", "bfcl:2", "--exclude-seed", "3",
                          "--exclude-run", "3", "bfcl:4", "--exclude-run", "9", "bfcl:1"])
    runs = ht.exclusion_runs(args)
    assert runs == [(3, ["bfcl:2"]), (3, ["bfcl:4"]), (9, ["bfcl:1"])]
    fd.eval_idx = list(range(6))
    infos = ht.drop_seen_runs(fd, data, runs)
    seed9 = {k for k, v in sequence_prompt_ids(recipe).items() if v in prompt_ids(["bfcl:1"], 9)}
    kept = [i for i in range(4, 6) if f"bfcl_00000.npz:{i}" not in seed9]
    assert fd.eval_idx == kept and [i["heldout_sequences_after"] for i in infos][:2] == [4, 2]
    for bad in (["--exclude-run", "bfcl:4"], ["--exclude-run", "3"]):
        with pytest.raises(DLiteInputError, match="seed first"):
            ht.exclusion_runs(ht.parse_args(["--drafter", "x", *bad]))


def test_stage_budget_minutes_parse():
    """--stage-budget-min: one value per stage or three; with --single-stage one value is the
    stage's own budget (regression: it was tripled) and three give their sum."""
    import argparse

    from dlite_lab.training.train import add_arguments, options_from_args

    def budget(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return options_from_args(p.parse_args(["--data", "d", "--out", "o", *argv])).time_budget_s

    assert budget("--stage-budget-min", "10") == {"teacher": 600, "distill": 600, "stabilize": 600}
    assert budget("--stage-budget-min", "15,15,25") == {"teacher": 900, "distill": 900, "stabilize": 1500}
    assert budget("--single-stage", "--stage-budget-min", "60")["stabilize"] == 3600
    assert budget("--single-stage", "--stage-budget-min", "15,15,25")["stabilize"] == 3300
    assert budget() is None
    with pytest.raises(Exception, match="one value or one per stage"):
        budget("--stage-budget-min", "1,2")


def test_stabilize_loss_weights_are_checked():
    import argparse

    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.training.train import add_arguments, options_from_args

    def opts(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return options_from_args(p.parse_args(["--data", "d", "--out", "o", *argv]))

    assert opts("--ce-weight", "0", "--kl-weight", "1").kl_weight == 1.0
    with pytest.raises(DLiteInputError, match="not all 0"):
        opts("--ce-weight", "0", "--tv-weight", "0")
    with pytest.raises(DLiteInputError, match=r"--tv-weight -1"):
        opts("--tv-weight", "-1")
    # the head's input is a config override of the drafter (the token-feedback head ablation)
    assert opts("--head-input", "token").config_overrides["head_input"] == "token"
    assert opts("--ema-decay", "0.999").ema_decay == 0.999 and opts().ema_decay == 0.0
    with pytest.raises(DLiteInputError, match=r"--ema-decay must be in \[0, 1\)"):
        opts("--ema-decay", "1")
    assert "head_input" not in opts().config_overrides


def test_train_default_recipe_wiring():
    """`make train-default` (= train-default --single-stage): gen-data captures the recipe's layers,
    training uses every position as an anchor, the same layers, and 55 minutes of stabilization."""
    import argparse

    from dlite_lab.training import recipe
    from dlite_lab.training.train import options_from_args

    p = argparse.ArgumentParser()
    recipe.add_arguments(p)
    args = p.parse_args(["--single-stage"])
    g = recipe.gen_args(args)
    assert g.capture_layers == "2,15,27" and g.prompts == ["sharegpt:480", "bfcl:192", "stdlib:192"]
    opts = options_from_args(recipe.train_args(args, "out"))
    assert opts.stages == ["stabilize"] and opts.anchor_tokens == "all"
    assert opts.config_overrides["target_layer_ids"] == [2, 15, 27]
    assert opts.time_budget_s["stabilize"] == 55 * 60 and opts.vocab_subset == 8192
    # bf16 is the device's default: autocast on a GPU, float32 on a CPU (emulated bf16 is ~3x slower there)
    from dlite_lab.training.loop import use_bf16
    assert opts.bf16 is None and not use_bf16(opts, torch.device("cpu")) and use_bf16(opts, torch.device("cuda"))
    assert args.draft_vocab == 8192  # as many most-frequent tokens as the training losses cover


# ---- bf16 autocast on CPUs without bf16 instructions (training/precision.py) ----

def _cpuinfo(tmp_path, text):
    p = tmp_path / "cpuinfo"
    p.write_text(text)
    return str(p)


def test_cpu_native_bf16_reads_the_cpu_flags(tmp_path):
    from dlite_lab.training.precision import cpu_native_bf16, emulated_bf16_note

    no_bf16 = _cpuinfo(tmp_path, "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n")
    assert cpu_native_bf16(no_bf16) is False
    note = emulated_bf16_note("train[stabilize]", no_bf16)
    assert note.startswith("train[stabilize]: --bf16 on a CPU without bf16 instructions") and "drop --bf16" in note
    for flags in ("flags\t: avx512f avx512_bf16\n", "flags\t: amx_bf16 amx_tile\n", "Features\t: fp asimd bf16 i8mm\n"):
        has = _cpuinfo(tmp_path, flags)
        assert cpu_native_bf16(has) is True and emulated_bf16_note("x", has) is None
    missing = str(tmp_path / "absent")
    assert cpu_native_bf16(missing) is None and emulated_bf16_note("x", missing) is None


def test_bench_heldout_anchor_set_pins_the_anchors(tmp_path, tiny_target):
    """--anchor-set: the set written is the set read back (same sequences, same anchors, same tau);
    a folder that lacks a pinned sequence, or whose sequence no longer has a pinned anchor, is
    refused with a message naming the sequence."""
    import importlib.util

    from sglang_dlite.errors import DLiteInputError

    spec = importlib.util.spec_from_file_location("heldout_tau", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "heldout_tau.py"))
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    cfg, fd, model, groups = _heldout_setup(tmp_path, tiny_target)
    path = str(tmp_path / "pinned" / "anchors.json")
    ht.save_anchor_set(path, fd, groups, {"seed": 1234})
    back = ht.load_anchor_set(path, fd, "DATA")
    assert [si for si, _ in back] == [si for si, _ in groups]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(back, groups))
    assert ht.heldout_tau(model, fd, back, bf16=False) == ht.heldout_tau(model, fd, groups, bf16=False)
    pinned = json.load(open(path))
    first = pinned["sequences"][0]["name"]
    pinned["sequences"][0]["name"] = "gone_00099.npz:0"
    json.dump(pinned, open(path, "w"))
    with pytest.raises(DLiteInputError, match=r"1 pinned sequence\(s\) are not there \(e.g. gone_00099.npz:0\)"):
        ht.load_anchor_set(path, fd, "DATA")
    pinned["sequences"][0]["name"] = first
    pinned["sequences"][0]["anchors"] = [10 ** 6]
    json.dump(pinned, open(path, "w"))
    with pytest.raises(DLiteInputError, match="changed"):
        ht.load_anchor_set(path, fd, "DATA")


def test_bench_heldout_pack_scores_the_same_anchors_without_the_gen_data_folder(tmp_path, tiny_target):
    """--pack: the held-out sequences and anchors chosen now, written as a folder of token ids (no
    features), read back on their own (features recomputed from the target) give the same tau and
    per-position acceptance as the gen-data folder they came from; a pack is never overwritten, and
    options that choose or filter a set are refused on a pack."""
    import importlib.util
    import shutil

    from sglang_dlite.errors import DLiteInputError

    spec = importlib.util.spec_from_file_location("heldout_tau", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "heldout_tau.py"))
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    cfg, fd, model, _ = _heldout_setup(tmp_path, tiny_target)
    fd.eval_idx = [0, 2, 3]
    groups = ht.eval_groups(fd, 48)
    pack = str(tmp_path / "pack")
    m = ht.write_pack(pack, fd, groups, {"data": fd.data_dir, "seed": 1234})
    assert ht.is_pack(pack) and not ht.is_pack(fd.data_dir)
    assert [e["origin"] for e in m["sequences"]] == [fd.seqs[si][4] for si, _ in groups]
    assert not any(f.endswith(".npy") for f in os.listdir(pack))  # ids only: the features are not shipped
    shutil.rmtree(fd.data_dir)  # the gen-data folder is gone (a new machine)
    pdata, pgroups = ht.load_pack(pack, cfg.target_layer_ids, tiny_target)
    assert [len(a) for _, a in pgroups] == [len(a) for _, a in groups]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(pgroups, groups))
    got, ref = ht.heldout_tau(model, pdata, pgroups, bf16=False), ht.heldout_tau(model, fd, groups, bf16=False)
    assert got["anchors"] == ref["anchors"] and got["tau"] == pytest.approx(ref["tau"], abs=1e-4)
    assert got["acc_per_pos"] == pytest.approx(ref["acc_per_pos"], abs=1e-4)
    assert list(got["by_source"]) == ["tiny"]
    with pytest.raises(DLiteInputError, match="a pack is already there"):
        ht.write_pack(pack, fd, groups, {})
    for extra in (["--exclude-run", "1", "bfcl:4"], ["--anchor-set", "a.json"], ["--pack", "p2"]):
        args = ht.parse_args(["--drafter", "x", "--data", pack, *extra])
        with pytest.raises(DLiteInputError, match="is a held-out pack"):
            ht.check_pack_options(args, ht.exclusion_runs(args))
    ht.check_pack_options(ht.parse_args(["--drafter", "x", "--data", pack]), [])
