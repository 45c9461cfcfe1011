"""Baseline drafters for side-by-side comparison with DLite (GitHub issue 6).

- ``eagle3``: EAGLE-3-style, 3 fused target layers, one decoder layer with its own KV cache.
- ``dflash`` / ``dspark``: DFlash-style block drafter with context K/V injected into every layer;
  DSpark adds a rank-r Markov logit head.
- ``ngram``: prompt lookup, no training.
- ``registry``: ``--drafter NAME[:PATH]`` for these and DLite's ablations.
"""

from dlite_lab.baselines.registry import BASELINE_NAMES, DRAFTER_NAMES, make_baseline_drafter, new_model  # noqa: F401
