"""Workloads: converters, the ShareGPT split, render_turns on the real tokenizer, file validation."""

from __future__ import annotations

import json
import os

import pytest

from sglang_dlite.errors import DLiteInputError
from dlite_lab.workloads import BUILTIN_WORKLOADS, load_workload
from dlite_lab.workloads.format import is_placeholder, validate_record
from dlite_lab.workloads.render import TOOL_RESULT_PREFIX, render_turns


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    from sglang_dlite.model.bundled_target import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("default"))


def _check_prefix(turns):
    for a, b in zip(turns, turns[1:]):
        if a.reference_ids is not None:
            head = a.prompt_ids + a.reference_ids
            assert b.prompt_ids[: len(head)] == head, (a.conv_id, a.index, b.index)
        else:
            assert b.prompt_ids[: len(a.prompt_ids)] == a.prompt_ids


@pytest.mark.parametrize("name", BUILTIN_WORKLOADS)
def test_builtin_workloads_are_valid(name):
    recs = load_workload(name, max_convs=3)
    assert len(recs) == 3
    ids = set()
    for r in recs:
        v = validate_record(r)
        assert v["source"] == name or (name == "sharegpt-heldout" and v["source"] == "sharegpt")
        assert r["id"] not in ids
        ids.add(r["id"])
        roles = [m["role"] for m in r["messages"]]
        assert "user" in roles
    if name in ("bfcl-multiturn", "agent-stdlib"):
        assert all(r["tools"] and r["tools"][0]["type"] == "function" for r in recs)
    if name in ("mtbench", "bfcl-multiturn"):
        assert any(is_placeholder(m) for r in recs for m in r["messages"])  # no recorded replies


def test_builtin_converters_are_deterministic():
    from dlite_lab.workloads import agent_stdlib, converters

    assert converters.convert_mtbench()[:5] == converters.convert_mtbench()[:5]
    assert len(converters.convert_humaneval()) == 164
    files = agent_stdlib._candidate_files(agent_stdlib.stdlib_root())
    a = agent_stdlib.build_conversation(7, files, agent_stdlib.stdlib_root())
    b = agent_stdlib.build_conversation(7, files, agent_stdlib.stdlib_root())
    assert a == b


