"""Issue 64 item 1: agent-ready defaults of ``sglang-dlite serve``. On the default server (bundled
SmolLM2-135M-Instruct, the shipped drafter, DLITE) ``tool_choice`` "required", a named function and
"auto" answer over HTTP, through the ``openai`` client, with OpenAI ``tool_calls`` whose arguments
are valid against the tool's schema, exactly as the same server without speculation (``--no-spec``)
answers, streamed or not; ``/metrics`` is on by default.

Two servers (``sglang-dlite serve --cpu`` and ``--no-spec``), started together once for the module;
the pure checks at the top need none."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest

import sglang_fixtures as F
from dlite_lab.benchmarking.agent_client import parity, run_level
from dlite_lab.workloads import load_workload

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
requests = pytest.importorskip("requests")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TOOLS = [WEATHER, CALC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "calculate"}}, "auto": "auto"}
PROMPTS = ["What's the weather in Paris?", "What is 23 * 17?"]
# an agent's second turn: the history holds a call the model made, and under "auto" the 135M target
# calls the tool again by itself (alone it answers the prompts above in text)
AGENT_TURN = [{"role": "user", "content": "What's the weather in London?"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                  "name": "get_weather", "arguments": json.dumps({"city": "London"})}}]},
              {"role": "user", "content": "What's the weather in Paris?"}]
SERVE_TAIL = ["--", "--enable-cache-report", "--max-total-tokens", "8192", "--max-running-requests", "8", "--skip-server-warmup",
              "--log-level", "warning"]


def _serve_args(*argv):
    from sglang_dlite.serving import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return serve, p.parse_args(list(argv))


# ----------------------------------------------------------------------------- no server
def test_serve_passes_tool_parser_template_and_metrics_by_default(tmp_path):
    serve, args = _serve_args("--cpu", "--dry-run")
    cmd, _ = serve.build_command(args)
    assert cmd[cmd.index("--tool-call-parser") + 1] == "smollm2"
    template = cmd[cmd.index("--chat-template") + 1]
    assert template == str(serve.BUNDLED_TOOLS_TEMPLATE) and serve.BUNDLED_TOOLS_TEMPLATE.is_file()
    assert cmd.count("--enable-metrics") == 1
    # --no-metrics; the user's own flags after -- win and are not doubled
    cmd, _ = serve.build_command(_serve_args("--no-spec", "--no-metrics", "--", "--tool-call-parser", "hermes",
                                             "--chat-template=x.jinja")[1])
    assert "--enable-metrics" not in cmd
    assert cmd.count("--tool-call-parser") == 1 and cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    assert not any(a.startswith("--chat-template") and a != "--chat-template=x.jinja" for a in cmd)
    cmd, _ = serve.build_command(_serve_args("--no-spec", "--", "--enable-metrics")[1])
    assert cmd.count("--enable-metrics") == 1
    # a target of the user's own: metrics, but no guessed parser or template
    F.save_tiny_llama(tmp_path / "t")
    cmd, _ = serve.build_command(_serve_args("--no-spec", "--model-path", str(tmp_path / "t"))[1])
    assert "--enable-metrics" in cmd and "--tool-call-parser" not in cmd and "--chat-template" not in cmd


def test_tools_template_renders_the_tools_and_nothing_else_changes():
    from transformers import AutoTokenizer

    from sglang_dlite.model.bundled_target import resolve_target
    from sglang_dlite.serving import serve

    tok = AutoTokenizer.from_pretrained(resolve_target("default"))
    tpl = serve.BUNDLED_TOOLS_TEMPLATE.read_text()
    for msgs in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        assert (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=tpl)
                == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18 C"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True, chat_template=tpl)
    assert '"name": "get_weather"' in text and '"name": "calculate"' in text and "<tools>" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text


def test_smollm2_parser_grammar_follows_tool_choice():
    """The ``smollm2`` parser's grammar (what sglang constrains generation with): "required" and a
    named tool admit only calls (the named tool alone), "auto" text before a call; the arguments
    follow the tool's schema. Registered where sglang looks parsers up."""
    xgr = pytest.importorskip("xgrammar")
    from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from transformers import AutoTokenizer

    from sglang_dlite.model.bundled_target import resolve_target
    from sglang_dlite.serving.tool_calls import PARSER_NAME, SmolLM2Detector, call_structural_tag, register_parser

    register_parser()
    assert FunctionCallParser.ToolCallParserEnum[PARSER_NAME] is SmolLM2Detector
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(
        resolve_target("default"))))
    tools = [Tool(**t) for t in TOOLS]
    weather = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    calc = '<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call>'
    cases = [  # (tool_choice, {output: admitted})
        ("required", {weather: True, calc: True, weather + "\n" + calc: True, "Sure. " + weather: False,
                     weather + " done": False, weather.replace('{"city": "Paris"}', "{}"): False}),
        (ToolChoice(function={"name": "calculate"}), {calc: True, weather: False, calc + "\n" + calc: False}),
        ("auto", {"Sure. " + weather + " done": True, "No call needed.": True,
                  weather.replace('"Paris"', "7"): False}),
    ]
    for choice, outputs in cases:
        tag = call_structural_tag(tools, choice)
        grammar = compiler.compile_structural_tag(json.dumps(tag.model_dump(by_alias=True)))
        for text, admitted in outputs.items():
            assert xgr.GrammarMatcher(grammar).accept_string(text) is admitted, (choice, text)
    assert call_structural_tag(tools, ToolChoice(function={"name": "nope"})) is None


