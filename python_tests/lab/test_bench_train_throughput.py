"""bench/train_throughput.py: configs parsed (bad ones refused with the format), and a real side-by-side run
on a tiny regenerated folder: every config trains, its anchors/s comes from the trainer's metrics, the
first is the baseline, and the JSON + table hold them."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _bench():
    spec = importlib.util.spec_from_file_location("train_throughput", os.path.join(ROOT, "bench", "train_throughput.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_throughput_configs_are_parsed_and_bad_ones_refused():
    tt = _bench()
    assert tt.parse_config("bf16:64x4") == {"name": "bf16:64x4", "bf16": True, "batch_size": 64, "seqs_per_batch": 4}
    assert tt.parse_config("fp32:8x1")["bf16"] is False
    for bad in ("fp16:32x2", "fp32:32", "fp32:2x4", "fp32:0x0"):
        with pytest.raises(SystemExit, match="PRECISION:BATCHxSEQS|1 <= SEQS <= BATCH"):
            tt.parse_config(bad)


def test_train_throughput_runs_configs_side_by_side(tiny_ckpt, tmp_path, capsys):
    from types import SimpleNamespace

    from dlite_lab.training import gen_data

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: " + "word " * (4 + 3 * i)}]})
                               + "\n" for i in range(6)))
    data = tmp_path / "data"
    a = SimpleNamespace(target=tiny_ckpt, prompts=[f"jsonl:{prompts}"], out=str(data), shard_size=3, max_new_tokens=24,
                        max_len=256, max_turns=1, max_user_tokens=64, temperature=0.0, top_p=1.0, seed=0, threads=1,
                        max_shards=None, budget_min=None, worker="0/1", reverse=False, capture_layers="1,4",
                        no_features=False, engine="fast", min_free_gb=0.0, batch_size=4, dtype="float32", relabel=False)
    assert gen_data.run(a) == 0
    tt = _bench()
    out = tmp_path / "tt.json"
    with pytest.raises(SystemExit, match="must be >= 2 x --log-every"):
        tt.main(["--data", str(data), "--steps", "5", "--log-every", "5"])
    rc = tt.main(["--data", str(data), "--target", tiny_ckpt, "--configs", "fp32:8x2", "fp32:16x2", "--steps", "12",
                  "--log-every", "3", "--work", str(tmp_path / "runs"), "--out", str(out),
                  "--train-args", "--single-stage", "--target-layer-ids", "1,4", "--num-layers", "1"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["torch_threads"] == 1 and [r["name"] for r in res["rows"]] == ["fp32:8x2", "fp32:16x2"]
    assert all(r["steps"] == 12 and r["anchors_per_s"] > 0 for r in res["rows"])
    assert res["rows"][0]["ratio_to_first"] == 1.0 and res["rows"][1]["ratio_to_first"] > 0
    assert not os.path.exists(tmp_path / "runs" / "fp32_8x2")  # scratch runs removed unless --keep
    assert "| fp32:16x2 | fp32 | 16 x 2 | 12 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is not a folder"):
        tt.main(["--data", str(tmp_path / "nope")])
