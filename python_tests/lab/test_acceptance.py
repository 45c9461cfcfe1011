"""bench/acceptance.py end to end on a tiny random Llama saved with the real SmolLM2 tokenizer
(the real 135M target takes minutes on a shared 2-core machine), and the replay metrics."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRED_KEYS = {
    "tau", "tau_by_context", "per_position_accept", "rounds", "generated_tokens", "draft_ms_per_round",
    "verify_ms_per_round", "spec_tokens_per_s", "ar_tokens_per_s", "lossless_checked", "lossless_mismatches",
    "torch_threads",
}

CONVS = [
    {"id": "tools", "source": "test", "tools": [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}],
     "messages": [{"role": "system", "content": "You are an agent."},
                  {"role": "user", "content": "What does json.dumps do?"},
                  {"role": "assistant", "content": '{"name": "read_file", "arguments": {"path": "json/__init__.py"}}'},
                  {"role": "tool", "content": "def dumps(obj, *, skipkeys=False):\n    return _default_encoder.encode(obj)"}]},
    {"id": "chat", "source": "test",
     "messages": [{"role": "user", "content": "Write a haiku about the sea."},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": "Now one about mountains."}]},
]


@pytest.fixture(scope="module")
def tiny_drafter(tiny_ckpt, tmp_path_factory):
    """`dlite:PATH` spec of a random DLite drafter built for the tiny target (the shipped
    default is for SmolLM2 and is rightly refused by a target of another shape)."""
    from transformers import AutoConfig

    from conftest import tiny_dlite_config
    from sglang_dlite.model.dlite import DLiteDrafter

    class _Shape:  # tiny_dlite_config reads target.config
        config = AutoConfig.from_pretrained(tiny_ckpt)

    d = tmp_path_factory.mktemp("tiny_dlite")
    DLiteDrafter(tiny_dlite_config(_Shape)).save_pretrained(str(d))
    return f"dlite:{d}"


@pytest.fixture(scope="module")
def workload_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("wl") / "tiny.jsonl"
    p.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    return str(p)


def _acceptance():
    spec = importlib.util.spec_from_file_location("acceptance", os.path.join(ROOT, "bench", "acceptance.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_acceptance_end_to_end_greedy_lossless(tiny_ckpt, tiny_drafter, workload_file, tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = _acceptance().main(["--engine", "reference", "--drafter", tiny_drafter, "--target", tiny_ckpt,
                             "--workload", workload_file, "--max-new-tokens", "16", "--check-lossless",
                             "--threads", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(r)
    assert r["lossless_checked"] is True and r["lossless_mismatches"] == 0, r["lossless_mismatch_details"]
    assert r["turns"] == 4 and r["lossless_compared_turns"] == 4 and r["skipped_turns"] == 0
    assert r["torch_threads"] == 1
    K = r["num_drafts"]
    assert len(r["per_position_accept"]) == K and 1.0 <= r["tau"] <= K + 1
    assert set(r["tau_by_context"]) >= {"0-1k", "1-2k", "2-4k", "4-8k"} and r["tau_by_context"]["0-1k"] is not None
    assert r["rounds"] == r["rounds_by_context"]["0-1k"] > 0
    # 16 new tokens: every round starts in the first 64 output positions; the later buckets are empty
    assert r["rounds_by_output_position"]["0-63"] == r["rounds"] and r["tau_by_output_position"]["0-63"] == r["tau"]
    assert r["tau_by_output_position"]["64-127"] is None and r["rounds_by_output_position"]["1024+"] == 0
    assert r["spec_tokens_per_s"] > 0 and r["ar_tokens_per_s"] > 0 and r["generated_tokens"] > 0
    assert r["reused_prefix_tokens"] > 0  # the session reused the KV of earlier turns
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[acceptance]") and "tau=" in line and "lossless: 0/4" in line
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_acceptance_sampling_marks_lossless_not_applicable(tiny_ckpt, tiny_drafter, workload_file, tmp_path):
    out = tmp_path / "res.json"
    rc = _acceptance().main(["--drafter", tiny_drafter, "--target", tiny_ckpt, "--workload", workload_file,
                             "--max-convs", "1", "--max-new-tokens", "8", "--temperature", "0.8",
                             "--check-lossless", "--threads", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["lossless_checked"] is False and r["lossless_mismatches"] is None and "not applicable" in r["lossless_note"]
    assert r["conversations"] == 1 and r["temperature"] == 0.8


def test_acceptance_drafter_for_another_target_is_a_clear_error(tiny_ckpt, workload_file, tmp_path, capsys):
    from sglang_dlite.model.dlite import shipped_drafter_path

    if shipped_drafter_path() is None:
        pytest.skip("no shipped drafter in this build")
    rc = _acceptance().main(["--drafter", "dlite", "--target", tiny_ckpt, "--workload", workload_file,
                             "--out", str(tmp_path / "r.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not match the target model" in err and "hidden size" in err


def test_acceptance_bad_workload_is_a_clear_error(tiny_ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": [{"role": "user", "content": 3}]}\n')
    rc = _acceptance().main(["--target", tiny_ckpt, "--workload", str(bad), "--out", str(tmp_path / "r.json")])
    assert rc == 2 and f"{bad}:1:" in capsys.readouterr().err


def test_replay_metrics_with_oracle_drafter(tiny_target):
    """evaluate_tau / replay aggregation: an oracle drafter that knows the greedy continuation is
    fully accepted, so tau is K+1 except for the last partial round; per-position acceptance 1."""
    from dlite_lab.reference.drafters import OracleDrafter
    from dlite_lab.reference.engine import ReferenceEngine
    from dlite_lab.workloads.replay import bucket_of, evaluate_tau, replay

    class Tok:  # a minimal tokenizer: messages -> ids via a fixed rule (no template needed)
        eos_token_id = 2
        chat_template = "tool"

        def get_vocab(self):
            return {}

        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True, **kw):
            return " ".join(m["content"] for m in msgs) + (" |" if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + (hash(w) % 90) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    tok = Tok()
    conv = {"id": "c", "messages": [{"role": "user", "content": "a b c d"}]}
    prompt = tok(tok.apply_chat_template(conv["messages"]))["input_ids"]
    ref = ReferenceEngine(tiny_target, None, eos_token_ids=[2]).generate(prompt, 20, speculative=False)
    seq = tuple(prompt + ref.output_ids)
    engine = ReferenceEngine(tiny_target, OracleDrafter({seq: None}, num_drafts=4), eos_token_ids=[2])
    r = evaluate_tau(engine, [conv], 20, tokenizer=tok)
    assert r["per_position_accept"][0] == 1.0 and r["tau"] > 3.0 and r["rounds"] >= 1
    s = replay(engine, tok, [conv], 20, check_lossless=True).to_dict()
    assert s["lossless_mismatches"] == 0 and s["ar_turns"] == 1
    assert bucket_of(0) == "0-1k" and bucket_of(1024) == "1-2k" and bucket_of(5000) == "4-8k" and bucket_of(9000) == ">=8k"


def test_acceptance_ar_cache_is_reused_across_drafters(tiny_ckpt, tiny_drafter, workload_file, tmp_path):
    """--ar-cache: the second run (another drafter, here ngram) takes every target-alone turn from
    the cache and reports the same baseline; the lossless check still compares against it."""
    cache = tmp_path / "ar.jsonl"
    res = []
    for i, d in enumerate([tiny_drafter, "ngram"]):
        out = tmp_path / f"r{i}.json"
        rc = _acceptance().main(["--engine", "reference", "--drafter", d, "--target", tiny_ckpt,
                                 "--workload", workload_file, "--max-new-tokens", "16", "--check-lossless",
                                 "--threads", "1", "--no-progress", "--out", str(out), "--ar-cache", str(cache)])
        assert rc == 0
        res.append(json.loads(out.read_text()))
    assert res[0]["ar_cached_turns"] == 0 and res[1]["ar_cached_turns"] == res[1]["turns"] == 4
    assert res[1]["ar_tokens_per_s"] == res[0]["ar_tokens_per_s"]
    assert res[1]["lossless_compared_turns"] == 4 and res[1]["lossless_mismatches"] == 0
    assert len(cache.read_text().splitlines()) == 4
