"""The workload format (one conversation per JSON line) and its validation.

    {"id": str, "source": str, "tools": [OpenAI-style function schemas] (optional),
     "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}]}

Extensions (documented here, used by the built-in converters):
- ``{"role": "assistant", "content": null}`` is a *generated placeholder*: the data has no
  recorded reply for that turn, so replay generates it and continues the conversation with the
  generated reply (see ``replay.py``: the target-alone output when it is run, so the context does
  not depend on the drafter).
- ``"source"`` may be missing in a user file; it then defaults to the file's stem.
- Tools may be given OpenAI-style (``{"type": "function", "function": {...}}``) or bare
  (``{"name": ..., "description": ..., "parameters": ...}``); they are normalized to the former.

Built-in workloads are converted once and cached as such files under ``$SGLANG_DLITE_CACHE/workloads/``
(git-ignored): ``cached``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from sglang_dlite.errors import DLiteInputError
from sglang_dlite.model.bundled_target import cache_dir

ROLES = ("system", "user", "assistant", "tool")


def is_placeholder(msg: dict) -> bool:
    return msg.get("role") == "assistant" and msg.get("content") is None and not msg.get("tool_calls")


def normalize_tool(tool) -> dict:
    if not isinstance(tool, dict):
        raise ValueError(f"a tool must be an object, got {type(tool).__name__}")
    fn = tool.get("function") if tool.get("type") == "function" else tool
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError("a tool needs a function name: {'type': 'function', 'function': {'name': ...}}")
    return {"type": "function", "function": fn}


def validate_record(rec, default_source: str = "custom") -> dict:
    """Check one conversation; return it normalized. Raises ValueError saying what is wrong."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    cid = rec.get("id")
    if not isinstance(cid, (str, int)) or (isinstance(cid, str) and not cid):
        raise ValueError('missing "id" (a non-empty string)')
    source = rec.get("source", default_source)
    if not isinstance(source, str):
        raise ValueError('"source" must be a string')
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    out_msgs = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{k}] is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{k}] has role {role!r}; expected one of {list(ROLES)}")
        content = m.get("content")
        if content is None and role != "assistant":
            raise ValueError(f"messages[{k}] ({role}) has no \"content\" string")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{k}].content must be a string (or null for an assistant turn to generate)")
        out_msgs.append(dict(m))
    if all(m["role"] == "system" for m in out_msgs):
        raise ValueError("the conversation has only system messages: nothing to generate")
    tools = rec.get("tools")
    out = {"id": str(cid), "source": source}
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError('"tools" must be a list of function schemas')
        try:
            out["tools"] = [normalize_tool(t) for t in tools]
        except ValueError as exc:
            raise ValueError(f'"tools": {exc}') from None
    out["messages"] = out_msgs
    for key, val in rec.items():  # keep extra metadata
        out.setdefault(key, val)
    return out


def load_jsonl_file(path, max_convs: Optional[int] = None) -> list:
    """Read and validate a user workload file; errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise DLiteInputError(f"workload file {str(p)!r} does not exist.")
    out, seen = [], {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DLiteInputError(f"{p}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}).") from None
            try:
                rec = validate_record(rec, default_source=p.stem)
            except ValueError as exc:
                raise DLiteInputError(
                    f"{p}:{lineno}: {exc}. Each line must be "
                    '{"id": str, "source": str, "tools": [...] (optional), "messages": [{"role": ..., "content": ...}]}.'
                ) from None
            if rec["id"] in seen:
                raise DLiteInputError(f"{p}:{lineno}: duplicate id {rec['id']!r} (first on line {seen[rec['id']]}).")
            seen[rec["id"]] = lineno
            out.append(rec)
            if max_convs is not None and len(out) >= max_convs:
                break
    if not out:
        raise DLiteInputError(f"{p}: no conversations (the file is empty).")
    return out


def write_jsonl_atomic(path: Path, records: Iterable[dict]) -> None:
    """Write JSON lines to ``path`` via a temp file + rename (concurrent readers never see a
    partial file; concurrent writers each write the same deterministic content)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cached(name: str, build, refresh: bool = False) -> list:
    """Records of cache file ``name`` (building and writing it once with ``build()``)."""
    path = cache_dir() / "workloads" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and not refresh:
        try:
            return read_jsonl(path)
        except (OSError, ValueError):
            pass  # a corrupt cache file: rebuild it
    records = build()
    write_jsonl_atomic(path, records)
    return records


def take(records: list, max_items: Optional[int]) -> list:
    return records if max_items is None else records[: max(0, int(max_items))]
