"""The CUDA kernels of ``csrc/cuda/dlite_cuda.cu`` built for the SIMT host emulation
(``csrc/emu/simt.h``) and run on the CPU: a ctypes library (plain build) and a driver program for the
sanitizer builds (AddressSanitizer + UndefinedBehaviorSanitizer; ThreadSanitizer). The same source
file nvcc compiles, not a copy. Used by ``python_tests/ops/test_kernel_emulation.py`` (``make kernel-check``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sglang_dlite.ops import c_api

ROOT = Path(__file__).resolve().parents[1]
# SGLANG_DLITE_KERNEL_CU points the check at another copy of the kernel file (a planted mutation)
KERNEL_CU = Path(os.environ.get("SGLANG_DLITE_KERNEL_CU", ROOT / "csrc/cuda/dlite_cuda.cu"))
SOURCES = [KERNEL_CU, ROOT / "csrc/emu/kernel_check.cpp"]
HEADERS = [ROOT / "csrc/cuda/dlite_cuda.h", *sorted((ROOT / "csrc/emu").glob("*.h"))]
BUILD_DIR = Path(os.environ.get("SGLANG_DLITE_EMU_DIR", ROOT / "build" / "kernel_emu"))

COMMON = ["-std=c++17", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas",
          "-fno-omit-frame-pointer", f"-I{ROOT / 'csrc/emu'}", f"-I{ROOT / 'csrc/cuda'}"]
FLAVORS = {
    # in-process through ctypes: the whole grid, fast
    "plain": (["-O2", "-fPIC", "-shared"], "libdlite_cuda_emu.so"),
    # driver programs: a Python process cannot host a TSan library
    "asan": (["-O1", "-DDLITE_EMU_DRIVER", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
             "kernel_check_asan"),
    "tsan": (["-O1", "-DDLITE_EMU_DRIVER", "-fsanitize=thread"], "kernel_check_tsan"),
}
SM90_SMEM_OPTIN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin: H100 / H200 / H800
SM80_SMEM_OPTIN = 166912  # A100
DTYPE_CODE = c_api.DTYPE_CODE
OPS = {"assemble": 0, "attention": 1, "scan": 2, "argmax": 3, "configure": 4}


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build(flavor: str) -> Path:
    """Compile one flavor (cached by a hash of the sources, headers and flags); returns its path."""
    flags, name = FLAVORS[flavor]
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("kernel-check needs a C++17 compiler (g++): apt-get install g++")
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.name.encode() + p.read_bytes())
    h.update(" ".join(COMMON + flags).encode())
    out = BUILD_DIR / f"{flavor}-{h.hexdigest()[:16]}" / name
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    cmd = [cxx, *COMMON, *flags, "-x", "c++", *map(str, SOURCES), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"kernel-check build ({flavor}) failed:\n{' '.join(cmd)}\n{res.stderr[-6000:]}")
    tmp.rename(out)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.numpy().tobytes()


def _tensor(raw: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype in (torch.bfloat16, torch.float16):
        return torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(dtype).reshape(shape)
    np_dtype = {torch.float32: np.float32, torch.int64: np.int64}[dtype]
    return torch.from_numpy(np.frombuffer(raw, dtype=np_dtype).copy()).reshape(shape)


@dataclass
class Case:
    """One launcher call: op, dtype, integer arguments, eps, inputs, and the output's dtype/shape."""
    op: str
    dtype: torch.dtype
    ints: list
    inputs: list
    out_dtype: torch.dtype
    out_shape: tuple
    eps: float = 0.0
    label: str = ""

    def out_nbytes(self) -> int:
        n = 1
        for s in self.out_shape:
            n *= s
        return n * torch.empty((), dtype=self.out_dtype).element_size()


@dataclass
class Result:
    rc: int
    out: torch.Tensor | None
    message: str = ""


def assemble_case(ctx, anchor, norm_w, depth, mask, K: int, eps: float) -> Case:
    B, L, C, H = ctx.shape
    return Case("assemble", ctx.dtype, [B, L, C, H, K], [ctx, anchor, norm_w, depth, mask], ctx.dtype,
                (B, L * C + 1 + K, H), eps)


def attention_case(q, k, v, cos, sin, valid, L: int, K: int, causal: bool) -> Case:
    B, S, Hq, D = q.shape
    C = valid.shape[1]
    return Case("attention", q.dtype, [B, S, Hq, k.shape[2], D, L, C, int(causal)],
                [q, k, v, cos.float(), sin.float(), valid], q.dtype, tuple(q.shape))


def scan_case(g, u) -> Case:
    return Case("scan", g.dtype, list(g.shape), [g, u], g.dtype, tuple(g.shape))


def argmax_case(logits) -> Case:
    M, V = logits.shape
    return Case("argmax", logits.dtype, [M, V], [logits], torch.int64, (M,))


