"""Streaming training (training/stream.py, ``train --stream-window``): a window of shards at a
time, every training anchor once per epoch, and a resumed run continues the same schedule and the
same data order without reopening the shards it had finished."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama, tiny_dlite_config, write_greedy_feature_shards

from dlite_lab.training.stream import ShardStream, is_heldout


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, target):
    """8 shards of 2 greedy-generated sequences each, with features."""
    torch.manual_seed(5)
    d = tmp_path_factory.mktemp("stream_data")
    layers = tiny_dlite_config(target).target_layer_ids
    infos = write_greedy_feature_shards(target, d, layers, shards=8, seqs_per_shard=2, new_tokens=30)
    return str(d), layers, [i["file"] for i in infos]


def _key(ref):
    sh, start, length, anchors = ref
    return (sh.file, int(start), tuple(int(a) for a in anchors))


def test_stream_epoch_covers_every_anchor_once_within_window(shard_dir):
    d, layers, files = shard_dir
    st = ShardStream(d, layers, files, window=2, per=8)
    st.start([0, 2])
    seen, progress = [], [st.epochs_done]
    while st.epoch == 0:
        refs = st.next_batch(2)
        seen += [(_key(r), st.epoch) for r in refs]
        assert len(st.open) <= 2
        progress.append(st.epochs_done)
    # the epoch counter moves with every batch (not only when a shard closes) and never backwards
    assert progress[0] == 0.0 and all(b > a for a, b in zip(progress, progress[1:]))
    assert 0.9 < progress[-2] <= 1.0 <= progress[-1] < 1.5
    assert st.max_open <= 2
    # the shards each loaded once in epoch 0, then epoch 1 began
    assert sorted(f for e, f in st.opened_log if e == 0) == sorted(files)
    # every (non-held-out) generated anchor exactly once in epoch 0
    from dlite_lab.training.data import load_shard

    want = set()
    for f in files:
        ids, mask, off = load_shard(os.path.join(d, f))
        for s in range(len(off) - 1):
            if is_heldout(f"{f}:{s}", 16):
                continue
            a, b = int(off[s]), int(off[s + 1])
            want |= {(f, a, int(n)) for n in range(1, b - a - 1) if mask[a + n + 1] == 1}
    drawn = {}
    for (f, start, a), e in seen[:-2]:  # the last batch may straddle into epoch 1
        for x in a:
            drawn[(f, start, x)] = drawn.get((f, start, x), 0) + 1
    assert set(drawn) <= want and max(drawn.values()) == 1
    assert len(want - set(drawn)) <= 2 * 8  # at most the straddling batch's chunks


def test_stream_resume_continues_same_batches_without_reopening(shard_dir):
    d, layers, files = shard_dir
    a = ShardStream(d, layers, files, window=2, per=8)
    a.start([0, 2])
    full = [[_key(r) for r in a.next_batch(2)] for _ in range(30)]
    b = ShardStream(d, layers, files, window=2, per=8)
    b.start([0, 2])
    first = [[_key(r) for r in b.next_batch(2)] for _ in range(12)]
    state = json.loads(json.dumps(b.state_dict()))  # what the checkpoint stores
    finished = [f for e, f in b.opened_log if f not in {x[0] for x in state["open"]}]
    assert finished, "the test needs shards finished before the pause"
    c = ShardStream(d, layers, files + ["not_yet_in_the_stream.npz"], window=2, per=8)  # the manifest grew
    c.load_state_dict(state)
    rest = [[_key(r) for r in c.next_batch(2)] for _ in range(18)]
    assert first + rest == full
    reopened = [f for e, f in c.opened_log if e == 0 and f in finished]
    assert not reopened, f"resume re-read consumed shards {reopened}"
    assert c.files == files


def test_stream_state_must_match_options(shard_dir):
    from dlite_lab.training.data import DataError

    d, layers, files = shard_dir
    b = ShardStream(d, layers, files, window=2, per=8)
    b.start([0, 2])
    b.next_batch(2)
    c = ShardStream(d, layers, files, window=2, per=4)
    with pytest.raises(DataError, match="per"):
        c.load_state_dict(b.state_dict())


def _opts(**kw):
    from dlite_lab.training.train import TrainOptions

    c = tiny_dlite_config(make_tiny_llama())
    ov = dict(num_context_positions=c.num_context_positions, block_size=c.block_size, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=16, intermediate_size=96, rnn_rank=8)
    base = dict(stages=["stabilize"], steps={"teacher": 0, "distill": 0, "stabilize": 16}, lr=3e-3, batch_size=32,
                seqs_per_batch=2, eval_every=1000, eval_anchors=32, save_every=4, progress=False, config_overrides=ov,
                stream_window=2, eval_shards=4, device="cpu")
    base.update(kw)
    return TrainOptions(**base)


def test_train_resume_mid_run_equals_uninterrupted_run(shard_dir, target, tmp_path, monkeypatch):
    """A run paused after 6 steps and resumed ends with the same weights as one uninterrupted run
    (fails if resume restarted from step 0, changed the schedule, or drew other data), and the
    resumed process does not reopen the shards finished before the pause."""
    from sglang_dlite.model.dlite import DLiteDrafter
    from dlite_lab.training import stream as stream_mod
    from dlite_lab.training.train import train_pipeline

    d, layers, files = shard_dir
    full = train_pipeline(target, d, str(tmp_path / "a"), _opts())
    assert "paused" not in full
    r1 = train_pipeline(target, d, str(tmp_path / "b"), _opts(stop_after_steps=6))
    assert r1.get("paused") == "stabilize" and "stabilize" not in r1
    ck = torch.load(tmp_path / "b" / "stabilize" / "ckpt.pt", weights_only=False)
    assert ck["step"] == 6
    st = ck["stream"]
    order = np.random.default_rng(st["seed"] + [0, 7]).permutation(len(files))
    consumed = [files[i] for i in order[: st["next"]] if files[i] not in {x[0] for x in st["open"]}]
    assert consumed, "the test needs shards finished before the pause"
    loaded = []
    orig = stream_mod.ShardStream._load

    def spy(self, fname):
        loaded.append((self.epoch, fname))
        return orig(self, fname)

    monkeypatch.setattr(stream_mod.ShardStream, "_load", spy)
    r2 = train_pipeline(target, d, str(tmp_path / "b"), _opts(resume=True))
    assert "stabilize" in r2 and "paused" not in r2
    assert not [f for e, f in loaded if e == 0 and f in consumed], "resume re-read consumed shards"
    done = json.load(open(tmp_path / "b" / "stabilize" / "DONE.json"))
    assert done["steps"] == 16
    ma = DLiteDrafter.from_pretrained(full["stabilize"]).state_dict()
    mb = DLiteDrafter.from_pretrained(r2["stabilize"]).state_dict()
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], atol=1e-6, rtol=1e-5, msg=f"{k} differs after resume")
    info = json.load(open(tmp_path / "b" / "train_info.json"))
    assert info["streaming"]["window"] == 2 and info["streaming"]["shards"] == 8


def test_ema_is_updated_each_step_resumed_and_is_what_the_run_saves(shard_dir, target, tmp_path):
    """--ema-decay: after every step the average moves toward the new weights by the warmed-up
    decay (checked by hand across a pause/resume boundary), the paused + resumed run ends with the
    uninterrupted run's weights, and the saved drafter is the average, not the last raw weights."""
    from sglang_dlite.model.dlite import DLiteDrafter
    from dlite_lab.training.ema import warmed_decay
    from dlite_lab.training.train import train_pipeline

    d, _, _ = shard_dir
    full = train_pipeline(target, d, str(tmp_path / "a"), _opts(ema_decay=0.9))
    run = str(tmp_path / "b")
    ck_path = tmp_path / "b" / "stabilize" / "ckpt.pt"
    train_pipeline(target, d, run, _opts(ema_decay=0.9, stop_after_steps=6))
    ck6 = torch.load(ck_path, weights_only=False)
    train_pipeline(target, d, run, _opts(ema_decay=0.9, stop_after_steps=1, resume=True))
    ck7 = torch.load(ck_path, weights_only=False)
    assert (ck6["step"], ck7["step"]) == (6, 7)
    names = [n for n, p in DLiteDrafter(tiny_dlite_config(target, **_opts().config_overrides)).named_parameters()
             if p.requires_grad]
    assert len(names) == len(ck7["ema"]["shadow"])
    dt = warmed_decay(0.9, 6)
    assert dt == 7 / 16  # still warming up
    for n, e6, e7 in zip(names, ck6["ema"]["shadow"], ck7["ema"]["shadow"]):
        torch.testing.assert_close(e7, dt * e6 + (1 - dt) * ck7["model"][n], atol=1e-6, rtol=1e-5, msg=n)
    r = train_pipeline(target, d, run, _opts(ema_decay=0.9, resume=True))
    ck = torch.load(ck_path, weights_only=False)
    saved = DLiteDrafter.from_pretrained(r["stabilize"]).state_dict()
    moved = 0
    for n, e in zip(names, ck["ema"]["shadow"]):
        torch.testing.assert_close(saved[n], e, msg=f"{n}: the saved drafter is not the average")
        moved += not torch.allclose(e, ck["model"][n])
    assert moved, "the average equals the raw weights: the EMA did nothing"
    ref = DLiteDrafter.from_pretrained(full["stabilize"]).state_dict()
    for k in ref:
        torch.testing.assert_close(ref[k], saved[k], atol=1e-6, rtol=1e-5, msg=f"{k} differs after resume")
    from dlite_lab.training.model_card import render_card
    from dlite_lab.training.run_summary import summarize

    assert "exponential moving average, decay 0.9" in render_card(summarize(run, d))