def test_agent_stdlib_tool_results_are_real_source():
    from dlite_lab.workloads import agent_stdlib

    root = agent_stdlib.stdlib_root()
    conv = load_workload("agent-stdlib", max_convs=4)[3]
    assert conv["messages"][-1]["role"] == "tool"  # ends on a tool result: final turn generated
    calls = [json.loads(m["content"].splitlines()[-1]) for m in conv["messages"] if m["role"] == "assistant"]
    assert {c["name"] for c in calls} <= {"list_dir", "read_file", "grep"}
    read = [c for c in calls if c["name"] == "read_file"][-1]["arguments"]
    with open(os.path.join(root, read["path"]), encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    shown = conv["messages"][-1]["content"].splitlines()
    assert len(shown) == read["end_line"] - read["start_line"] + 1
    for text, i in zip(shown[:50], range(read["start_line"], read["end_line"] + 1)):
        assert text.split("| ", 1)[1] == lines[i - 1]


def test_sharegpt_split_disjoint_and_deterministic():
    from dlite_lab.workloads.sharegpt import base_id, is_heldout, load_sharegpt

    train, held = load_sharegpt("train"), load_sharegpt("heldout")
    assert len(train) > 15000 and 150 < len(held) < 800
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert not {base_id(r["id"]) for r in train} & {base_id(r["id"]) for r in held}  # parts of one chat stay together
    assert all(is_heldout(r["id"]) for r in held) and not any(is_heldout(r["id"]) for r in train[:2000])
    assert is_heldout("abc_0") == is_heldout("abc_7") and is_heldout("x") == is_heldout("x")
    assert load_workload("sharegpt-heldout", max_convs=5) == held[:5]
    for r in held[:50]:
        roles = [m["role"] for m in r["messages"]]
        assert roles[-1] == "assistant" and all(m["content"].strip() for m in r["messages"])
        assert all(x != y for x, y in zip(roles, roles[1:]))  # alternating
    with pytest.raises(DLiteInputError):
        load_sharegpt("test")


def test_render_turns_prefix_property(real_tokenizer):
    tok = real_tokenizer
    convs = load_workload("sharegpt-heldout", max_convs=12) + load_workload("agent-stdlib", max_convs=2)
    n = 0
    for c in convs:
        turns = render_turns(tok, c, max_context_tokens=8192)
        assert len(turns) + turns.skipped == sum(m["role"] == "assistant" for m in c["messages"]) + (
            c["messages"][-1]["role"] != "assistant")
        for t in turns:
            n += 1
            if t.reference_ids is not None:  # the recorded reply ends the assistant turn with EOS
                assert tok.convert_tokens_to_ids("<|im_end|>") in t.reference_ids
            assert tok.decode(t.prompt_ids[-3:]).endswith("assistant\n")
        _check_prefix(turns)
    assert n > 20


def test_render_tools_and_tool_role_fallback(real_tokenizer):
    tok = real_tokenizer
    conv = load_workload("agent-stdlib", max_convs=1)[0]
    turns = render_turns(tok, conv)
    text = tok.decode(turns[-1].prompt_ids)
    assert '"name": "read_file"' in text  # tools rendered into the system prompt (SmolLM2 has no tool support)
    assert text.count(TOOL_RESULT_PREFIX) == sum(m["role"] == "tool" for m in conv["messages"])
    assert "<|im_start|>tool" not in text
    assert turns[-1].reference_ids is None and turns[0].reference_ids is not None


def test_render_placeholders_continue_with_generated_reply(real_tokenizer):
    tok = real_tokenizer
    conv = load_workload("mtbench", max_convs=1)[0]
    assert render_turns(tok, conv).__len__() == 1  # without generate: stops at the placeholder
    reply = tok("Sure, here it is.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seen = []
    turns = render_turns(tok, conv, generate=lambda t: seen.append(t.index) or reply,
                         decode_skip_ids=[tok.eos_token_id])
    assert len(turns) == 2 and seen == [1, 3] and turns[0].placeholder
    assert "Sure, here it is.<|im_end|>" in tok.decode(turns[1].prompt_ids)
    _check_prefix(turns)


def test_render_skips_turns_over_the_context_limit(real_tokenizer):
    conv = load_workload("agent-stdlib", max_convs=4)[3]
    full = render_turns(real_tokenizer, conv)
    limit = len(full[-1].prompt_ids) - 1
    cut = render_turns(real_tokenizer, conv, max_context_tokens=limit)
    assert cut.skipped == 1 and len(cut) == len(full) - 1
    assert render_turns(real_tokenizer, conv, model_limit=limit + 32, max_new_tokens=32).skipped == 1


@pytest.mark.parametrize("line,needle", [
    ("{not json", "not valid JSON"),
    ('{"id": "a", "messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "user", "content": "x"}]}', 'missing "id"'),
    ('{"id": "b", "messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"id": "b", "messages": [{"role": "user"}]}', "has no \"content\""),
    ('{"id": "b", "tools": [{"description": "no name"}], "messages": [{"role": "user", "content": "x"}]}', "function name"),
    ('{"id": "ok", "messages": [{"role": "user", "content": "again"}]}', "duplicate id"),
])
def test_bad_jsonl_errors_name_the_line(tmp_path, line, needle):
    p = tmp_path / "w.jsonl"
    p.write_text('{"id": "ok", "source": "s", "messages": [{"role": "user", "content": "hi"}]}\n' + line + "\n")
    with pytest.raises(DLiteInputError) as ei:
        load_workload(str(p))
    assert f"{p}:2:" in str(ei.value) and needle in str(ei.value)


def test_user_jsonl_ok_and_unknown_name(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text(json.dumps({"id": 1, "tools": [{"name": "f", "parameters": {}}],
                             "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}) + "\n\n")
    recs = load_workload(str(p))
    assert recs[0]["id"] == "1" and recs[0]["source"] == "mine" and recs[0]["tools"][0]["function"]["name"] == "f"
    with pytest.raises(DLiteInputError, match="unknown workload"):
        load_workload("no-such-workload")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DLiteInputError, match="empty"):
        load_workload(str(empty))
