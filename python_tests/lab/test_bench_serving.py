"""``bench/sglang_bench_serving.py``'s library (``dlite_lab/benchmarking/bench_serving.py``), no server:
the workload conversations turned into sglang's multi-turn (``agentic-trace``) and random-corpus
(ShareGPT) files, read back by sglang's own loaders (the bundled tokenizer where it is prepared), the
client's arguments, and the summary / ratio code on hand-made sglang result lines."""

from __future__ import annotations

import json
import sys
import types

import pytest

from dlite_lab.benchmarking import bench_serving as bs

CONV = {"id": "c0", "source": "t", "messages": [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                          "function": {"name": "ls", "arguments": "{}"}}]},
    {"role": "tool", "content": "a.py\nb.py"},
    {"role": "assistant", "content": "Two files: a.py and b.py."},
    {"role": "user", "content": "Open a.py."},
    {"role": "assistant", "content": None},  # a generated placeholder
    {"role": "user", "content": "Thanks."},
]}


def _load(name, max_convs=None):
    convs = [dict(CONV, id=f"c{i}") for i in range(4)]
    return convs[:max_convs] if max_convs else convs


@pytest.fixture
def sglang_datasets(monkeypatch):
    """sglang's dataset loaders and multi-turn check; its MMMU loader imports HF ``datasets`` at module
    level, stood in for (as the benchmark's client does) where it is not installed."""
    pytest.importorskip("sglang")
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.load_dataset = lambda *a, **k: (_ for _ in ()).throw(ImportError("stand-in"))
        monkeypatch.setitem(sys.modules, "datasets", stub)
    from sglang.benchmark.datasets import agentic_trace, random as random_ds
    from sglang.benchmark.serving import _normalize_round_messages

    return agentic_trace, random_ds, _normalize_round_messages


def test_rounds_are_the_runs_of_non_assistant_messages():
    rounds = bs.conversation_rounds(CONV)
    assert [[m["role"] for m in r] for r in rounds] == [["system", "user"], ["tool"], ["user"], ["user"]]
    assert rounds[1] == [{"role": "tool", "content": "a.py\nb.py"}]
    assert len(bs.conversation_rounds(CONV, max_turns=2)) == 2
    ends_on_reply = dict(CONV, messages=CONV["messages"][:5])
    assert len(bs.conversation_rounds(ends_on_reply)) == 2  # nothing left to send after the last reply


def test_sharegpt_source_skips_the_system_prompt():
    (entry,) = bs.sharegpt_source([CONV])
    human, gpt = entry["conversations"]
    assert human["value"].startswith("List the files.") and "coding agent" not in human["value"]
    assert gpt["value"] == "Two files: a.py and b.py."


def test_sglang_reads_the_multiturn_file_as_multiturn(tmp_path, sglang_datasets):
    agentic_trace, _, normalize = sglang_datasets
    paths = bs.write_datasets(["toy"], str(tmp_path), max_convs=3, max_turns=3, num_prompts=2,
                              datasets=["multiturn"], load=_load)
    ds = agentic_trace.AgenticTraceDataset(dataset_path=paths["multiturn"], num_requests=3, fixed_output_len=16,
                                           offset=0, max_turns=None)
    rows = ds.load(tokenizer=None)
    assert len(rows) == 3 and all(len(r.prompt) == 3 and r.output_len == 16 for r in rows)
    # bench_serving's own test for a multi-turn row (benchmark()): prompt[0] is a list of role/content messages
    assert all(normalize(turn) is not None for r in rows for turn in r.prompt)
    assert normalize(rows[0].prompt[0])[0] == {"role": "system", "content": "You are a coding agent."}


def test_sglang_random_dataset_reads_the_corpus_without_a_download(tmp_path, sglang_datasets, monkeypatch):
    from sglang_dlite.model.bundled_target import default_target_dir, is_prepared

    _, random_ds, _ = sglang_datasets
    if not is_prepared(default_target_dir()):
        pytest.skip("the bundled target (its tokenizer) is not prepared: sglang-dlite prepare-target")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_target_dir()))
    paths = bs.write_datasets(["toy"], str(tmp_path), max_convs=3, max_turns=3, num_prompts=3,
                              datasets=["random"], load=_load)

    def no_download(*a, **k):
        raise AssertionError("sglang tried to download ShareGPT")

    monkeypatch.setattr(random_ds, "download_and_cache_hf_file", no_download)
    rows = random_ds.sample_random_requests(input_len=40, output_len=8, num_prompts=3, range_ratio=1.0, tokenizer=tok,
                                            dataset_path=paths["random"], random_sample=True, return_text=True)
    assert len(rows) == 3 and all(isinstance(r.prompt, str) and r.output_len == 8 for r in rows)
    assert "files" in rows[0].prompt  # the workload's text, repeated up to the length


