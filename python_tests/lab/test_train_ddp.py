"""Data-parallel training under torchrun (training/distributed.py, loop.py): 2 gloo processes on
the CPU follow the loss curve of 1 process with the doubled batch, ranks draw disjoint shares of
every global batch that together cover it (sampled and streamed data), a 2-process checkpoint
resumes in 1 process at the right step with the same data, and the removed ``--ddp`` is refused
with the torchrun command to use instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama, write_greedy_feature_shards

LAYERS = [1, 3]
# the tiny drafter, in `sglang-dlite train` spelling and as TrainOptions overrides
CFG_ARGS = ["--num-context-positions", "3", "--num-layers", "2", "--target-layer-ids", ",".join(map(str, LAYERS))]
CFG_OVERRIDES = {"num_context_positions": 3, "num_layers": 2, "target_layer_ids": LAYERS}
STEPS = 6
# per-step training loss of 2 processes vs 1 process with the doubled batch: same data, same
# normalization, only the float summation order differs
REL_TOL = 2e-4


def _save_tiny_tokenizer(path, vocab: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target folder (weights + tokenizer) and 2 shards of 5 greedy sequences with features."""
    root = tmp_path_factory.mktemp("ddp")
    target = make_tiny_llama()
    tdir = root / "target"
    target.save_pretrained(tdir)
    _save_tiny_tokenizer(tdir, target.config.vocab_size)
    torch.manual_seed(7)
    d = root / "data"
    d.mkdir()
    write_greedy_feature_shards(target, d, LAYERS, shards=2, seqs_per_shard=5, new_tokens=26)
    return str(tdir), str(d)


def _opts(**kw):
    from dlite_lab.training.options import TrainOptions

    base = dict(stages=["stabilize"], steps={"teacher": 0, "distill": 0, "stabilize": STEPS}, lr=3e-3,
                batch_size=16, seqs_per_batch=4, eval_every=1000, eval_anchors=16, save_every=1000, log_every=1,
                progress=False, config_overrides=dict(CFG_OVERRIDES), vocab_subset=16, device="cpu")
    base.update(kw)
    return TrainOptions(**base)


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r}


def test_two_processes_match_one_with_the_doubled_batch_and_resume_in_one(setup, tmp_path):
    from sglang_dlite.model.dlite import DLiteDrafter
    from sglang_dlite.model.bundled_target import load_target
    from dlite_lab.training.stages import train_pipeline

    tdir, data = setup
    a = str(tmp_path / "two")
    # 2 gloo processes, 8 anchors (2 sequences) each per step; paused after 3 of the 6 steps
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sglang_dlite", "train", "--target", tdir, "--data", data, "--out", a, "--device", "cpu",
           "--single-stage", "--steps-stabilize", str(STEPS), "--stop-after-steps", "3", "--batch-size", "8",
           "--seqs-per-batch", "2", "--lr", "3e-3", "--vocab-subset", "16", "--log-every", "1", "--eval-every", "1000",
           "--eval-anchors", "16", "--save-every", "1000", "--threads", "1", "--no-progress", *CFG_ARGS]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 process(es) on cpu, global batch 16 anchors" in r.stdout
    ck = torch.load(os.path.join(a, "stabilize", "ckpt.pt"), weights_only=False)
    assert (ck["step"], ck["world_size"], ck["global_batch"]) == (3, 2, 16)
    assert not any(k.endswith(("embed_weight", "lm_head_weight")) for k in ck["model"])  # the target is not saved
    assert sorted(_losses(a)) == [1, 2, 3]

    target, _ = load_target(tdir)
    # the same run in one process with the doubled batch (16 anchors, 4 sequences per step)
    b = str(tmp_path / "one")
    train_pipeline(target, data, b, _opts())
    one = _losses(b)
    # resume the 2-process checkpoint in one process (same global batch): steps 4..6
    res = train_pipeline(target, data, a, _opts(resume=True))
    assert "stabilize" in res and json.load(open(os.path.join(a, "stabilize", "DONE.json")))["steps"] == STEPS
    two = _losses(a)
    assert sorted(two) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert two[s] == pytest.approx(one[s], rel=REL_TOL), (s, two, one)
    ma = DLiteDrafter.from_pretrained(res["stabilize"]).state_dict()
    mb = DLiteDrafter.from_pretrained(os.path.join(b, "stabilize", "model")).state_dict()
    for k in mb:
        torch.testing.assert_close(ma[k], mb[k], atol=2e-5, rtol=1e-4, msg=f"{k} differs")
    # the tolerance separates: one process with the undoubled batch sees other data
    c = str(tmp_path / "half")
    train_pipeline(target, data, c, _opts(batch_size=8, seqs_per_batch=2, steps={"teacher": 0, "distill": 0, "stabilize": 3}))
    half = _losses(c)
    assert any(abs(half[s] - one[s]) > 10 * REL_TOL * abs(one[s]) for s in (1, 2, 3)), (half, one)