def test_training_json_written_and_read_back_by_the_card(shard_dir, target, tmp_path, monkeypatch):
    """training.json lands beside the model's config.json (data + run + held-out tau with CI and
    every command of a run resumed across invocations), the export copies it, and the model card
    renders it."""
    from dlite_lab.training import model_card
    from dlite_lab.training.recipe import export
    from dlite_lab.training.run_summary import summarize
    from dlite_lab.training.train import train_pipeline

    d, layers, files = shard_dir
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["sglang-dlite", "train", "--out", str(out), "--steps-stabilize", "4"])
    train_pipeline(target, d, str(out), _opts(steps={"teacher": 0, "distill": 0, "stabilize": 4}))
    # resumed in another working period, extended to 6 steps: both commands are recorded
    monkeypatch.setattr(sys, "argv", ["sglang-dlite", "train", "--out", str(out), "--steps-stabilize", "6", "--resume"])
    done = train_pipeline(target, d, str(out), _opts(steps={"teacher": 0, "distill": 0, "stabilize": 6}, resume=True))
    mdir = done["stabilize"]
    assert os.path.isfile(os.path.join(mdir, "config.json"))
    t = model_card.read_training_json(mdir)
    assert t["data"]["sequences"] == 16 and t["data"]["generated_tokens"] == 16 * 30
    assert t["run"]["steps"] == 6 and t["run"]["final_stage"] == "stabilize" and t["run"]["wall_s"] > 0
    h = t["run"]["heldout_tau"]
    assert h["ci95"][0] <= h["mean"] <= h["ci95"][1] and h["anchors"] > 0
    assert t["run"]["epochs"] is not None and t["run"]["options"]["stream_window"] == 2
    s = summarize(str(out), d)
    dest = tmp_path / "export"
    export(mdir, str(dest), model_card.render_card(s))
    assert model_card.read_training_json(str(dest)) == t
    # re-rendering the card from the export reads training.json back
    model_card.main(["--run", str(out), "--data", d, "--dest", str(dest)])
    card = open(dest / "README.md").read()
    assert "## Training record (`training.json`)" in card
    assert "16 sequences" in card and f"{h['mean']:.3f}" in card and "95 % CI" in card
    assert t["run"]["commands"] == [f"sglang-dlite train --out {out} --steps-stabilize 4",
                                    f"sglang-dlite train --out {out} --steps-stabilize 6 --resume"]
    assert f"`sglang-dlite train --out {out} --steps-stabilize 6 --resume`" in card and "was resumed" in card
    assert "Streamed from" in card  # a streaming run: its shards, not a count of training anchors
    # bench/compare_runs.py reads the same folder: every evaluation with the compute spent by then
    # (no --threads in the recorded command: the CLI default, 2 per process)
    c = _compare_runs().run_curve(str(out))
    assert c["processes"] == 1 and c["threads_per_process"] == 2 and c["threads_from"] == "recorded command"
    assert [p["step"] for p in c["points"]][-1] == 6 and c["points"][-1]["tau"] == pytest.approx(h["mean"], abs=1e-3)


