"""Drive the CUDA kernels of csrc/cuda/dlite_cuda.cu through their plain C launchers (ctypes), on
small shapes, and compare every output with ``sglang_dlite/ops/reference.py``: the program
``bench/gpu_check.py`` runs under compute-sanitizer (memcheck, racecheck, synccheck) and ncu.

    nvcc -shared -Xcompiler -fPIC -O3 -std=c++17 -lineinfo -gencode arch=compute_90a,code=sm_90a \\
        -o /tmp/libdlite_cuda.so csrc/cuda/dlite_cuda.cu
    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 bench/gpu_kernel_driver.py --lib /tmp/libdlite_cuda.so --json /tmp/kernels.json

Buffers are torch CUDA tensors. PYTORCH_NO_CUDA_MEMORY_CACHING=1 (set here before CUDA starts)
gives each tensor its own cudaMalloc, so memcheck sees an access past the end of one. Inputs are
made on the CPU and copied over, outputs start as NaN (or -1) copied over too: the only kernels
this process launches are the ones under test, and an output element a kernel does not write
fails the comparison. ``--cases profile`` runs one SmolLM2-sized launch per kernel and dtype
(for ncu) instead of the small grid. Exit 0 when every launcher returns cudaSuccess and every
output matches the reference.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

from sglang_dlite.ops import c_api  # noqa: E402
from sglang_dlite.ops import reference as R  # noqa: E402

DTYPE_CODE = c_api.DTYPE_CODE
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
EPS = 1e-5
PTR = ctypes.c_void_p

# (B, L, C, K, H): C = 0 (no context yet), odd sizes, H >= 1024 (the 256-thread launch)
ASSEMBLE_SMALL = [(1, 1, 0, 1, 64), (2, 2, 3, 4, 100), (3, 2, 4, 7, 576), (2, 3, 2, 3, 1030)]
# (B, L, C, K, Hq, Hkv, D): C = 0, GQA, D 32/64/128, one round over 48 KB of shared memory, one
# over an H100/H200's opt-in 227 KB (S = 273, D = 128: K/V tiled, online softmax)
ATTENTION_SMALL = [(1, 2, 0, 3, 2, 1, 32), (2, 2, 3, 4, 4, 2, 64), (1, 2, 4, 7, 9, 3, 64), (2, 3, 32, 7, 2, 1, 64),
                   (1, 1, 5, 4, 2, 2, 128), (1, 4, 64, 16, 2, 1, 128)]
# (B, K, R): every warp-kernel width (channels per lane 1..16) and the thread-per-channel kernel
SCAN_SMALL = [(1, 1, 8), (3, 7, 72), (5, 16, 320), (2, 4, 512), (2, 3, 700)]
# (M, V, ties): first maximum wins on ties
ARGMAX_SMALL = [(1, 10, False), (3, 1000, False), (4, 777, True), (2, 49152, False)]

# SmolLM2-135M's drafter at batch 32 (the profile for ncu)
ASSEMBLE_PROFILE = [(32, 2, 4, 7, 576)]
ATTENTION_PROFILE = [(32, 2, 4, 7, 9, 3, 64)]
SCAN_PROFILE = [(32, 7, 72)]
ARGMAX_PROFILE = [(32 * 7, 49152, False)]


def load_lib(path: str):
    return c_api.declare(ctypes.CDLL(path))


def ptr(t: torch.Tensor):
    return PTR(t.data_ptr() or None)


def stream():
    return PTR(torch.cuda.current_stream().cuda_stream or None)


def dev(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy on the GPU (a copy, not a kernel)."""
    return t.contiguous().to("cuda")


def blank(shape, dtype) -> torch.Tensor:
    fill = -1 if dtype == torch.int64 else float("nan")
    return dev(torch.full(shape, fill, dtype=dtype))


def compare(got: torch.Tensor, want: torch.Tensor, dtype) -> tuple[bool, float]:
    got = got.cpu()
    if want.dtype == torch.int64:
        return bool(torch.equal(got, want)), float((got != want).sum())
    g, w = got.float(), want.float()
    if g.shape != w.shape:
        return False, float("inf")
    if g.numel() == 0:
        return True, 0.0
    err = (g - w).abs()
    ok = bool(torch.isfinite(g).all()) and bool((err <= TOL[dtype] + TOL[dtype] * w.abs()).all())
    return ok, float(err.nan_to_num(float("inf")).max())


def run_assemble(lib, shape, dtype, gen):
    B, L, C, K, H = shape
    ctx = torch.randn(B, L, C, H, generator=gen).to(dtype)
    anchor = torch.randn(B, H, generator=gen).to(dtype)
    norm_w = (torch.rand(L, H, generator=gen) + 0.5).to(dtype)
    depth = torch.randn(L + 1, H, generator=gen).to(dtype)
    mask = torch.randn(H, generator=gen).to(dtype)
    want = R.assemble_round_inputs(ctx, anchor, norm_w, depth, mask, K, EPS)
    d = [dev(x) for x in (ctx, anchor, norm_w, depth, mask)]
    out = blank((B, L * C + 1 + K, H), dtype)
    rc = lib.dlite_assemble_round_inputs_cuda(DTYPE_CODE[dtype], *map(ptr, d), ptr(out), B, L, C, H, K, EPS, stream())
    return rc, out, want


