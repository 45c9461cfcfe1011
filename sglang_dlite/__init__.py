"""sglang-dlite: DLite, a history-free speculative-decoding drafter, for SGLang.

Pure-torch model code (``config``, ``model``), a reference engine (``engine``), the SGLang plugin
(``sglang_plugin``, imported only by sglang), and the draft-step ops (``ops``).
"""

__version__ = "0.1.0"

from .config import DLiteConfig  # noqa: E402,F401
from .errors import DLiteConfigError, DLiteError, DLiteInputError, MissingDependencyError  # noqa: E402,F401