def _compare_runs():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "compare_runs", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "compare_runs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_runs_puts_runs_on_one_compute_axis(tmp_path, capsys):
    """Thread-minutes = wall x processes x threads (the recorded --threads, else the --threads
    override, else 1); JSON + PNG written; a folder that is not a run and a bad --mark are refused."""
    cr = _compare_runs()

    def run(name, procs, command, evals):
        d = tmp_path / name
        d.mkdir()
        info = {"processes": procs, "global_batch": {"anchors": 32}}
        if command is not None:
            info["invocations"] = [{"command": command, "processes": procs}]
        (d / "train_info.json").write_text(json.dumps(info))
        with open(d / "metrics.jsonl", "w") as f:
            for step, wall, tau in evals:
                f.write(json.dumps({"stage": "stabilize", "step": step, "loss": 1.0, "wall_s": wall}) + "\n")
                f.write(json.dumps({"stage": "stabilize", "step": step, "tau_proxy": tau, "tau_ci95": [tau - .1, tau + .1],
                                    "acc_per_pos": [0.3, 0.1]}) + "\n")
        return str(d)

    a = run("a", 2, "python -m sglang_dlite train --threads 1 --out a", [(10, 60.0, 1.2), (20, 120.0, 1.3)])
    b = run("b", 1, None, [(10, 600.0, 1.25)])
    out, png = tmp_path / "runs.json", tmp_path / "runs.png"
    assert cr.main([f"A={a}", f"B={b}", "--threads", "B=3", "--mark", "eagle3=68", "--out", str(out), "--plot", str(png)]) == 0
    res = json.load(open(out))
    assert [p["thread_min"] for p in res["runs"]["A"]["points"]] == [2.0, 4.0]  # 60 s x 2 procs x 1 thread
    assert res["runs"]["B"]["points"][0]["thread_min"] == 30.0 and res["runs"]["B"]["threads_from"] == "--threads"
    assert res["marks"] == {"eagle3": 68.0} and png.stat().st_size > 0
    assert "1.300" in capsys.readouterr().out
    assert cr.run_curve(b)["threads_from"].startswith("assumed 1")
    with pytest.raises(SystemExit, match="not a train --out folder"):
        cr.run_curve(str(tmp_path))
    with pytest.raises(SystemExit, match="LABEL=THREAD_MINUTES"):
        cr.main([f"A={a}", "--mark", "eagle3"])


