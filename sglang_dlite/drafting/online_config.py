"""The online learner's settings (``online.py``; the sglang worker's setting ``online`` reads the same
fields, ``settings.py``): what they are, their checks, and the ``key=value`` spec both
engines parse (``--drafter dlite-online@lr=1e-3``, ``{"online": "lr=1e-3"}``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from sglang_dlite.errors import DLiteConfigError, DLiteInputError

# parameter name prefixes of each trainable set ("layers.-1." = the last backbone layer)
PARAM_SETS = {"norm": ("final_norm.",), "head": ("head.", "final_norm."),
              "last": ("layers.-1.", "head.", "final_norm.")}
SCOPES = ("session", "server")

# The serving worker's defaults where they differ from the dataclass's (the reference engine's, per
# session): one adapter for the whole batch (per-session weights cannot batch), each update within a
# time budget, a smaller step (under token trees lr 1e-3 kept more of the gain than 3e-3:
# docs/results.md), an update every 16 rounds and a watchdog comparison every 32 (concurrency 1,
# medians of 3: 1.01x static tokens/s, tau +7 %; every 8 rounds 0.96x, every 4 0.88x).
# backoff 8: while the tree gate drafts the shipped trees, learn from one tree round in 8 (float32,
# concurrency 1, 512 tokens: 1.2 ms of learning per round instead of 5.9; docs/results.md, "The back-off").
SERVING_DEFAULTS = {"scope": "server", "max_update_ms": 50.0, "lr": 1e-3, "update_every": 16, "watchdog_every": 32,
                    "backoff": 8}


@dataclass
class OnlineConfig:
    """The learner's settings; ``parse("params=head,scope=server,lr=1e-3")`` reads a spec's options."""

    params: str = "last"  # PARAM_SETS (the best measured: see the module doc)
    scope: str = "session"  # SCOPES
    lr: float = 3e-3  # Adam
    update_every: int = 4  # rounds between updates
    steps: int = 2  # optimizer steps per update
    batch_size: int = 16  # pairs per step (sampled from the buffer)
    buffer_size: int = 256  # pairs kept, oldest dropped first
    min_pairs: int = 4  # no update before the buffer holds this many pairs
    recent: int = 4  # newest pairs always in a step's batch (the rest sampled at random)
    ce_weight: float = 1.0  # the stabilize stage's CE + TV
    tv_weight: float = 1.0
    gamma: float = 4.0  # position weights exp(-(i-1)/gamma), as offline training
    tv_topk: int = 32  # target probabilities kept per verified row (the TV term's label)
    decay: float = 0.02  # server scope: after each update, delta *= 1 - decay
    watchdog_window: int = 64  # rounds per watchdog verdict (0: no watchdog)
    watchdog_margin: float = 0.0  # revert when adapted mean accepted < shipped's - margin
    watchdog_every: int = 0  # compare on one round in this many (0: every round per session, 1 in 8 at server scope)
    max_update_ms: Optional[float] = None  # an update stops stepping past this (breaks determinism); server: paced
    seed: int = 0
    tree_gate: int = 32  # token trees: judged rounds the gate weighs, adapted vs shipped tree (0: off; OnlineDrafter)
    backoff: int = 1  # token trees: while the gate drafts the shipped tree, learn from one round in this many (1: all)

    def __post_init__(self):
        if self.params not in PARAM_SETS:
            raise DLiteConfigError(f"online params={self.params!r}: pick one of {', '.join(PARAM_SETS)}.")
        if self.scope not in SCOPES:
            raise DLiteConfigError(f"online scope={self.scope!r}: pick one of {', '.join(SCOPES)}.")
        ints = ("update_every", "steps", "batch_size", "buffer_size", "min_pairs", "tv_topk", "backoff")
        bad = [n for n in ints if int(getattr(self, n)) < 1] + (["watchdog_every"] if self.watchdog_every < 0 else [])
        bad += ["tree_gate (>= 0)"] if self.tree_gate < 0 else []
        if bad or self.lr <= 0 or not 0 <= self.decay < 1 or self.watchdog_window < 0 or self.recent < 0:
            raise DLiteConfigError(f"online settings out of range ({', '.join(bad) or 'lr/decay/watchdog/recent'}): "
                                   "counts >= 1, lr > 0, 0 <= decay < 1, watchdog_window >= 0, recent >= 0.")

    @property
    def watch_every(self) -> int:  # rounds per watchdog comparison (watchdog_every; 0: the scope's default)
        return self.watchdog_every or (8 if self.scope == "server" else 1)

    @classmethod
    def parse(cls, text: str) -> "OnlineConfig":
        """``key=value`` pairs separated by commas (empty: the defaults)."""
        return cls.from_mapping(cls.spec_items(text))

    @classmethod
    def spec_items(cls, text: str) -> dict:
        """A spec's ``key=value`` pairs, values as written (``from_mapping`` types them)."""
        kw = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise DLiteInputError(f"online option {item!r}: expected key=value with key one of "
                                      f"{', '.join(f.name for f in fields(cls))}.")
            kw[key.strip()] = value
        return kw

    def to_spec(self) -> str:
        """The spec ``parse`` reads back into this config (the settings that differ from the defaults)."""
        default = OnlineConfig()
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if getattr(self, f.name) != getattr(default, f.name))

    @classmethod
    def from_mapping(cls, kw: dict, where: str = "online option {key}={value!r}") -> "OnlineConfig":
        """The settings of ``kw`` (names with ``-`` or ``_``; values typed, or strings as ``parse``
        reads them); an unknown key or a value of the wrong type raises a message built from ``where``."""
        types = {f.name: f.type for f in fields(cls)}
        out = {}
        for key, value in kw.items():
            name = str(key).strip().replace("-", "_")
            msg = where.format(key=key, value=value)
            if name not in types:
                raise DLiteInputError(f"{msg}: unknown; the keys are {', '.join(types)}.")
            try:
                out[name] = _typed(value, types[name])
            except (TypeError, ValueError):
                raise DLiteInputError(f"{msg}: {value!r} is not a {types[name]}.") from None
        return cls(**out)


def _typed(value, kind: str):
    """``value`` (a string from a spec, or a JSON value) as a field of type ``kind``."""
    if isinstance(value, str):
        value = value.strip()
        if "str" in kind:
            return value
        if "Optional" in kind and value.lower() == "none":
            return None
        return int(value) if kind == "int" else float(value)
    if value is None and "Optional" in kind:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or "str" in kind:
        raise TypeError(kind)
    if kind == "int" and value != int(value):
        raise ValueError(kind)
    return int(value) if kind == "int" else float(value)