def test_tools_without_a_parser_are_refused_clearly():
    from sglang_dlite.serving.guards import RequestRefused
    from sglang_dlite.serving.guards.checks import check_tools_parser

    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    with pytest.raises(RequestRefused, match="--tool-call-parser NAME") as e:
        check_tools_parser("/v1/chat/completions", body, None)
    assert e.value.param == "tools"
    check_tools_parser("/v1/chat/completions", body, "qwen25")  # a parser: fine
    check_tools_parser("/v1/chat/completions", dict(body, tool_choice="none"), None)  # tools as context only
    check_tools_parser("/v1/chat/completions", dict(body, tool_choice="required"), None)  # sglang's JSON array
    check_tools_parser("/v1/chat/completions", {"messages": body["messages"]}, None)


# ----------------------------------------------------------------------------- two servers
def _launch(tmp, name, *argv):
    serve, args = _serve_args(*argv)
    cmd, env = serve.build_command(args)
    assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd
    return F.HttpServer.launch(cmd[3:], tmp / f"{name}.log", env=env)


def srv_flush(srv):
    assert requests.post(srv.base + "/flush_cache", timeout=60).status_code == 200


def _ask(client, choice, prompt, stream=False):
    kw = dict(model="default", temperature=0, max_tokens=64, tools=TOOLS, tool_choice=CHOICES[choice],
              messages=prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return {"content": c.message.content or "", "finish_reason": c.finish_reason, "tool_calls": calls}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            name, args = calls.get(t.index, ("", ""))
            calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "finish_reason": finish, "tool_calls": [calls[i] for i in sorted(calls)]}


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """{server: {(choice, prompt index, streamed): answer}}, plus each server's /metrics text."""
    from sglang_dlite.model.dlite import shipped_drafter_path

    if shipped_drafter_path() is None:
        pytest.skip("no shipped drafter in this install")
    tmp = tmp_path_factory.mktemp("openai_tools")
    servers = {"dlite": _launch(tmp, "dlite", "--cpu", *SERVE_TAIL),
               "nospec": _launch(tmp, "nospec", "--cpu", "--no-spec", *SERVE_TAIL)}
    try:
        out = {}
        for name, srv in servers.items():
            srv.wait_ready(time.time() + 900)
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=600)
            got = {(c, i, False): _ask(client, c, p) for c in CHOICES for i, p in enumerate(PROMPTS)}
            got.update({(c, 0, True): _ask(client, c, PROMPTS[0], stream=True) for c in CHOICES})
            got.update({("auto", "agent", st): _ask(client, "auto", AGENT_TURN, stream=st) for st in (False, True)})
            got["metrics"] = requests.get(srv.base + "/metrics", timeout=60).text
            srv_flush(srv)
            got["agent"] = asyncio.run(run_level(srv.base, load_workload("agent-stdlib", max_convs=2), 2, max_turns=3,
                                                 max_new_tokens=32, tools=True))[0]
            got["spec"] = _spec_metrics_exchange(srv, client)
            out[name] = got
        yield out
    finally:
        for srv in servers.values():
            srv.stop()


SPEC_PROMPT = [{"role": "user", "content": "List five prime numbers and say why each is prime."}]
SPEC_COUNTERS = ("sglang:spec_decode_num_drafts_total", "sglang:spec_decode_num_draft_tokens_total",
                 "sglang:spec_decode_num_accepted_tokens_total")


