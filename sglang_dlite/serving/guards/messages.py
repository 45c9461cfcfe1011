"""Client-facing error messages: no tracebacks, source paths or log timestamps; FastAPI's
validation errors as ``field `a.b`: what was wrong``; the OpenAI-style error body."""

from __future__ import annotations

import re
from typing import Any, Optional

MAX_MESSAGE_CHARS = 400


_TRACE_CUT = re.compile(r"(\n\s*File \"|Traceback \(most recent call last\))")
_TIMESTAMP = re.compile(r"\[\d{2}:\d{2}:\d{2}\]\s*")
_SRC_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.+-]+)+\.(?:py|pyx|cc|cpp|cu|h|hpp|c|rs)(?::\d+)*:?\s*")
_ABS_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/){2,}[\w.+-]*")


def sanitize_message(msg: Any) -> str:
    """A client-facing error message: no tracebacks, source paths, file-system paths or log
    timestamps, at most MAX_MESSAGE_CHARS characters."""
    s = str(msg)
    m = _TRACE_CUT.search(s)
    if m:
        s = s[: m.start()]
    s = _TIMESTAMP.sub("", s)
    s = _SRC_PATH.sub("", s)
    s = _ABS_PATH.sub("<path>", s)
    s = " ".join(s.split())
    if len(s) > MAX_MESSAGE_CHARS:
        s = s[: MAX_MESSAGE_CHARS - 1] + "…"
    return s or "invalid request"


_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|List\[.*\]|Dict\[.*\]|function-.*|.*\[.*\])$")


def validation_errors_message(errors: list) -> tuple:
    """FastAPI/pydantic ``exc.errors()`` -> (short message, first field)."""
    parts, first = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            why = (e.get("ctx") or {}).get("error", "cannot be parsed")
            return f"malformed JSON: {why}.", None
        if e.get("type") in ("dataclass_type", "model_type", "dict_type") and not loc:
            return "the request body must be a JSON object.", None
        loc = [x for i, x in enumerate(loc) if i == 0 or not _UNION_TAG.match(x)]
        field = ".".join(loc) or "body"
        msg = str(e.get("msg", "is invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        item = f"`{field}`: {msg}"
        if item not in parts:
            parts.append(item)
        first = first or field
        if len(parts) == 3:
            break
    return sanitize_message("; ".join(parts) or "invalid request"), first


def error_body(message: str, param: Optional[str] = None) -> dict:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": param, "code": 400}
