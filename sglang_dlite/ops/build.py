"""Build the compiled draft-step ops (csrc/) into build/ext/sglang_dlite_ops.so.

    python -m sglang_dlite.ops.build [--verbose] [--force]     (``make build-ext`` runs this)

The op schemas (csrc/schemas.cpp) and the CPU ops (csrc/cpu/: ATen + TORCH_LIBRARY only, ~15 s on
2 cores) always; the CUDA ops (csrc/cuda/: the kernels + their TORCH_LIBRARY_IMPL bindings) too when
torch was built with CUDA and nvcc is found. Uses torch.utils.cpp_extension.load with ninja, so a
second run with unchanged sources does nothing. The output directory is <repo>/build/ext (git-ignored).
Compiler flags: -O3 -march=native by default (the library is built on the machine that runs it);
``--cpu-flags`` replaces ``-march=native`` (e.g. "-mavx2 -mfma" or "").
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

import torch
from torch.utils.cpp_extension import CUDA_HOME, load

from sglang_dlite.ops import _ext


def nvcc_flags() -> list[str]:
    """nvcc flags of the CUDA ops: csrc/cuda/nvcc_flags.txt (one argument a line, '#' comments),
    the one list that csrc/cuda_check.sh (`make cuda-check`) compiles with too (gencode sm_80 and
    sm_90a, -O3, -std, -lineinfo); torch's load() adds its COMMON_NVCC_FLAGS and -fPIC."""
    text = (_ext.repo_root() / "csrc" / "cuda" / "nvcc_flags.txt").read_text()
    return [a for a in (ln.split("#", 1)[0].strip() for ln in text.splitlines()) if a]


def want_cuda() -> bool:
    if torch.version.cuda is None:
        return False
    return CUDA_HOME is not None or shutil.which("nvcc") is not None


def build(verbose: bool = False, force: bool = False, cuda: bool | None = None, cpu_flags: str = "-march=native") -> str:
    csrc = _ext.repo_root() / "csrc"
    out = _ext.build_dir()
    out.mkdir(parents=True, exist_ok=True)
    if force:
        for p in out.iterdir():
            if p.is_file():
                p.unlink()
    with_cuda = want_cuda() if cuda is None else cuda
    sources = [str(csrc / "schemas.cpp")] + sorted(str(f) for f in (csrc / "cpu").glob("*.cpp"))
    arch = cpu_flags.split()
    cflags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi", *arch]
    if with_cuda:
        sources += [str(csrc / "cuda" / "dlite_cuda.cu"), str(csrc / "cuda" / "dlite_cuda_bindings.cpp")]
        cflags.append("-DDLITE_WITH_CUDA")
    load(
        name=_ext.LIB_NAME,
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=nvcc_flags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,
    )
    _ext.reset()
    return str(_ext.lib_path())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--force", action="store_true", help="rebuild from scratch")
    ap.add_argument("--no-cuda", action="store_true", help="build the CPU ops only")
    ap.add_argument("--cpu-flags", default="-march=native",
                    help="the C++ flags that pick the CPU's instructions (default: -march=native; e.g. '-mavx2 -mfma')")
    args = ap.parse_args(argv)
    t0 = time.time()
    path = build(args.verbose, args.force, cuda=False if args.no_cuda else None, cpu_flags=args.cpu_flags)
    ok = _ext.load()
    print(f"sglang_dlite.ops.build: {path} ({time.time() - t0:.1f} s); {_ext.status()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
