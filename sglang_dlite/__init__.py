"""sglang-dlite: DLite, a history-free speculative-decoding drafter, for SGLang.

The drafter network (``model``, pure torch), one round's drafting / verify / acceptance (``drafting``),
the SGLang plugin (``serving``, imported only by sglang), the draft-step ops (``ops``) and the one
settings object (``settings``). The lab (reference engine, training, baselines, benchmarks) is the
sibling package ``dlite_lab`` of the source checkout, never part of this one.
"""

__version__ = "0.1.0"

from sglang_dlite.model.config import DLiteConfig  # noqa: E402,F401
from sglang_dlite.errors import DLiteConfigError, DLiteError, DLiteInputError, MissingDependencyError  # noqa: E402,F401
