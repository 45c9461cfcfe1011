"""The CPU launch environment: how this project runs a real sglang engine or server on a CPU.

The one public place that turns on the CPU-only stand-ins (``sglang_dlite/serving/cpu_support/sglang_cpu``,
shipped in the package's wheel as data: the ``sgl_kernel`` stand-in and the torch_native verify
hook, loaded in every sglang subprocess through ``PYTHONPATH`` + ``sitecustomize``). ``sglang-dlite serve --cpu``, the
demo, ``bench/`` and the tests all use it; the sglang plugin itself never does, and nothing here is
needed on a CUDA deployment.

    from sglang_dlite.serving.cpu_launch import cpu_engine
    with cpu_engine(target_path, dlite=drafter_path) as e:
        e.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 32})
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from sglang_dlite.errors import MissingDependencyError
from sglang_dlite.model.bundled_target import cache_dir

CPU_STANDINS = Path(__file__).resolve().parent / "cpu_support" / "sglang_cpu"


def _require_standins() -> None:
    if not (CPU_STANDINS / "sitecustomize.py").is_file():
        raise MissingDependencyError(
            f"the CPU stand-ins for sglang ({CPU_STANDINS}) are missing from this install: reinstall "
            "sglang-dlite (`pip install .` from a checkout, or `make venv`), which ships them as package "
            "data. On a GPU machine, launch sglang without --cpu."
        )


def cpu_environ() -> dict:
    """Environment for sglang on this CPU: stand-ins on PYTHONPATH, CPU engine on, quiet logs."""
    _require_standins()
    pp = os.environ.get("PYTHONPATH", "")
    ours = [str(CPU_STANDINS), str(CPU_STANDINS.parent)]  # the stand-ins, then torchvision_schemas
    parts = ours + [p for p in pp.split(os.pathsep) if p and p not in ours]
    return {
        "PYTHONPATH": os.pathsep.join(parts),
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_DLITE_CACHE": str(cache_dir()),
        "TOKENIZERS_PARALLELISM": "false",
        # A leaked KV / req slot crashes the scheduler at the next idle check instead of a warning.
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    }


ENV_THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"


def omp_threads_bind(ranks: int, ncpu: "int | None" = None) -> str:
    """sglang's CPU core list per rank (``SGLANG_CPU_OMP_THREADS_BIND``: ``"0-7|8-15"``): the
    machine's cores split evenly over ``ranks`` (TP x DP). sglang asserts it is set when the ranks
    outnumber the NUMA nodes."""
    ncpu = ncpu or os.cpu_count() or 1
    per = max(1, ncpu // ranks)
    return "|".join(f"{(r * per) % ncpu}-{(r * per) % ncpu + per - 1}" if per > 1 else str(r % ncpu)
                    for r in range(ranks))


def activate_cpu_standins() -> None:
    """Apply cpu_environ() to this process (and its children) and load the stand-ins here too.

    Children started from now on get the stand-ins through PYTHONPATH alone. This process must also
    import them from sys.path, which is why it is edited here (the one place in the package): an
    in-process ``sgl.Engine`` imports sglang here, sglang imports ``sgl_kernel`` at import time (the
    stand-in must win over any installed one), and the verify hook / packed linear must be installed
    in this interpreter before sglang's scheduler processes are started from it.
    """
    os.environ.update(cpu_environ())
    if str(CPU_STANDINS) not in sys.path:
        sys.path.insert(0, str(CPU_STANDINS))
    import dlite_cpu_eagle_draft  # process boundary: importable only after the sys.path edit above
    import dlite_cpu_packed_linear  # process boundary: importable only after the sys.path edit above
    import dlite_cpu_verify_hook  # process boundary: importable only after the sys.path edit above

    dlite_cpu_verify_hook.install_lazy()
    dlite_cpu_packed_linear.install_lazy()
    dlite_cpu_eagle_draft.install_lazy()


def engine_kwargs(model_path: str, *, dlite: str | None = None, overlap: bool = False, **extra) -> dict:
    """``sgl.Engine`` keyword arguments for the CPU stack (fp32, torch_native attention, a small
    KV pool, an idle scheduler that sleeps); ``dlite`` adds ``--speculative-algorithm DLITE``."""
    kw = dict(
        model_path=str(model_path), device="cpu", attention_backend="torch_native",
        sampling_backend="pytorch", dtype="float32", disable_cuda_graph=True,
        max_total_tokens=extra.pop("max_total_tokens", 16384), max_running_requests=extra.pop("max_running_requests", 16),
        mem_fraction_static=0.5, log_level=extra.pop("log_level", "error"), random_seed=0,
        # An idle scheduler otherwise busy-polls one of the 2 cores the tests and the HF reference need.
        sleep_on_idle=extra.pop("sleep_on_idle", True),
        disable_overlap_schedule=not overlap, chunked_prefill_size=extra.pop("chunked_prefill_size", 4096),
    )
    if dlite:
        kw.update(speculative_algorithm="DLITE", speculative_draft_model_path=str(dlite))
    kw.update(extra)
    return kw


def start_engine(model_path, **kw):
    """A started ``sglang.Engine`` on the CPU stack (call ``.shutdown()``)."""
    activate_cpu_standins()
    try:
        import sglang as sgl  # optional: sglang; after activate_cpu_standins()
    except ImportError as exc:
        raise MissingDependencyError("sglang is not installed: `make venv` installs the CPU stack "
                                     "(requirements/sglang-cpu.txt).") from exc
    return sgl.Engine(**engine_kwargs(model_path, **kw))


@contextlib.contextmanager
def cpu_engine(model_path, **kw):
    """``with cpu_engine(target, dlite=drafter) as e: ...``: started, then shut down."""
    e = start_engine(model_path, **kw)
    try:
        yield e
    finally:
        e.shutdown()


SERVER_CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
                   "--disable-cuda-graph", "--sampling-backend", "pytorch"]
