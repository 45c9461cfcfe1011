"""Errors a user can act on. Each message says what is wrong and what to do about it."""


class DLiteError(Exception):
    """Base class of every error sglang-dlite raises on purpose."""


class DLiteConfigError(DLiteError, ValueError):
    """A drafter config or checkpoint is invalid, or does not match its target."""


class DLiteInputError(DLiteError, ValueError):
    """A request is invalid: empty prompt, context over the model's limit, bad K, ..."""


class MissingDependencyError(DLiteError, ImportError):
    """An optional dependency is not installed; the message says what to install."""

