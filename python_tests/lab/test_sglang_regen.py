"""``gen-data --engine sglang`` (training/sglang_regen.py) on a tiny random-weight Llama with
SmolLM2's vocabulary and chat template, in a real sglang engine on the CPU stack (one engine for
the module): the shards equal the fast engine's (= HF float32 greedy) token for token, features
included; the run is resumable (finished shards are kept, not regenerated); a turn that sglang
stops at another EOS id of the model is resumed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import test_fast_regen
from test_fast_regen import _args

if hasattr(test_fast_regen, "tiny_ckpt"):  # the fixture lives in conftest.py once it is shared
    tiny_ckpt = test_fast_regen.tiny_ckpt

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def sgl_engine(tiny_ckpt):  # noqa: F811
    from sglang_dlite.serving.cpu_launch import start_engine

    e = start_engine(tiny_ckpt, skip_tokenizer_init=True, max_running_requests=8, max_total_tokens=8192)
    yield e
    e.shutdown()


def _prompts(tmp_path, n=7):
    p = tmp_path / "p.jsonl"
    with open(p, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": f"Question {i}: " + "word " * (3 + 5 * i)},
                    {"role": "assistant", "content": "x"}, {"role": "user", "content": f"And then {i}?"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return p


def test_gen_data_sglang_equals_fast_engine_and_resumes(tiny_ckpt, sgl_engine, tmp_path):  # noqa: F811
    from dlite_lab.training import gen_data
    from dlite_lab.training.data import load_shard, read_manifest
    from dlite_lab.training.features import load_features

    prompts = _prompts(tmp_path)
    sg, fast = tmp_path / "sglang", tmp_path / "fast"
    kw = dict(engine="sglang", sglang_engine=sgl_engine, max_new_tokens=16)
    assert gen_data.run(_args(tiny_ckpt, prompts, sg, max_shards=2, **kw)) == 0
    man = read_manifest(str(sg))
    assert len(man["shards"]) == 2
    first = {s["file"]: os.path.getmtime(sg / s["file"]) for s in man["shards"]}
    assert gen_data.run(_args(tiny_ckpt, prompts, sg, **kw)) == 0  # resume: only the last shard
    man = read_manifest(str(sg))
    assert len(man["shards"]) == 3 and all(os.path.getmtime(sg / f) == t for f, t in first.items())
    assert all(s["engine"] == "sglang-float32" and s["tokens_not_fp32_greedy"] == 0 for s in man["shards"])
    assert man["runs"][-1]["new_shards"] == 1 and "sglang offline engine" in man["recipe"]["engine"]
    assert gen_data.run(_args(tiny_ckpt, prompts, fast, max_new_tokens=16)) == 0
    gen_tokens = 0
    for sh in read_manifest(str(fast))["shards"]:
        a_ids, a_mask, _ = load_shard(str(sg / sh["file"]))
        b_ids, b_mask, _ = load_shard(str(fast / sh["file"]))
        np.testing.assert_array_equal(a_ids, b_ids)
        np.testing.assert_array_equal(a_mask, b_mask)
        gen_tokens += int(a_mask.sum())
        fa = load_features(str(sg / sh["file"]), [1, 4], len(a_ids))
        fb = load_features(str(fast / sh["file"]), [1, 4], len(b_ids))
        np.testing.assert_allclose(np.asarray(fa, np.float32), np.asarray(fb, np.float32), atol=2e-3, rtol=2e-3)
    assert gen_tokens > 50


def test_turn_stopped_at_another_eos_is_resumed(tiny_ckpt, sgl_engine):  # noqa: F811
    """sglang stops at every EOS id of the model; only <|im_end|> may end a turn: a turn stopped
    at another id goes on (the generated text equals the one-request text with that id banned
    from stopping, i.e. the fast engine's)."""
    from transformers import AutoTokenizer

    from dlite_lab.training.sglang_regen import SglangRegenerator
    from dlite_lab.training.turns import TurnRules

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    conv = {"users": ["Tell me something about word word word."]}
    gen = SglangRegenerator(tiny_ckpt, None, TurnRules(tok, max_new_tokens=20), engine=sgl_engine)
    seqs, masks = gen.generate([conv])
    free = seqs[0][len(gen.turns.start(conv)):]
    assert gen.stats["resumed_turns"] == 0 and len(free) == 20 and gen.turns.eos not in free
    other = free[5]  # make a token the model emits an extra stop id: sglang stops there

    orig = sgl_engine.async_generate

    async def with_extra_stop(input_ids, sampling_params):
        sp = dict(sampling_params, stop_token_ids=list(sampling_params["stop_token_ids"]) + [other])
        return await orig(input_ids=input_ids, sampling_params=sp)

    gen.engine = type("E", (), {"async_generate": staticmethod(with_extra_stop)})()
    seqs2, masks2 = gen.generate([conv])
    assert seqs2 == seqs and masks2 == masks
    assert gen.stats["resumed_turns"] >= 1