class Library:
    """The plain build through ctypes: launchers, the attention plan, emulator controls."""

    def __init__(self, path: Path | None = None):
        self.lib = c_api.declare(ctypes.CDLL(str(path or build("plain"))))
        L, vp, i64 = self.lib, ctypes.c_void_p, ctypes.c_int64
        L.dlite_emu_configure.argtypes = [ctypes.c_int, ctypes.c_int]
        L.dlite_emu_message.restype = ctypes.c_char_p
        L.dlite_emu_stats.argtypes = [ctypes.POINTER(ctypes.c_long)]
        for fn in ("to_bf16", "to_f16", "from_bf16", "from_f16"):
            getattr(L, f"dlite_emu_{fn}").argtypes = [vp, vp, i64]
        self.configure()

    def configure(self, smem_optin: int = SM90_SMEM_OPTIN, reverse: bool = False) -> None:
        self.lib.dlite_emu_configure(smem_optin, int(reverse))

    def plan(self, S: int, D: int, smem_limit: int = SM90_SMEM_OPTIN):
        """(tile, smem bytes) or None: dlite_round_attention_plan."""
        tile, smem = ctypes.c_int64(), ctypes.c_int64()
        ok = self.lib.dlite_round_attention_plan(S, D, smem_limit, ctypes.byref(tile), ctypes.byref(smem))
        return (tile.value, smem.value) if ok else None

    def stats(self) -> dict:
        a = (ctypes.c_long * 6)()
        self.lib.dlite_emu_stats(a)
        return dict(zip(("launches", "blocks", "threads", "switches", "barriers", "collectives"), a))

    def convert(self, fn: str, x: np.ndarray, out_dtype) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty(x.shape, dtype=out_dtype)
        getattr(self.lib, f"dlite_emu_{fn}")(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def run(self, case: Case) -> Result:
        self.lib.dlite_emu_reset()
        ins = [t.contiguous() for t in case.inputs]
        ins = [t.to(torch.uint8) if t.dtype == torch.bool else t for t in ins]
        out = torch.empty(case.out_shape, dtype=case.out_dtype)
        p = [t.data_ptr() for t in ins]
        I, dt = case.ints, DTYPE_CODE[case.dtype]
        L = self.lib
        if case.op == "assemble":
            rc = L.dlite_assemble_round_inputs_cuda(dt, *p, out.data_ptr(), *I, case.eps, None)
        elif case.op == "attention":
            rc = L.dlite_round_attention_cuda(dt, *p, out.data_ptr(), *I[:7], I[7], None)
        elif case.op == "scan":
            rc = L.dlite_lowrank_rnn_scan_cuda(dt, *p, out.data_ptr(), *I, None)
        else:
            rc = L.dlite_rowwise_argmax_cuda(dt, *p, out.data_ptr(), *I, None)
        msg = L.dlite_emu_message().decode()
        return Result(rc, out, msg)


def run_driver(flavor: str, cases: list, smem_optin: int = SM90_SMEM_OPTIN, reverse: bool = False,
               timeout: float = 600):
    """Run ``cases`` through a sanitizer build's driver. Returns (results, stderr, returncode)."""
    exe = build(flavor)
    with tempfile.TemporaryDirectory() as d:
        cpath, opath = Path(d) / "cases.bin", Path(d) / "out.bin"
        with open(cpath, "wb") as f:
            f.write(struct.pack("<4i", OPS["configure"], 0, 2, 0) + struct.pack("<2q", smem_optin, int(reverse))
                    + struct.pack("<f", 0.0) + struct.pack("<q", 0))
            for c in cases:
                f.write(struct.pack("<4i", OPS[c.op], DTYPE_CODE[c.dtype], len(c.ints), len(c.inputs)))
                f.write(struct.pack(f"<{len(c.ints)}q", *c.ints) + struct.pack("<f", c.eps))
                for t in c.inputs:
                    raw = _bytes(t)
                    f.write(struct.pack("<q", len(raw)) + raw)
                f.write(struct.pack("<q", c.out_nbytes()))
        env = dict(os.environ)
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:halt_on_error=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        env.setdefault("TSAN_OPTIONS", "halt_on_error=1:report_signal_unsafe=0")
        proc = subprocess.run([str(exe), str(cpath), str(opath)], capture_output=True, text=True,
                              timeout=timeout, env=env)
        results = []
        if opath.exists():
            raw = opath.read_bytes()
            pos = 0
            for c in [None] + cases:
                if pos + 12 > len(raw):
                    break  # the driver stopped early (a sanitizer halted it): check() counts the results
                rc, nb = struct.unpack_from("<iq", raw, pos)
                pos += 12
                body = raw[pos:pos + nb]
                pos += nb
                if pos + 4 > len(raw) or len(body) < nb:
                    break
                (ml,) = struct.unpack_from("<i", raw, pos)
                pos += 4
                msg = raw[pos:pos + ml].decode()
                pos += ml
                if c is not None:
                    results.append(Result(rc, _tensor(body, c.out_dtype, c.out_shape) if nb else None, msg))
        return results, proc.stderr, proc.returncode


@dataclass
class Grid:
    """A named list of cases and their references."""
    cases: list = field(default_factory=list)
    refs: list = field(default_factory=list)
    tols: list = field(default_factory=list)
    exact: list = field(default_factory=list)  # bf16/fp16: the output most elements must equal bit for bit

    def add(self, case: Case, ref: torch.Tensor, tol: float, exact: torch.Tensor | None = None):
        self.cases.append(case)
        self.refs.append(ref)
        self.tols.append(tol)
        self.exact.append(exact)
