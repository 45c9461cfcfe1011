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

This module is the registry (``SOURCES``, ``parse_source``, ``load_prompts``, ``prompt_ids``) and the
chat sources; the code sources live in ``prompt_code``, the tool-use sources in ``prompt_tools``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

from sglang_dlite.errors import DLiteInputError
from dlite_lab.workloads.sharegpt import load_sharegpt
from dlite_lab.training.data import shard_file
from dlite_lab.training.prompt_code import _agent_convs, _codegen_convs, _stdlib_convs
from dlite_lab.training.prompt_tools import _bfcl_convs, _toolchat_convs


def _sharegpt_convs(n: int, rng: random.Random, max_turns: int) -> list:
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


# the built-in sources besides sharegpt: (count, seeded rng) -> conversations (their own turn counts)
_CODE_AND_TOOL_SOURCES = {"bfcl": _bfcl_convs, "stdlib": _stdlib_convs, "agent": _agent_convs,
                          "codegen": _codegen_convs, "toolchat": _toolchat_convs}
SOURCES = ("sharegpt",) + tuple(_CODE_AND_TOOL_SOURCES)


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
    elif name == "jsonl":
        convs = _jsonl_convs(path, n, max_turns)
        name = "jsonl_" + hashlib.sha1(path.encode()).hexdigest()[:6]
    else:
        convs = _CODE_AND_TOOL_SOURCES[name](n, rng)
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