def _keys(groups, name):
    return [(name(g), int(a)) for g, anchors in groups for a in anchors]


def test_rank_shares_of_sampled_batches_are_disjoint_and_cover_the_global_batch(setup):
    """Every step the ranks' shares are disjoint and together the global batch, which is what one
    process with the doubled batch draws from the same generator."""
    from dlite_lab.training.dataset import FeatureData, sample_batch
    from dlite_lab.training.distributed import rank_slice

    _, data = setup
    fd = FeatureData(data, LAYERS)
    world, S, B = 2, 2, 8
    r2, r1 = np.random.default_rng([0, 2, 0]), np.random.default_rng([0, 2, 0])
    for _ in range(20):
        glob = sample_batch(fd, r2, B * world, S * world)
        shares = [rank_slice(glob, r, world) for r in range(world)]
        keys = [set(_keys(sh, lambda si: si)) for sh in shares]
        assert all(len(sh) == S for sh in shares)
        assert not keys[0] & keys[1]  # no anchor on two ranks
        assert sum(shares, []) == glob  # together: the global batch, in order
        one = sample_batch(fd, r1, B * world, S * world)  # one process, doubled batch
        assert [(s, a.tolist()) for s, a in one] == [(s, a.tolist()) for s, a in glob]
    with pytest.raises(Exception, match="evenly"):
        rank_slice(list(range(5)), 0, 2)


def test_rank_shares_of_a_streamed_epoch_are_disjoint_and_cover_every_anchor(setup):
    from dlite_lab.training.data import load_shard
    from dlite_lab.training.distributed import rank_slice
    from dlite_lab.training.stream import ShardStream, is_heldout

    _, data = setup
    files = sorted(f for f in os.listdir(data) if f.endswith(".npz"))
    st = ShardStream(data, LAYERS, files, window=2, per=4)
    st.start([0, 2])
    world, S = 2, 2
    seen = [[] for _ in range(world)]
    while st.epoch == 0:
        glob = st.next_batch(S * world)
        if st.epoch:  # this batch straddles into epoch 1
            break
        for r in range(world):
            seen[r] += [(ref[0].file, int(ref[1]), int(a)) for ref in rank_slice(glob, r, world) for a in ref[3]]
    want = set()
    for f in files:
        ids, mask, off = load_shard(os.path.join(data, f))
        for s in range(len(off) - 1):
            if not is_heldout(f"{f}:{s}", 16):
                a, b = int(off[s]), int(off[s + 1])
                want |= {(f, a, n) for n in range(1, b - a - 1) if mask[a + n + 1] == 1}
    assert len(seen[0]) == len(set(seen[0])) and len(seen[1]) == len(set(seen[1]))
    assert not set(seen[0]) & set(seen[1])  # disjoint
    covered = set(seen[0]) | set(seen[1])
    assert covered <= want and len(want - covered) < S * world * 4  # all but the straddling batch
    assert len(seen[0]) > 0 and len(seen[1]) > 0


def test_removed_ddp_flag_says_to_use_torchrun(setup, tmp_path, capsys):
    from sglang_dlite.cli import main

    _, data = setup
    assert main(["train", "--data", data, "--out", str(tmp_path / "o"), "--ddp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--ddp was removed" in err and "torchrun --nproc-per-node N -m sglang_dlite train" in err


def test_device_option():
    from sglang_dlite.errors import DLiteConfigError
    from dlite_lab.training.distributed import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DLiteConfigError, match="--device must be one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DLiteConfigError, match="sees no CUDA device"):
            resolve_device("cuda")
        # gen-data --feature-device goes through the same check, naming its own flag
        with pytest.raises(DLiteConfigError, match="--feature-device cuda: .*sees no CUDA device.*--feature-device cpu"):
            resolve_device("cuda", flag="--feature-device")
