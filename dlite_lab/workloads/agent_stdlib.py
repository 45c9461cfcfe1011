"""``agent-stdlib``: deterministic synthetic SWE-style agent conversations over the Python stdlib.

Each conversation: a system prompt, tool specs (``list_dir``, ``read_file``, ``grep``), a user
task about one function/class of a stdlib module, then recorded assistant tool calls (one line of
reasoning + a JSON call ``{"name": ..., "arguments": {...}}``) each followed by a tool result that
is *real*: the directory listing, real grep matches, real (line-numbered) source of the module
(truncated to fit the size budget). It ends on a tool result, so replay generates the final
assistant turn (the answer). The recorded tool-call turns are short generated turns too.

Sizes: conversation i aims at a total context drawn (seeded) from bucket i % 4 of
[~0.55-0.9k, 1.15-1.85k, 2.3-3.7k, 4.4-6.8k] tokens (SmolLM2 tokenizer, ~3.1 characters per token of
code; the converter does not need the tokenizer, so the sizes are approximate). Paths are relative
to the stdlib root, so the records do not depend on where Python is installed, only on its version
(the cache file name carries the version).
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import sys
import sysconfig

from sglang_dlite.errors import DLiteInputError

N_CONVS = 40
SEED = 1234
CHARS_PER_TOKEN = 3.1
BUCKETS = [(550, 900), (1150, 1850), (2300, 3700), (4400, 6800)]
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages",
              "dist-packages", "ensurepip", "__pycache__", "pydoc_data", "encodings", "msilib"}

SYSTEM_PROMPT = (
    "You are a software engineering agent working in a checkout of the CPython standard library "
    "(the repository root is the Lib/ folder). Use the tools to inspect the code before answering. "
    "To call a tool, reply with one line of reasoning followed by a JSON object "
    '{"name": <tool name>, "arguments": {...}} on its own line. When you have enough information, '
    "reply with the final answer instead of a tool call."
)

def _tool(name: str, description: str, required: list, **params) -> dict:
    """An OpenAI-style function tool; ``params``: name -> (JSON type, description)."""
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


TOOLS = [
    _tool("list_dir", "List the files and folders in a directory of the repository.", ["path"],
          path=("string", "Directory path relative to the repository root ('.' for the root).")),
    _tool("read_file", "Read a file, optionally a range of lines. Lines are returned numbered.", ["path"],
          path=("string", "File path relative to the repository root."),
          start_line=("integer", "First line to read (1-based)."),
          end_line=("integer", "Last line to read (inclusive).")),
    _tool("grep", "Search files under a path for a regular expression; returns path:line: text matches.",
          ["pattern", "path"],
          pattern=("string", "Python regular expression."),
          path=("string", "File or directory to search (recursively).")),
]

TASKS = [
    "Explain what `{sym}` in `{mod}` does, step by step, and point out any edge cases its implementation handles.",
    "A user reports a bug in `{mod}.{sym}`. Find its implementation, read it, and summarize how it works so we can write a regression test.",
    "Write a concise docstring-style summary of `{mod}.{sym}` (parameters, return value, exceptions) based on its source code.",
    "Find where `{sym}` is defined in the standard library module `{mod}` and explain how the rest of that file uses it.",
    "I want to reimplement `{mod}.{sym}` in another language. Read its source and describe the algorithm and its dependencies.",
]


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _py_files(base: str, keep_dir=lambda d: d != "__pycache__"):
    """The .py files under ``base`` (a folder, walked in sorted order; the folders ``keep_dir`` keeps)."""
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if keep_dir(d))
        yield from (os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))


def _candidate_files(root: str) -> list:
    out = []
    for p in _py_files(root, lambda d: d not in _SKIP_DIRS and not d.startswith(("test", "."))):
        fn = os.path.basename(p)
        if fn.startswith(("test", "_")) or fn == "__main__.py":
            continue
        try:
            size = os.path.getsize(p)
        except OSError:
            continue
        if 4_000 <= size <= 400_000:
            out.append(os.path.relpath(p, root).replace(os.sep, "/"))
    return sorted(out)


def _symbols(source: str) -> list:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            end = getattr(node, "end_lineno", node.lineno)
            if end - node.lineno >= 4:
                out.append((node.name, node.lineno, end))
    return out


def _module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _list_dir(root: str, rel_dir: str, max_entries: int) -> str:
    path = os.path.join(root, rel_dir)
    names = sorted(os.listdir(path))
    names = [n for n in names if n != "__pycache__" and not n.startswith(".")]
    shown = [n + ("/" if os.path.isdir(os.path.join(path, n)) else "") for n in names[:max_entries]]
    text = "\n".join(shown)
    if len(names) > max_entries:
        text += f"\n... ({len(names) - max_entries} more entries)"
    return text


def _grep(root: str, pattern: str, rel_path: str, max_matches: int) -> str:
    rx = re.compile(pattern)
    base = os.path.join(root, rel_path)
    files = _py_files(base) if os.path.isdir(base) else [base]
    hits, total = [], 0
    for p in files:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for i, line in enumerate(lines, 1):
            if rx.search(line):
                total += 1
                if len(hits) < max_matches:
                    rel = os.path.relpath(p, root).replace(os.sep, "/")
                    hits.append(f"{rel}:{i}: {line.strip()[:160]}")
    text = "\n".join(hits) if hits else "(no matches)"
    if total > len(hits):
        text += f"\n... ({total - len(hits)} more matches)"
    return text


def _numbered(lines: list, start: int, end: int) -> str:
    width = len(str(end))
    return "\n".join(f"{i:>{width}}| {lines[i - 1]}" for i in range(start, end + 1))


def _window(lines: list, sym_start: int, sym_end: int, budget_chars: int):
    """A line range around [sym_start, sym_end] whose numbered text fits in budget_chars."""
    n = len(lines)
    a, b = sym_start, sym_start
    size = lambda x, y: sum(len(lines[i - 1]) + 8 for i in range(x, y + 1))  # noqa: E731
    # grow down through the symbol first, then alternate up/down
    while b < n and b < sym_end and size(a, b + 1) <= budget_chars:
        b += 1
    grew = True
    while grew:
        grew = False
        if a > 1 and size(a - 1, b) <= budget_chars:
            a -= 1
            grew = True
        if b < n and size(a, b + 1) <= budget_chars:
            b += 1
            grew = True
    return a, b


def _call(thought: str, name: str, **arguments) -> str:
    return thought + "\n" + json.dumps({"name": name, "arguments": arguments})


def build_conversation(i: int, files: list, root: str) -> dict:
    rng = random.Random(SEED * 1000 + i)
    lo, hi = BUCKETS[i % len(BUCKETS)]
    target_tokens = rng.randint(lo, hi)
    while True:
        rel = rng.choice(files)
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            source = f.read()
        syms = _symbols(source)
        if syms:
            break
    sym, s0, s1 = rng.choice(syms)
    mod = _module_name(rel)
    rel_dir = os.path.dirname(rel) or "."
    lines = source.splitlines()
    msgs = [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": rng.choice(TASKS).format(sym=sym, mod=mod)}]
    used = len(SYSTEM_PROMPT) + len(json.dumps(TOOLS)) + len(msgs[1]["content"])
    budget = int(target_tokens * CHARS_PER_TOKEN)

    def add(call: str, result: str):
        nonlocal used
        msgs.append({"role": "assistant", "content": call})
        msgs.append({"role": "tool", "content": result})
        used += len(call) + len(result) + 40

    add(_call(f"First I will look at the layout of `{rel_dir}`.", "list_dir", path=rel_dir),
        _list_dir(root, rel_dir, max_entries=25 if target_tokens < 1000 else 60))
    pattern = rf"\b{re.escape(sym)}\b"
    add(_call(f"Now I will search for `{sym}` to find its definition and uses.", "grep", pattern=pattern, path=rel_dir if rel_dir != "." else rel),
        _grep(root, pattern, rel_dir if rel_dir != "." else rel, max_matches=8 if target_tokens < 1000 else 20))
    room = max(600, budget - used - 300)
    # a big budget: first read the file's header (imports, module docstring), then the symbol
    if room > 9000 and s0 > 40:
        head_end = min(s0 - 1, max(20, int(room * 0.3) // 45))
        a, b = _window(lines, 1, head_end, int(room * 0.3))
        add(_call(f"Let me read the top of `{rel}` for its imports and module docstring.", "read_file", path=rel, start_line=a, end_line=b),
            _numbered(lines, a, b))
        room = max(600, budget - used - 300)
    a, b = _window(lines, s0, s1, room)
    add(_call(f"The definition is in `{rel}` at line {s0}; I will read it.", "read_file", path=rel, start_line=a, end_line=b),
        _numbered(lines, a, b))
    return {"id": f"agent_stdlib_{i:03d}", "source": "agent-stdlib", "tools": TOOLS, "messages": msgs,
            "target_tokens": target_tokens, "module": mod, "symbol": sym}


def convert_agent_stdlib(n: int = N_CONVS) -> list:
    root = stdlib_root()
    files = _candidate_files(root)
    if not files:
        raise DLiteInputError(f"found no Python source files under the stdlib root {root!r}.")
    return [build_conversation(i, files, root) for i in range(n)]


def cache_name() -> str:
    return f"agent-stdlib_py{sys.version_info[0]}{sys.version_info[1]}_v1.jsonl"
