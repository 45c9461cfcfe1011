"""The one drafter registry: every ``--drafter`` spec the reference engine and the benchmarks take.

``dlite[:PATH]``, ``hybrid[:PATH]`` (DLite + suffix lookup, chosen per round), ``suffix[:K]`` (the
lookup alone), or a baseline / ablation name (``baselines/registry.py``: EAGLE-3-, DFlash-,
DSpark-style, n-gram, DLite teacher and windows). Sits above ``drafters.py`` (the interface and
the DLite adapter), ``lookup/`` and ``baselines/``, so none of those imports another's registry.
"""

from __future__ import annotations

from .baselines.registry import BASELINE_NAMES, known_drafters_text, make_baseline_drafter
from .drafters import DLiteEngineDrafter, Drafter, load_dlite
from .errors import DLiteInputError
from .lookup.drafters import HybridEngineDrafter, SuffixEngineDrafter


def make_engine_drafter(spec: str, target) -> Drafter:
    """``--drafter`` specs: ``dlite[:PATH]``, ``hybrid[:PATH]`` (DLite + suffix lookup, chosen per
    round), ``suffix`` (the lookup alone), or a baseline/ablation name (``baselines/registry.py``)."""
    name, _, path = spec.partition(":")
    if name == "dlite":
        return DLiteEngineDrafter(load_dlite(path or None, target))
    if name == "hybrid":
        return HybridEngineDrafter(DLiteEngineDrafter(load_dlite(path or None, target)))
    if name == "suffix":
        return SuffixEngineDrafter(block_size=int(path) if path else 7)
    if name in BASELINE_NAMES:
        return make_baseline_drafter(name, path or None, target)
    raise DLiteInputError(f"unknown drafter {spec!r}; known: dlite[:PATH], hybrid[:PATH], suffix[:K], "
                          f"{known_drafters_text()}.")