def test_select_shards_by_source_range_glob_and_refuses_a_spec_that_picks_nothing():
    from dlite_lab.training.data import DataError, select_shards

    shards = [{"file": f"{s}_{i:05d}.npz"} for s in ("sharegpt", "codegen", "agent") for i in range(6)]
    names = lambda specs: [sh["file"] for sh in select_shards(shards, specs)]  # noqa: E731
    assert names(None) == names([]) == [sh["file"] for sh in shards]
    assert names(["sharegpt:2-4"]) == ["sharegpt_00002.npz", "sharegpt_00003.npz", "sharegpt_00004.npz"]
    assert names(["codegen:5", "agent"]) == ["codegen_00005.npz"] + [f"agent_{i:05d}.npz" for i in range(6)]
    assert names(["sharegpt_0000[01].npz", "sharegpt:1-2"]) == [f"sharegpt_{i:05d}.npz" for i in range(3)]  # no duplicates
    with pytest.raises(DataError, match=r"'toolchat' matches none of the 18 .*sources: agent, codegen, sharegpt"):
        select_shards(shards, ["sharegpt", "toolchat"])
    with pytest.raises(DataError, match="sharegpt:7-9' matches none"):
        select_shards(shards, ["sharegpt:7-9"])
    with pytest.raises(DataError, match="is empty"):
        select_shards(shards, ["sharegpt:4-2"])


