"""DLITE's serving settings: one JSON a user writes, resolved once at launch into ``ServingOptions``.

Where they go: ``SGLANG_DLITE_CONFIG``, a path to a JSON file or the JSON itself, e.g.
``SGLANG_DLITE_CONFIG='{"max_batch_size": 48, "lookup": true}'``. Keys (``SETTINGS``, defaults in
``ServingOptions``): ``lookup``, ``verify_width``, ``drafter_dtype``, ``draft_cuda_graph``,
``round_log``, ``max_batch_size``, ``soft_batch_size``, ``soft_num_drafts``, ``tree_max_batch_size``,
``tree_branches``, ``online``, ``corpus_tokens``, ``ops``, ``spec_metrics``, the CPU stand-ins' ``cpu_attention`` and
``cpu_packed_linear``, ``cpu_overlap``, and the debug keys ``lookup_trace``, ``tp_sync``, ``tp_check`` (serving/README.md
says what each does). An unknown key or a bad value stops the
launch with a message. ``SGLANG_DLITE_CONFIG`` is the only variable DLITE's serving reads (the
other one of the product, ``SGLANG_DLITE_CACHE``, is the cache folder: ``model/bundled_target.py``).

The launcher's checks (``algorithm.py``) and the worker (the scheduler process, which inherits the
server's environment) each call ``ServingOptions.from_env()`` once; the worker carries the frozen
result, reads no variable after that and logs the effective values once (``describe``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Mapping, Optional

import torch

from sglang_dlite import ops
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.drafting.budget import WIDTH_MODES, adaptive_width_wanted
from sglang_dlite.drafting.online_config import SERVING_DEFAULTS, OnlineConfig

ENV_CONFIG = "SGLANG_DLITE_CONFIG"
TREE_CPU_BATCH_SIZE = 16  # tree rounds up to this batch on a CPU by default (tree_max_batch_size; docs/results.md)


@dataclass(frozen=True)
class ServingOptions:
    lookup: bool = True  # hybrid drafting: DLite + the per-request suffix lookup (false: DLite alone)
    verify_width: str = "auto"  # auto | adaptive | fixed: the per-round verify width (drafting/budget.py)
    drafter_dtype: str = ""  # float32 | bfloat16 | float16 | target ("": the default of drafter_dtype below)
    draft_cuda_graph: bool = True  # false: the drafter runs eagerly on a GPU
    round_log: Optional[str] = None  # a JSON-lines file, one line per decode round (metrics.py)
    max_batch_size: Optional[int] = None  # hard off-switch: a larger decode batch runs no drafter (drafting/budget.py)
    soft_batch_size: Optional[int] = None  # soft limit: a larger decode batch verifies at most soft_num_drafts
    soft_num_drafts: int = 2  # drafts per request per round above soft_batch_size
    # token trees (serving/rounds.py) for greedy decode batches of at most this many requests; 0: chains
    # only; null: the default of tree_batch_size below
    tree_max_batch_size: Optional[int] = None
    tree_branches: int = 4  # children each drafting source offers a tree node
    # online learning (online_serving.py): given as true / a spec string / a JSON object, held as the
    # OnlineConfig it resolves to (SERVING_DEFAULTS under what the setting gives); None: off
    online: Optional[OnlineConfig] = None
    ops: str = "auto"  # which kernels the drafter's ops run: auto | torch | cpp | cuda (ops.set_ops_mode)
    # per-response speculation metrics (serving/spec_metrics.py) for every request: off | summary | detailed
    # (off: only requests that ask, custom_params["dlite_spec_metrics"])
    spec_metrics: str = "off"
    # CPU stand-ins (serving/cpu_support, read by every sglang process at start-up, speculative or not):
    # "same": sglang's own DECODE and prefill forwards attend through the project's CPU attention too (a
    # like-for-like speed comparison); "sglang": as sglang ships them. cpu_packed_linear: bf16 linears on
    # prepacked oneDNN weights in every forward (false: F.linear)
    cpu_attention: str = "sglang"
    cpu_packed_linear: bool = True
    # on a CPU device DLITE runs sglang's non-overlap scheduler, as sglang does for its own speculative
    # algorithms there (algorithm.py: cpu_schedule); true: the overlap scheduler a GPU runs (its tests)
    cpu_overlap: bool = False
    corpus_tokens: int = 0  # cross-request corpus of finished requests' tokens for tree branches (drafting/corpus.py); 0: off
    lookup_trace: Optional[str] = None  # debug: a JSON-lines file of live indices + sources per round
    tp_sync: bool = True  # debug (false): no broadcast of rank 0's drafts / accepts under TP
    tp_check: bool = False  # debug (true): all-gather and compare them every round

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "ServingOptions":
        """The settings of ``SGLANG_DLITE_CONFIG`` (``environ``: the environment, by default the process's)."""
        env = os.environ if environ is None else environ
        return _checked(cls(**read_config(env.get(ENV_CONFIG))))

    def adaptive_width(self, device, disable_cuda_graph: bool, tp_size: int) -> bool:
        """Whether the hybrid picks its verify width per round (``adaptive_width_wanted``)."""
        return adaptive_width_wanted(str(device), disable_cuda_graph, tp_size, self.verify_width)

    def tree_batch_size(self, device) -> int:
        """Largest decode batch drafted as token trees (0: chains only). Default: TREE_CPU_BATCH_SIZE on
        a CPU (measured there); chains on other devices, whose tree verify (the prefix + tree mask
        of sglang's GPU attention backends) has not run in this project."""
        if self.tree_max_batch_size is not None:
            return int(self.tree_max_batch_size)
        return TREE_CPU_BATCH_SIZE if str(device).startswith("cpu") else 0

    def describe_drafting(self) -> str:
        return "hybrid (DLite + suffix lookup)" if self.lookup else "DLite alone (lookup: false)"

    def describe(self) -> str:
        """The effective user settings, one line (logged once at start-up; the opt-in and debug
        settings only where they differ from their defaults)."""
        out = {k: getattr(self, k) for k in SETTINGS if k not in _QUIET or getattr(self, k) != _DEFAULTS[k]}
        if self.online is not None:
            out["online"] = self.online.to_spec()
        return json.dumps(out, sort_keys=True)


SETTINGS = ("lookup", "verify_width", "drafter_dtype", "draft_cuda_graph", "round_log", "max_batch_size",
            "soft_batch_size", "soft_num_drafts", "tree_max_batch_size", "tree_branches",
            "online", "corpus_tokens", "ops", "spec_metrics", "cpu_attention", "cpu_packed_linear", "cpu_overlap",
            "lookup_trace", "tp_sync", "tp_check")
_QUIET = ("online", "corpus_tokens", "ops", "spec_metrics", "cpu_attention", "cpu_packed_linear", "cpu_overlap", "lookup_trace",
          "tp_sync", "tp_check")  # in ``describe`` only when changed
CPU_ATTENTION = ("sglang", "same")  # the setting cpu_attention's values
SPEC_METRICS = ("off", "summary", "detailed")  # the setting spec_metrics's values
_DEFAULTS = {f.name: f.default for f in fields(ServingOptions)}


def read_config(text: Optional[str]) -> dict:
    """The user settings of ``SGLANG_DLITE_CONFIG`` (a JSON object, or the path of a file holding one)."""
    if not text or not text.strip():
        return {}
    src = "the JSON in " + ENV_CONFIG
    if not text.lstrip().startswith(("{", "[")):
        src = f"{ENV_CONFIG}={text!r}"
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise DLiteConfigError(f"{src}: cannot read it ({exc.strerror}); give a JSON file's path or the "
                                   "JSON itself, e.g. '{\"max_batch_size\": 48}'.") from None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise DLiteConfigError(f"{src} is not valid JSON ({exc}).") from None
    if not isinstance(raw, dict):
        raise DLiteConfigError(f"{src} must be a JSON object of settings, got {type(raw).__name__}.")
    unknown = sorted(set(raw) - set(SETTINGS))
    if unknown:
        raise DLiteConfigError(f"{src}: unknown setting(s) {unknown}; the settings are {', '.join(SETTINGS)}.")
    return dict(raw)


def _checked(o: ServingOptions) -> ServingOptions:
    """Values of the right type and range (the message names the setting), normalized."""
    def bad(key, want):
        return DLiteConfigError(f"DLITE setting {key}={getattr(o, key)!r}: {want} ({ENV_CONFIG}).")

    for key in ("lookup", "draft_cuda_graph", "cpu_packed_linear", "cpu_overlap", "tp_sync", "tp_check"):
        if not isinstance(getattr(o, key), bool):
            raise bad(key, "must be true or false")
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    for key in ("max_batch_size", "soft_batch_size", "tree_max_batch_size"):
        if getattr(o, key) is not None and not count(getattr(o, key)):
            raise bad(key, "must be a batch size >= 0, or null (" + ("the default" if key.startswith("tree") else
                                                                       "no limit") + ")")
    if not count(o.soft_num_drafts):
        raise bad("soft_num_drafts", "must be an integer >= 0")
    if not count(o.corpus_tokens):
        raise bad("corpus_tokens", "must be a token budget >= 0 (0: no cross-request corpus)")
    if o.corpus_tokens and not o.lookup:
        raise bad("corpus_tokens", "needs the suffix lookup (lookup: true): the corpus branches its tree nodes")
    if not count(o.tree_branches) or o.tree_branches < 1:
        raise bad("tree_branches", "must be an integer >= 1")
    width = str(o.verify_width).strip().lower()
    if width not in WIDTH_MODES:
        raise bad("verify_width", f"use one of {', '.join(WIDTH_MODES)}")
    dtype = str(o.drafter_dtype or "").strip().lower()
    if dtype and dtype not in (*_DTYPES, "target"):
        raise bad("drafter_dtype", f"use one of {', '.join(list(_DTYPES) + ['target'])}")
    for key in ("round_log", "lookup_trace"):
        if getattr(o, key) is not None and not isinstance(getattr(o, key), str):
            raise bad(key, "must be a file path, or null (off)")
    if o.cpu_attention not in CPU_ATTENTION:
        raise bad("cpu_attention", f"use one of {', '.join(CPU_ATTENTION)}")
    mode = str(o.ops).strip().lower()
    if mode not in ops.MODES:
        raise bad("ops", f"use one of {', '.join(ops.MODES)}")
    spec = str(o.spec_metrics).strip().lower() if isinstance(o.spec_metrics, str) else None
    if spec not in SPEC_METRICS:
        raise bad("spec_metrics", f"use one of {', '.join(SPEC_METRICS)}")
    return replace(o, verify_width=width, drafter_dtype=dtype, ops=mode, spec_metrics=spec,
                   online=online_setting(o.online))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def drafter_dtype(target_dtype: torch.dtype, device, options: Optional[ServingOptions] = None) -> torch.dtype:
    """The drafter's dtype: the ``drafter_dtype`` setting (float32 | bfloat16 | float16 | target;
    ``options`` None: read from the environment). By default the target's, except on a CPU without
    bf16 arithmetic (no avx512_bf16 / AMX), where it is float32: there the drafter's few-row fp32
    GEMVs beat emulated bf16 ones (draft round 1.2-2.6x faster; the drafter reads the target's
    hidden states in its own dtype, and its drafts, not the output, depend on it: verify is lossless)."""
    name = (options or ServingOptions.from_env()).drafter_dtype
    if not name:
        cpu = str(device).startswith("cpu")
        name = "float32" if cpu and target_dtype != torch.float32 and not ops.cpu_has_native_bf16() else "target"
    return target_dtype if name == "target" else _DTYPES[name]


def online_setting(value) -> Optional[OnlineConfig]:
    """The setting ``online`` -> its ``OnlineConfig`` (None: off). Given as null or false (off), true
    (the defaults), a spec string (``"params=head,lr=1e-3"``) or a JSON object of the same fields;
    ``SERVING_DEFAULTS`` fill what it leaves out; the scope must be server."""
    if value is None or value is False:
        return None
    if isinstance(value, OnlineConfig):
        return value
    where = f"DLITE setting online ({ENV_CONFIG})"
    if not isinstance(value, (bool, str, dict)):
        raise DLiteConfigError(f"{where}: {value!r} must be a spec string such as \"params=head,lr=1e-3\", a "
                               "JSON object of the same fields, true (the defaults), or null (off).")
    try:
        given = {} if value is True else OnlineConfig.spec_items(value) if isinstance(value, str) else value
        cfg = OnlineConfig.from_mapping({**SERVING_DEFAULTS, **given}, where + ": {key}={value!r}")
    except (DLiteInputError, DLiteConfigError) as exc:
        raise DLiteConfigError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None
    if cfg.scope != "server":
        raise DLiteConfigError(f"{where}: scope={cfg.scope!r}; serving learns at server scope only (one adapter "
                               "for the whole batch: per-session weights cannot batch).")
    return cfg