def test_random_corpus_must_cover_the_prompts(tmp_path):
    with pytest.raises(ValueError, match="fewer than --num-prompts"):
        bs.write_datasets(["toy"], str(tmp_path), max_convs=2, max_turns=2, num_prompts=16,
                          datasets=["random"], load=_load)


def test_client_args_per_dataset():
    mt = bs.client_args("multiturn", "http://127.0.0.1:1", "/tok", "/o.jsonl", num_prompts=16, input_len=256,
                        output_len=64, max_concurrency=8, dataset_path="/mt.json", num_convs=5)
    assert mt[mt.index("--backend") + 1] == "sglang-oai-chat" and mt[mt.index("--dataset-name") + 1] == "agentic-trace"
    assert mt[mt.index("--num-prompts") + 1] == "5" and "--disable-ignore-eos" in mt
    rnd = bs.client_args("random", "http://127.0.0.1:1", "/tok", "/o.jsonl", num_prompts=16, input_len=256,
                         output_len=64, max_concurrency=8, dataset_path="/src.json")
    assert rnd[rnd.index("--dataset-path") + 1] == "/src.json" and rnd[rnd.index("--random-range-ratio") + 1] == "1.0"
    ids = bs.client_args("random-ids", "http://127.0.0.1:1", "/tok", "/o.jsonl", num_prompts=16, input_len=256,
                         output_len=64, max_concurrency=8)
    assert "--dataset-path" not in ids and "--disable-ignore-eos" not in ids
    with pytest.raises(ValueError):
        bs.client_args("sharegpt", "u", "t", "o", num_prompts=1, input_len=1, output_len=4, max_concurrency=1)


def test_the_client_stands_in_for_hf_datasets_only_where_missing():
    pytest.importorskip("sglang")
    bootstrap = bs.client_prefix("py", have_datasets=False)
    assert bootstrap[:2] == ["py", "-c"] and "sglang.bench_serving" in bootstrap[2]
    compile(bootstrap[2], "<bootstrap>", "exec")
    assert bs.client_prefix("py", have_datasets=True) == ["py", "-m", "sglang.bench_serving"]


def _result(**kw):
    r = {"backend": "sglang", "dataset_name": "random", "completed": 16, "duration": 10.0, "total_input_tokens": 4096,
         "total_output_tokens": 1024, "output_throughput": 102.4, "request_throughput": 1.6, "median_ttft_ms": 500.0,
         "p99_ttft_ms": 900.0, "median_tpot_ms": 80.0, "median_itl_ms": 80.0, "p99_itl_ms": 120.0,
         "median_e2e_latency_ms": 5500.0, "accept_length": None, "errors": [""] * 16}
    r.update(kw)
    return r


def test_summary_rows_and_ratios_from_sglang_result_lines(tmp_path):
    nospec, dlite = tmp_path / "nospec_random.jsonl", tmp_path / "dlite_random.jsonl"
    nospec.write_text(json.dumps(_result()) + "\n")
    # sglang appends a line per run: the last one counts
    dlite.write_text(json.dumps(_result(output_throughput=1.0)) + "\n" + json.dumps(_result(
        output_throughput=204.8, request_throughput=3.2, median_ttft_ms=550.0, median_tpot_ms=40.0, median_itl_ms=100.0,
        accept_length=3.1, errors=[""] * 15 + ["boom"])) + "\n")
    results = {("nospec", "random"): bs.read_result(str(nospec)), ("dlite", "random"): bs.read_result(str(dlite))}
    rows = bs.summary_rows(results, ["dlite", "nospec"], ["random", "multiturn"])
    assert [(r["dataset"], r["mode"]) for r in rows] == [("random", "dlite"), ("random", "nospec")]
    d, n = rows
    assert d["x_output_throughput"] == 2.0 and d["x_request_throughput"] == 2.0
    assert d["x_median_tpot_ms"] == 0.5 and d["x_median_ttft_ms"] == 1.1 and d["x_median_itl_ms"] == 1.25
    assert d["accept_length"] == 3.1 and d["failed"] == 1 and n["failed"] == 0
    assert "x_output_throughput" not in n
    table = bs.format_table(rows).splitlines()
    assert len(table) == 4 and "204.80" in table[2] and "2.00" in table[2]
    assert bs.read_result(str(tmp_path / "missing.jsonl")) is None
    (tmp_path / "empty.jsonl").write_text(json.dumps(_result(completed=0)) + "\n")
    assert bs.read_result(str(tmp_path / "empty.jsonl")) is None  # a run with no request done is no result