def run_attention(lib, shape, dtype, gen, causal):
    B, L, C, K, Hq, Hkv, D = shape
    S = L * C + 1 + K
    q = torch.randn(B, S, Hq, D, generator=gen).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    cos, sin = R.rope_cos_sin(R.round_positions(L, C, K), D, 10000.0)
    cos, sin = cos.to(dtype), sin.to(dtype)  # the op takes cos/sin in the inputs' dtype, the kernel in fp32
    valid = torch.rand(B, C, generator=gen) < 0.7
    want = R.round_attention(q, k, v, cos, sin, valid, L, K, causal)
    dq, dk, dv = dev(q), dev(k), dev(v)
    dcos, dsin, dvalid = dev(cos.float()), dev(sin.float()), dev(valid)
    out = blank((B, S, Hq, D), dtype)
    rc = lib.dlite_round_attention_cuda(DTYPE_CODE[dtype], ptr(dq), ptr(dk), ptr(dv), ptr(dcos), ptr(dsin),
                                        ptr(dvalid), ptr(out), B, S, Hq, Hkv, D, L, C, int(causal), stream())
    return rc, out, want


def run_scan(lib, shape, dtype, gen):
    B, K, Rk = shape
    g = (torch.randn(B, K, Rk, generator=gen) * 2).to(dtype)
    u = torch.randn(B, K, Rk, generator=gen).to(dtype)
    want = R.lowrank_rnn_scan(g, u)
    dg, du = dev(g), dev(u)
    out = blank((B, K, Rk), dtype)
    rc = lib.dlite_lowrank_rnn_scan_cuda(DTYPE_CODE[dtype], ptr(dg), ptr(du), ptr(out), B, K, Rk, stream())
    return rc, out, want


def run_argmax(lib, shape, dtype, gen):
    M, V, ties = shape
    x = torch.randint(0, 4, (M, V), generator=gen).float() if ties else torch.randn(M, V, generator=gen)
    x = x.to(dtype)
    want = x.float().argmax(-1)
    dx = dev(x)
    out = blank((M,), torch.int64)
    rc = lib.dlite_rowwise_argmax_cuda(DTYPE_CODE[dtype], ptr(dx), ptr(out), M, V, stream())
    return rc, out, want


def cases(which: str, dtypes):
    small = which == "small"
    for dt in dtypes:
        for s in (ASSEMBLE_SMALL if small else ASSEMBLE_PROFILE):
            yield "assemble_round_inputs", s, dt, None
        for s in (ATTENTION_SMALL if small else ATTENTION_PROFILE):
            for causal in ((False, True) if small else (False,)):
                yield "round_attention", s, dt, causal
        for s in (SCAN_SMALL if small else SCAN_PROFILE):
            yield "lowrank_rnn_scan", s, dt, None
        for s in (ARGMAX_SMALL if small else ARGMAX_PROFILE):
            yield "rowwise_argmax", s, dt, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="the shared library built from csrc/cuda/dlite_cuda.cu")
    ap.add_argument("--cases", choices=("small", "profile"), default="small")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--json", default=None, help="write the per-case results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernel_driver: no CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    lib = load_lib(args.lib)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    gen = torch.Generator().manual_seed(0)
    results = []
    for op, shape, dt, causal in cases(args.cases, dtypes):
        if op == "assemble_round_inputs":
            rc, out, want = run_assemble(lib, shape, dt, gen)
        elif op == "round_attention":
            rc, out, want = run_attention(lib, shape, dt, gen, causal)
        elif op == "lowrank_rnn_scan":
            rc, out, want = run_scan(lib, shape, dt, gen)
        else:
            rc, out, want = run_argmax(lib, shape, dt, gen)
        torch.cuda.synchronize()
        ok, err = compare(out, want, dt) if rc == 0 else (False, float("inf"))
        name = f"{op}{'/causal' if causal else ''} {str(dt).replace('torch.', '')} {shape}"
        results.append({"op": op, "shape": list(shape), "dtype": str(dt).replace("torch.", ""), "causal": causal,
                        "rc": rc, "ok": ok, "max_err": err})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rc={rc} max_err={err:.3g}", flush=True)
    bad = [r for r in results if not r["ok"]]
    rec = {"ok": not bad, "cases": len(results), "failed": len(bad), "seconds": round(time.time() - t0, 1),
           "gpu": torch.cuda.get_device_name(0), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    print(f"gpu_kernel_driver: {len(results) - len(bad)}/{len(results)} cases match the reference "
          f"({rec['seconds']} s)")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
