"""Context lookup drafting beside DLite (pure python/torch, imports no sglang).

* ``suffix.SuffixIndex``: an incremental suffix automaton over one request's tokens with
  occurrence counts; ``propose(K)`` follows the most frequent continuation of the longest
  earlier-occurring suffix (SuffixDecoding-style, per request).
* ``corpus``: the opt-in cross-request corpus (off by default): earlier requests' tokens per
  tenant within a token budget, an extra source of tree branches (``CorpusView``).
* ``chooser``: calibrated acceptance probabilities for lookup steps and DLite's drafts, the
  per-request choice (lookup / DLite / DLite's prefix continued by the lookup) by expected
  accepted tokens, and the calibration constants fitted on training data.
* ``drafters``: the reference engine's ``suffix`` and ``hybrid`` drafters.
"""

from .suffix import DEFAULT_MAX_MATCH, LookupDraft, LookupStep, SuffixIndex

__all__ = ["DEFAULT_MAX_MATCH", "LookupDraft", "LookupStep", "SuffixIndex"]
