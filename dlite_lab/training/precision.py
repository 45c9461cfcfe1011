"""Whether bf16 autocast pays on this CPU.

On a CPU without bf16 instructions (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``) oneDNN still
runs bf16 autocast, but by converting to float32 around every matmul: on this project's CI machine
(Xeon, AVX-512 without avx512_bf16) the drafter trains at 13 anchors/s with ``--bf16`` against 45 in
float32, 3.4x slower, to nearly the same loss. ``torch`` itself cannot tell: its CPU capability is
"AVX512" either way and ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is true on any AVX512BW
core. The kernel's CPU flags can, so this module reads them.
"""

from __future__ import annotations

import sys
from typing import Optional

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 / AMX; Arm's "Features: ... bf16"


def cpu_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> Optional[bool]:
    """True / False from the CPU's flags; None when they cannot be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            if set(value.split()) & set(NATIVE_BF16_FLAGS):
                return True
    return False


def emulated_bf16_note(who: str, cpuinfo: str = "/proc/cpuinfo") -> Optional[str]:
    """The warning for bf16 autocast on a CPU that lacks bf16 instructions, or None if it has them
    (or its flags cannot be read)."""
    if cpu_native_bf16(cpuinfo) is not False:
        return None
    return (f"{who}: --bf16 on a CPU without bf16 instructions (no {' / '.join(NATIVE_BF16_FLAGS[:2])} in "
            f"{cpuinfo}): autocast emulates it and runs ~3x slower than float32 here; drop --bf16 "
            "(float32 is the CPU default) unless you need bf16 numerics.")


def warn_if_emulated_bf16(who: str) -> bool:
    """Print :func:`emulated_bf16_note` to stderr; True when it warned."""
    note = emulated_bf16_note(who)
    if note:
        print(note, file=sys.stderr, flush=True)
    return note is not None
