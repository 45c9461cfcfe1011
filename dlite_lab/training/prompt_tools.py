"""Tool-use prompt sources of ``gen-data`` (``bfcl``, ``toolchat``; described in ``prompts``): bfcl-eval's
single-turn questions, one per conversation with the function docs as JSON (``bfcl``) or 2-4 per
conversation with their functions as OpenAI tool schemas in the workload renderer's format
(``toolchat``). Never the multi-turn categories the bfcl-multiturn workload is built from."""

from __future__ import annotations

import json
import os
import random

from sglang_dlite.errors import DLiteInputError
from dlite_lab.workloads.converters import function_tool
from dlite_lab.workloads.render import DEFAULT_TOOL_SYSTEM, tools_system_prompt

BFCL_CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
    "parallel_multiple", "live_simple", "live_multiple", "live_parallel",
    "live_parallel_multiple", "irrelevance", "live_irrelevance",
)
TOOL_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, make one or more function calls to achieve the purpose. "
    "If none of the functions can be used, point it out. Answer with the function call(s) only, "
    "in the format [func_name(param=value, ...)].\n\nHere is a list of functions in JSON format "
    "that you can invoke:\n"
)


def _bfcl_convs(n: int, rng: random.Random) -> list:
    items = _bfcl_items(rng)
    convs = []
    for it in items:
        if len(convs) >= n:
            break
        user = _first_user_turn(it)
        if not user:
            continue
        funcs = json.dumps(it.get("function", []))
        if len(funcs) > 6000:
            continue
        convs.append({"id": f"bfcl:{it.get('id')}", "system": TOOL_SYSTEM + funcs, "users": [user]})
    return convs


def _bfcl_items(rng: random.Random) -> list:
    """bfcl-eval's single-turn questions (``BFCL_CATEGORIES``), shuffled."""
    try:
        import bfcl_eval  # optional: bfcl-eval (the data extra)
    except ImportError as exc:
        raise DLiteInputError("the bfcl and toolchat prompt sources need `bfcl-eval` "
                              "(pip install --no-deps bfcl-eval==2026.3.23).") from exc
    data = os.path.join(os.path.dirname(bfcl_eval.__file__), "data")
    items = []
    for cat in BFCL_CATEGORIES:
        path = os.path.join(data, f"BFCL_v4_{cat}.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    rng.shuffle(items)
    return items


def _first_user_turn(item: dict):
    q = item.get("question") or []
    turn = q[0] if q and isinstance(q[0], list) else q
    users = [m["content"] for m in turn if isinstance(m, dict) and m.get("role") == "user" and m.get("content")]
    return users[0] if users else None


def _toolchat_convs(n: int, rng: random.Random) -> list:
    items = [(it, _first_user_turn(it)) for it in _bfcl_items(rng)]
    items = [(it, u) for it, u in items if u and it.get("function")]
    convs, i = [], 0
    while len(convs) < n and i < len(items):
        group = items[i:i + rng.choice((2, 3, 4))]
        i += len(group)
        tools, seen = [], set()
        for it, _ in group:
            for fn in it["function"]:
                name = fn.get("name")
                if not name or name in seen:
                    continue
                seen.add(name)
                tools.append(function_tool(fn))
        system = tools_system_prompt(tools)
        if len(system) - len(DEFAULT_TOOL_SYSTEM) - 2 > 8000:  # the tool block alone over 8 000 characters
            continue
        convs.append({"id": "toolchat:" + "+".join(str(it.get("id")) for it, _ in group),
                      "system": system, "users": [u for _, u in group]})
    return convs
