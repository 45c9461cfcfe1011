"""Workloads: conversations in one JSON-lines format (one conversation per line, ``format.py``),
built-in converters, rendering and replay.

``load_workload(name_or_path, max_convs=None)`` returns a built-in workload (converted from an
installed package once, then cached as JSONL under ``$SGLANG_DLITE_CACHE/workloads/``) or a
validated user ``.jsonl`` file. ``render.render_turns`` turns a conversation into token-level
turns; ``replay`` replays them through an engine and aggregates tau / speed metrics.
"""

from __future__ import annotations

import os
from typing import Optional

from sglang_dlite.errors import DLiteInputError
from dlite_lab.workloads import agent_stdlib, converters, sharegpt
from dlite_lab.workloads.format import cached, load_jsonl_file, take

BUILTIN_WORKLOADS = ("mtbench", "humaneval", "bfcl-multiturn", "sharegpt-heldout", "agent-stdlib")
_VERSION = "v1"


def _builtin(name: str, refresh: bool = False) -> list:
    if name == "sharegpt-heldout":
        return sharegpt.load_sharegpt("heldout")
    if name == "agent-stdlib":
        return cached(agent_stdlib.cache_name(), agent_stdlib.convert_agent_stdlib, refresh=refresh)
    build = {"mtbench": converters.convert_mtbench, "humaneval": converters.convert_humaneval,
             "bfcl-multiturn": converters.convert_bfcl_multiturn}[name]
    return cached(f"{name}_{_VERSION}.jsonl", build, refresh=refresh)


def load_workload(name_or_path: str, max_convs: Optional[int] = None, refresh: bool = False) -> list:
    """Conversations of a built-in workload (``BUILTIN_WORKLOADS``) or of a ``.jsonl`` file."""
    if max_convs is not None and max_convs < 1:
        raise DLiteInputError(f"max_convs must be >= 1 (got {max_convs}).")
    if name_or_path in BUILTIN_WORKLOADS:
        return take(_builtin(name_or_path, refresh=refresh), max_convs)
    if name_or_path.endswith(".jsonl") or os.path.exists(name_or_path):
        return load_jsonl_file(name_or_path, max_convs=max_convs)
    raise DLiteInputError(
        f"unknown workload {name_or_path!r}: use one of {', '.join(BUILTIN_WORKLOADS)} or a path to a .jsonl file."
    )


__all__ = ["BUILTIN_WORKLOADS", "load_workload"]
