"""The DLITE worker's serving options: every ``SGLANG_DLITE_*`` switch it reads, resolved once.

``ServingOptions.from_env()`` reads the environment of the process that builds the worker (the
scheduler, which inherits the server's) once, when the worker starts; the worker carries the
frozen result and reads no variable after that (the launcher's checks in ``algorithm.py`` and
``serve.py`` read theirs before the scheduler starts). Each field names its variable and default
(sglang_plugin/README.md says more). ``SGLANG_DLITE_OPS`` (which kernels run)
stays the ops package's own switch: it dispatches every op on it, reference engine and worker alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from .. import ops
from ..errors import DLiteConfigError
from ..lookup.batch import ENV_LOOKUP, ENV_TRACE, lookup_enabled
from ..speculation.verify_width import ENV_VERIFY_WIDTH, adaptive_width_wanted

ENV_DRAFTER_DTYPE = "SGLANG_DLITE_DRAFTER_DTYPE"
ENV_DRAFT_CUDA_GRAPH = "SGLANG_DLITE_DRAFT_CUDA_GRAPH"
ENV_TP_SYNC = "SGLANG_DLITE_TP_SYNC"
ENV_TP_CHECK = "SGLANG_DLITE_TP_CHECK"
ENV_ROUND_LOG = "SGLANG_DLITE_ROUND_LOG"


@dataclass(frozen=True)
class ServingOptions:
    lookup: bool = True  # SGLANG_DLITE_LOOKUP (on; 0 / off / false: DLite alone, no suffix lookup)
    lookup_trace: Optional[str] = None  # SGLANG_DLITE_LOOKUP_TRACE: JSON lines, live indices + sources per round
    verify_width: str = "auto"  # SGLANG_DLITE_VERIFY_WIDTH: auto | adaptive | fixed (speculation/verify_width.py)
    drafter_dtype: str = ""  # SGLANG_DLITE_DRAFTER_DTYPE (unset: the default of drafter_dtype below)
    draft_cuda_graph: bool = True  # SGLANG_DLITE_DRAFT_CUDA_GRAPH (on; 0: the drafter runs eagerly on a GPU)
    tp_sync: bool = True  # SGLANG_DLITE_TP_SYNC (on; 0: no broadcast of rank 0's drafts / accepts under TP)
    tp_check: bool = False  # SGLANG_DLITE_TP_CHECK (off; 1: all-gather and compare them every round)
    round_log: Optional[str] = None  # SGLANG_DLITE_ROUND_LOG: JSON lines, one per decode round (metrics.py)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "ServingOptions":
        env = os.environ if environ is None else environ
        return cls(
            lookup=lookup_enabled(env),
            lookup_trace=env.get(ENV_TRACE) or None,
            verify_width=env.get(ENV_VERIFY_WIDTH, "auto"),
            drafter_dtype=env.get(ENV_DRAFTER_DTYPE, "").strip().lower(),
            draft_cuda_graph=env.get(ENV_DRAFT_CUDA_GRAPH, "1") != "0",
            tp_sync=env.get(ENV_TP_SYNC, "1") != "0",
            tp_check=env.get(ENV_TP_CHECK, "0") == "1",
            round_log=env.get(ENV_ROUND_LOG) or None,
        )

    def adaptive_width(self, device, disable_cuda_graph: bool, tp_size: int) -> bool:
        """Whether the hybrid picks its verify width per round (``adaptive_width_wanted``)."""
        return adaptive_width_wanted(str(device), disable_cuda_graph, tp_size,
                                     environ={ENV_VERIFY_WIDTH: self.verify_width})

    def describe_drafting(self) -> str:
        return "hybrid (DLite + suffix lookup)" if self.lookup else f"DLite alone ({ENV_LOOKUP}=0)"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def drafter_dtype(target_dtype: torch.dtype, device, options: Optional[ServingOptions] = None) -> torch.dtype:
    """The drafter's dtype: ``SGLANG_DLITE_DRAFTER_DTYPE`` (float32 | bfloat16 | float16 | target;
    ``options.drafter_dtype``, None: read from the environment). By default the target's, except
    on a CPU without bf16 arithmetic (no avx512_bf16 / AMX), where it is float32: there the
    drafter's few-row fp32 GEMVs beat emulated bf16 ones (draft round 1.2-2.6x faster; the drafter
    reads the target's hidden states in its own dtype, and its drafts, not the output, depend on
    it: verify is lossless)."""
    name = (options or ServingOptions.from_env()).drafter_dtype
    if not name:
        cpu = str(device).startswith("cpu")
        name = "float32" if cpu and target_dtype != torch.float32 and not ops.cpu_has_native_bf16() else "target"
    if name == "target":
        return target_dtype
    if name not in _DTYPES:
        raise DLiteConfigError(f"{ENV_DRAFTER_DTYPE}={name!r} is not understood; use one of "
                               f"{', '.join(list(_DTYPES) + ['target'])}.")
    return _DTYPES[name]