def _counters(srv) -> dict:
    """/metrics' acceptance counters, summed over their labels but ``position``."""
    import re

    text = requests.get(srv.base + "/metrics", timeout=60).text
    out = {}
    for name, labels, value in re.findall(r"^(sglang:spec_decode_num_\w+_total)(\{[^}]*\})? (\S+)$", text, re.M):
        pos = re.search(r'position="(\d+)"', labels or "")
        key = (name, int(pos.group(1))) if pos else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _spec_metrics_exchange(srv, client) -> dict:
    """Issue 64 item 4 over HTTP: the same greedy request asked with per-response metrics
    (non-streamed, streamed with usage, ``/generate`` with the detailed ones), /metrics read around
    them; then without the opt-in, and with a bad value."""
    kw = dict(model="default", temperature=0, max_tokens=48, messages=SPEC_PROMPT)
    opt_in = {"custom_params": {"dlite_spec_metrics": True}}
    got = {"before": _counters(srv)}
    r = client.chat.completions.create(extra_body=opt_in, **kw)
    got["plain_with"] = (r.choices[0].message.content, r.usage.completion_tokens, (r.model_extra or {}).get("metrics"))
    content, last = "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                extra_body=opt_in, **kw):
        content += "".join(c.delta.content or "" for c in chunk.choices)
        last = chunk
    got["stream"] = (content, last.usage.completion_tokens, (last.model_extra or {}).get("metrics"))
    g = requests.post(srv.base + "/generate", timeout=300, json={
        "text": "The three primary colours are", "sampling_params": {
            "temperature": 0, "max_new_tokens": 40, "custom_params": {"dlite_spec_metrics": "detailed"}}}).json()
    got["generate"] = g["meta_info"]
    got["after"] = _counters(srv)
    r = client.chat.completions.create(**kw)
    got["plain_without"] = (r.choices[0].message.content, (r.model_extra or {}).get("metrics"))
    got["bad"] = requests.post(srv.base + "/v1/chat/completions", timeout=300, json=dict(
        kw, custom_params={"dlite_spec_metrics": "verbose"}))
    return got


def _check_calls(answer, allowed):
    assert answer["tool_calls"], answer
    assert answer["finish_reason"] == "tool_calls", answer
    assert "<tool_call>" not in (answer["content"] or ""), answer
    for name, arguments in answer["tool_calls"]:
        assert name in allowed, answer
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_are_valid_and_identical_without_speculation(answers, choice):
    allowed = {"calculate"} if choice == "named" else set(SCHEMAS)
    for key in [(choice, i, False) for i in range(len(PROMPTS))] + [(choice, 0, True)]:
        _check_calls(answers["dlite"][key], allowed)
        assert answers["dlite"][key] == answers["nospec"][key], key
    if choice == "named":  # one call, the named one
        assert all(len(answers["dlite"][(choice, i, False)]["tool_calls"]) == 1 for i in range(len(PROMPTS)))
    assert answers["dlite"][(choice, 0, True)] == answers["dlite"][(choice, 0, False)]  # streamed = not


def test_auto_answers_identically_and_any_call_is_valid(answers):
    """The 135M target answers these in text under "auto" (it calls no tool by itself on them):
    identical with and without speculation, and a call, if any, is parsed and valid."""
    for key in [("auto", i, False) for i in range(len(PROMPTS))] + [("auto", 0, True)]:
        a = answers["dlite"][key]
        assert a == answers["nospec"][key], key
        if a["tool_calls"]:
            _check_calls(a, set(SCHEMAS))
        else:
            assert a["content"] and "<tool_call>" not in a["content"], a
            assert a["finish_reason"] in ("stop", "length"), a


def test_auto_calls_a_tool_by_itself_identically_without_speculation(answers):
    """"auto" where the model does call: an agent's second turn (AGENT_TURN). OpenAI tool_calls,
    valid against the schema, the same with and without speculation, streamed or not."""
    a = answers["dlite"][("auto", "agent", False)]
    _check_calls(a, set(SCHEMAS))
    assert a["tool_calls"][0][0] == "get_weather" and json.loads(a["tool_calls"][0][1])["city"] == "Paris", a
    for key in [("auto", "agent", False), ("auto", "agent", True)]:
        assert answers["dlite"][key] == answers["nospec"][key], key
    assert answers["dlite"][("auto", "agent", True)] == a


def test_metrics_are_on_by_default(answers):
    for name in ("dlite", "nospec"):
        text = answers[name]["metrics"]
        assert "sglang:" in text and "sglang:generation_tokens_total" in text, (name, text[:300])