def test_train_on_a_shard_subset_streams_and_evaluates_only_those_shards(shard_dir, target, tmp_path, monkeypatch):
    """``train --shards``: the stream opens only the selected shards, the held-out view is built from
    them, train_info.json records the selection, and the CLI parses the specs into the options."""
    from dlite_lab.training import stages as stages_mod
    from dlite_lab.training import stream as stream_mod
    from dlite_lab.training.options import add_arguments, options_from_args
    from dlite_lab.training.train import train_pipeline

    d, layers, files = shard_dir
    picked = files[2:5]
    loaded, held = [], []
    orig_load, orig_fd = stream_mod.ShardStream._load, stages_mod.FeatureData

    def spy(self, fname):
        loaded.append(fname)
        return orig_load(self, fname)

    def spy_fd(*a, **kw):
        held.extend(kw.get("shard_files") or [])
        return orig_fd(*a, **kw)

    monkeypatch.setattr(stream_mod.ShardStream, "_load", spy)
    monkeypatch.setattr(stages_mod, "FeatureData", spy_fd)
    out = tmp_path / "sub"
    done = train_pipeline(target, d, str(out), _opts(steps={"teacher": 0, "distill": 0, "stabilize": 6}, shards=["tiny:2-4"]))
    assert "stabilize" in done
    assert loaded and set(loaded) <= set(picked) and set(held) <= set(picked) and held
    info = json.load(open(out / "train_info.json"))
    assert info["streaming"]["shards"] == 3 and info["streaming"]["selected"] == ["tiny:2-4"]
    # the drafter's training.json counts the data it trained on, not the whole folder
    rec = json.load(open(out / "stabilize" / "model" / "training.json"))["data"]
    assert rec["shards"] == 3 and rec["sequences"] == 6 and rec["selected"] == ["tiny:2-4"]
    # --resume continues the checkpoint's shard schedule: another selection is refused, not silently ignored
    from sglang_dlite.errors import DLiteInputError

    more = {"teacher": 0, "distill": 0, "stabilize": 8}
    with pytest.raises(DLiteInputError, match=r"trained with --shards tiny:2-4, this command asks for --shards tiny:2-3"):
        train_pipeline(target, d, str(out), _opts(steps=more, shards=["tiny:2-3"], resume=True))
    with pytest.raises(DLiteInputError, match=r"asks for no --shards \(every shard of --data\)"):
        train_pipeline(target, d, str(out), _opts(steps=more, resume=True))
    loaded.clear()
    train_pipeline(target, d, str(out), _opts(steps=more, shards=["tiny:2-4"], resume=True))  # the same selection resumes
    assert json.load(open(out / "stabilize" / "DONE.json"))["requested"] == 8
    assert set(loaded) <= set(picked)
    # a fresh run (no --resume) into the folder may pick anything
    train_pipeline(target, d, str(out), _opts(steps={"teacher": 0, "distill": 0, "stabilize": 4}, shards=["tiny:2-3"]))
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--data", d, "--out", str(out), "--shards", "tiny:2-4", "tiny_00007.npz"])
    assert options_from_args(args).shards == ["tiny:2-4", "tiny_00007.npz"]
    from dlite_lab.training.data import DataError

    with pytest.raises(DataError, match="'sharegpt' matches none"):
        train_pipeline(target, d, str(tmp_path / "bad"), _opts(shards=["sharegpt"]))
