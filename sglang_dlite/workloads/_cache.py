"""Where parsed workloads are cached ($SGLANG_DLITE_CACHE/workloads/, git-ignored) and how."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from ..target import cache_dir


def workloads_cache_dir() -> Path:
    d = cache_dir() / "workloads"
    d.mkdir(parents=True, exist_ok=True)
    return d


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
    path = workloads_cache_dir() / name
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