def test_multi_turn_sessions_hit_the_prefix_cache_exactly_as_without_speculation(answers):
    """Issue 64's prefix-cache parity, through the openai client: 2 agent-stdlib sessions at once,
    3 streamed turns each, every turn sending the whole history (the session's own replies, the
    workload's tools): the same replies as without speculation, and on every turn >= 2 the same
    ``usage.prompt_tokens_details.cached_tokens`` -- or one more where the previous turn stopped at
    max_tokens on a token a verify round had computed (``agent_client.parity``)."""
    spec, base = answers["dlite"]["agent"], answers["nospec"]["agent"]
    assert len(spec) == len(base) == 6
    assert all(t.cached_tokens is not None for t in spec + base)
    assert all(t.cached_tokens > 0 for t in spec + base if t.turn >= 2)  # the earlier turns are reused
    p = parity(spec, base)
    assert p["output_mismatches"] == 0, p
    assert p["cache_compared"] == 4 and p["cached_tokens_mismatches"] == 0, p
    assert all(t.spec_verify_ct for t in spec) and not any(t.spec_verify_ct for t in base)


def _check_one(m: dict, completion_tokens: int):
    """One response's ``metrics.speculative_decoding``: its fields agree with each other and with
    the tokens it returned."""
    steps = m["num_spec_steps"]
    assert steps > 0 and sum(m["acceptance_histogram"]) == steps, m
    assert m["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(m["acceptance_histogram"])), m
    assert m["accepted_per_position"] == [sum(m["acceptance_histogram"][j + 1:])
                                          for j in range(len(m["accepted_per_position"]))], m
    assert len(m["acceptance_histogram"]) == m["num_spec_tokens"] + 1
    assert m["num_draft_tokens"] >= m["num_accepted_draft_tokens"] > 0, m  # the shipped drafter accepts some
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_draft_tokens"] / steps)
    assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_draft_tokens"] / m["num_draft_tokens"])
    assert m["tau"] == pytest.approx((completion_tokens - 1) / steps)  # drafting/tau.py's one definition
    src = m["sources"].values()
    assert sum(s["num_spec_steps"] for s in src) == steps
    assert sum(s["num_committed_tokens"] for s in src) == completion_tokens - 1  # every returned token, once
    assert sum(s["num_accepted_draft_tokens"] for s in src) == m["num_accepted_draft_tokens"]


def test_per_response_spec_metrics_reconcile_with_the_metrics_endpoint(answers):
    """Issue 64 item 4: a request that opts in (``custom_params.dlite_spec_metrics``) gets vLLM's
    ``metrics.speculative_decoding`` (non-streamed; the usage chunk of a stream; ``meta_info`` of
    ``/generate``, there with the per-step lists and sglang's own ``spec_verify_ct``), and the three
    responses' totals are exactly what /metrics' acceptance counters grew by meanwhile."""
    spec = answers["dlite"]["spec"]
    text, n, metrics = spec["plain_with"]
    assert metrics and set(metrics) == {"speculative_decoding"}
    one = metrics["speculative_decoding"]
    _check_one(one, n)
    s_text, s_n, s_metrics = spec["stream"]
    assert s_text == text and s_n == n  # streamed = not, the metrics on the last chunk
    _check_one(s_metrics["speculative_decoding"], s_n)
    meta = spec["generate"]
    gen = meta["dlite_spec_metrics"]
    _check_one(gen, meta["completion_tokens"])
    assert gen["num_spec_steps"] == meta["spec_verify_ct"]  # the steps sglang counts
    assert gen["per_step_accepted"] and len(gen["per_step_accepted"]) == gen["num_spec_steps"]
    assert sum(gen["per_step_draft_tokens"]) == gen["num_draft_tokens"]
    parts = [one, s_metrics["speculative_decoding"], gen]
    grew = {k: spec["after"].get(k, 0.0) - spec["before"].get(k, 0.0) for k in spec["after"]}
    drafts, draft_tokens, accepted = (grew[k] for k in SPEC_COUNTERS)
    assert drafts == sum(p["num_drafting_steps"] for p in parts)
    assert draft_tokens == sum(p["num_draft_tokens"] for p in parts)
    assert accepted == sum(p["num_accepted_draft_tokens"] for p in parts)
    for pos in range(max(len(p["accepted_per_position"]) for p in parts)):
        want = sum(p["accepted_per_position"][pos] for p in parts if pos < len(p["accepted_per_position"]))
        assert grew.get(("sglang:spec_decode_num_accepted_tokens_per_pos_total", pos), 0.0) == want, pos


def test_spec_metrics_change_no_output_and_only_reach_who_asks(answers):
    spec = answers["dlite"]["spec"]
    assert spec["plain_without"] == (spec["plain_with"][0], None)  # same text, no metrics field
    assert answers["nospec"]["spec"]["plain_with"][0] == spec["plain_with"][0]  # greedy = the target's
    assert answers["nospec"]["spec"]["plain_with"][2] is None  # no speculation: nothing to report
    bad = spec["bad"]
    assert bad.status_code == 400 and "dlite_spec_metrics" in bad.text and "summary" in bad.text, bad.text[:300]
