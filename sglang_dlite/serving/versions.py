"""Which sglang releases the DLITE plugin supports, and the check that enforces it.

The plugin leans on sglang internals that move between releases (the spec-v2 worker schema,
``CustomSpecAlgo``'s methods, the overlap relay, ``set_dflash_layers_to_capture``), so it pins the
release it was built and tested against. Widen the range only after running the tests (CPU) and
``bench/gpu_check_sglang.py`` (CUDA) against the new release.
"""

from __future__ import annotations

from importlib import metadata

from sglang_dlite.errors import DLiteConfigError

SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"
MIN_SGLANG = (0, 5, 23)
MAX_SGLANG_EXCLUSIVE = (0, 5, 24)


def _parse(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
        if len(parts) == 3:
            break
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def installed_sglang_version() -> str:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        import sglang  # optional: sglang

        return getattr(sglang, "__version__", "0")


def check_sglang_version(version: str | None = None) -> str:
    """Return the installed version, or raise DLiteConfigError naming the supported range."""
    v = version if version is not None else installed_sglang_version()
    if not (MIN_SGLANG <= _parse(v) < MAX_SGLANG_EXCLUSIVE):
        raise DLiteConfigError(
            f"sglang-dlite's DLITE speculative algorithm supports sglang {SUPPORTED_SGLANG}, but "
            f"sglang {v} is installed. Install a supported release "
            f"(pip install 'sglang{SUPPORTED_SGLANG}') or a sglang-dlite release built for "
            f"sglang {v}."
        )
    return v
