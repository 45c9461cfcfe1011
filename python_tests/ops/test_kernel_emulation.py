"""The CUDA kernels' real source (csrc/cuda/dlite_cuda.cu) on this CPU, through the SIMT host
emulation (csrc/emu/simt.h), against the torch references: `make kernel-check`.

Three builds of the same file: plain (ctypes, the whole grid of test_ops_cuda.py and more), AddressSanitizer
+ UndefinedBehaviorSanitizer (a driver program, the same grid), ThreadSanitizer (barriers as the only
happens-before between the threads of a block: shared-memory races). The emulator's own rules
(barrier divergence, shuffle masks, deadlocks, launch limits) fail a launch with a message; every
case asserts that message is empty. Tolerances as in test_ops_cuda.py: fp32 1e-5, bf16 2e-2, fp16 2e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_dlite.ops import limits
from sglang_dlite.ops import reference as R

import kernel_emu as E

if E.compiler() is None:
    pytest.skip("kernel-check needs g++", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CUDA_ERROR_INVALID_CONFIGURATION = 9
# bf16/fp16 outputs: the share of elements bit-equal to the kernel's spec (the reference's roundings,
# fp32 math). Only fp32 summation order may differ; a moved or missing rounding point drops it far lower.
MIN_BIT_EQUAL = 0.99


def rand(*shape, dtype=F32, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def attn_inputs(B, L, C, K, Hq, Hkv, D, dtype=F32, gen=None, valid_p=0.7):
    S = L * C + 1 + K
    cos, sin = R.rope_cos_sin(R.round_positions(L, C, K), D, 10000.0)
    return (rand(B, S, Hq, D, dtype=dtype, gen=gen), rand(B, S, Hkv, D, dtype=dtype, gen=gen),
            rand(B, S, Hkv, D, dtype=dtype, gen=gen), cos.to(dtype), sin.to(dtype),
            torch.rand(B, C, generator=gen) < valid_p, L, K)


def attention_spec(q, k, v, cos, sin, valid, L, K, causal):
    """round_attention with the kernel's roundings (RoPE'd q and k in the storage dtype, as the
    reference), the softmax and P.V in float64, one rounding of the output: what a bf16/fp16 kernel
    output should equal bit for bit up to fp32 summation order (torch's low-precision SDPA rounds
    its intermediates, so the reference itself matches only to the tolerance)."""
    B, S, Hq, D = q.shape
    qr, kr = R.apply_rope(q, cos, sin).double(), R.apply_rope(k, cos, sin).double()
    g = Hq // k.shape[2]
    kr, vr = kr.repeat_interleave(g, dim=2), v.double().repeat_interleave(g, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qr, kr) / D ** 0.5
    mask = R.round_attention_mask(valid, L, K, causal)[:, None]
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", p, vr).to(q.dtype)


def argmax_rows(gen):
    """Ties, NaN, infinities and tails for the row-wise argmax."""
    rows = []
    x = torch.randn(5, 1000, generator=gen)
    x[0, 17] = x[0, 900] = 50.0                      # tie: the lower id wins
    x[1, 3] = float("nan")                           # NaN is the maximum (torch.argmax)
    x[2, 700] = float("nan"); x[2, 5] = float("nan")  # first NaN
    x[3] = float("-inf")                             # all -inf: id 0
    x[4, 999] = float("inf")                         # the last element (a tail)
    rows.append(x)
    rows.append(torch.full((2, 300), 1.0))           # all equal: id 0
    y = torch.full((1, 257), float("nan"))          # all NaN
    rows.append(y)
    z = torch.randn(3, 77, generator=gen)            # V < block size
    z[:, 40] = z.max() + 1
    rows.append(z)
    return rows


def build_grid(sanitized: bool) -> E.Grid:
    """test_ops_cuda.py's grid, plus the limit, tail and tie cases. ``sanitized`` trims the batch of the
    three largest shapes (the shapes themselves stay) to keep the sanitizer builds within budget."""
    gen = torch.Generator().manual_seed(0)
    g = E.Grid()
    big = 8 if sanitized else 64
    for B in (1, big, 300 if not sanitized else 40):
        for K in (1, 7, 16):
            for r in (8, 72, 320, 512, 700):
                gl, u = rand(B, K, r, scale=2, gen=gen), rand(B, K, r, gen=gen)
                g.add(E.scan_case(gl, u), R.lowrank_rnn_scan(gl, u), TOL[F32])
    for dt in (BF16, F16):
        gl, u = rand(16, 7, 320, dtype=dt, scale=2, gen=gen), rand(16, 7, 320, dtype=dt, gen=gen)
        ref = R.lowrank_rnn_scan(gl, u)
        g.add(E.scan_case(gl, u), ref, TOL[dt], exact=ref)
    for B, L, C, K, H in [(1, 1, 0, 1, 64), (1, 2, 4, 7, 576), (big, 2, 8, 16, 2560), (3, 3, 5, 4, 100)]:
        for dt in (F32, BF16, F16):
            args = (rand(B, L, C, H, dtype=dt, gen=gen), rand(B, H, dtype=dt, gen=gen),
                    (torch.rand(L, H, generator=gen) + 0.5).to(dt), rand(L + 1, H, dtype=dt, gen=gen),
                    rand(H, dtype=dt, gen=gen), K, 1e-5)
            ref = R.assemble_round_inputs(*args)
            g.add(E.assemble_case(*args), ref, TOL[dt], exact=None if dt == F32 else ref)
    for C in range(0, 9):
        for causal in (False, True):
            a = attn_inputs(3, 2, C, 7, 4, 2, 64, gen=gen)
            g.add(E.attention_case(*a, causal), R.round_attention(*a, causal), TOL[F32])
    shapes = [(1, 2, 4, 1, 9, 3, 64), (big // 4 if sanitized else 64, 2, 4, 16, 32, 8, 128),
              (2, 4, 64, 16, 4, 1, 128),   # S = 273: past the sm_90 limit in one tile -> two tiles
              (1, 1, 216, 1, 2, 1, 128),   # S = 218: the largest single tile under sm_90
              (1, 1, 217, 1, 2, 1, 128),   # S = 219: one key past it
              (2, 2, 4, 7, 9, 3, 64)]      # the shipped drafter's round (S = 16, D = 64)
    for B, L, C, K, Hq, Hkv, D in shapes:
        for dt in (F32, BF16, F16):
            a = attn_inputs(B, L, C, K, Hq, Hkv, D, dtype=dt, gen=gen)
            for causal in (False, True):
                g.add(E.attention_case(*a, causal), R.round_attention(*a, causal), TOL[dt],
                      exact=None if dt == F32 else attention_spec(*a, causal))
    a = attn_inputs(2, 2, 5, 7, 4, 2, 32, gen=gen, valid_p=0.0)  # every context slot invalid
    g.add(E.attention_case(*a, True), R.round_attention(*a, True), TOL[F32])
    for M, V in [(1, 1000), (7, 49152), (64 if sanitized else 448, 151936)]:
        for dt in (F32, BF16):
            logits = rand(M, V, dtype=dt, gen=gen)
            g.add(E.argmax_case(logits), logits.float().argmax(-1), 0.0)
    for x in argmax_rows(gen):
        for dt in (F32, BF16, F16):
            xd = x.to(dt)
            g.add(E.argmax_case(xd), xd.float().argmax(-1), 0.0)
    return g


def check(grid: E.Grid, results) -> None:
    assert len(results) == len(grid.cases), f"{len(results)} results for {len(grid.cases)} cases"
    for i, (c, ref, tol, exact, res) in enumerate(zip(grid.cases, grid.refs, grid.tols, grid.exact, results)):
        what = f"case {i}: {c.op} {c.dtype} {c.ints}"
        assert res.message == "", f"{what}: {res.message}"
        assert res.rc == 0, f"{what}: launcher returned CUDA error {res.rc}"
        if c.op == "argmax":
            assert torch.equal(res.out, ref), f"{what}: {res.out.tolist()[:8]} vs {ref.tolist()[:8]}"
            continue
        torch.testing.assert_close(res.out.float(), ref.float(), atol=tol, rtol=tol, msg=what)
        if exact is not None and exact.numel():
            same = (res.out.view(torch.int16) == exact.contiguous().view(torch.int16)).float().mean().item()
            assert same >= MIN_BIT_EQUAL, f"{what}: {same:.3f} of the elements bit-equal to the spec"


@pytest.fixture(scope="module")
def lib():
    return E.Library()


def test_plain_build_whole_grid(lib):
    grid = build_grid(sanitized=False)
    check(grid, [lib.run(c) for c in grid.cases])


def test_asan_ubsan_build_whole_grid():
    grid = build_grid(sanitized=True)
    results, stderr, rc = E.run_driver("asan", grid.cases)
    assert rc == 0 and "ERROR: AddressSanitizer" not in stderr and "runtime error" not in stderr, stderr[-4000:]
    check(grid, results)


def tsan_grid() -> E.Grid:
    gen = torch.Generator().manual_seed(1)
    g = E.Grid()
    gl, u = rand(5, 7, 72, scale=2, gen=gen), rand(5, 7, 72, gen=gen)
    g.add(E.scan_case(gl, u), R.lowrank_rnn_scan(gl, u), TOL[F32])
    gl, u = rand(2, 3, 700, gen=gen), rand(2, 3, 700, gen=gen)
    g.add(E.scan_case(gl, u), R.lowrank_rnn_scan(gl, u), TOL[F32])
    args = (rand(1, 2, 3, 300, gen=gen), rand(1, 300, gen=gen), torch.rand(2, 300, generator=gen) + 0.5,
            rand(3, 300, gen=gen), rand(300, gen=gen), 4, 1e-5)
    g.add(E.assemble_case(*args), R.assemble_round_inputs(*args), TOL[F32])
    for C, D in ((4, 64), (217, 64)):  # one tile; several tiles under the small limit below
        a = attn_inputs(1, 1, C, 3, 2, 1, D, gen=gen)
        g.add(E.attention_case(*a, True), R.round_attention(*a, True), TOL[F32])
    x = rand(2, 1000, gen=gen)
    g.add(E.argmax_case(x), x.argmax(-1), 0.0)
    return g


def test_tsan_build_no_shared_memory_races():
    grid = tsan_grid()
    # a 64 KiB device: the S = 221 round runs in several key tiles (the barriers between tiles matter)
    results, stderr, rc = E.run_driver("tsan", grid.cases, smem_optin=64 * 1024)
    assert "ThreadSanitizer" not in stderr and rc == 0, stderr[-6000:]
    check(grid, results)


def test_schedule_independent(lib):
    """Threads and blocks run in reverse order give bit-identical outputs (no order-dependent race)."""
    gen = torch.Generator().manual_seed(2)
    cases = []
    a = attn_inputs(2, 2, 100, 7, 4, 2, 64, gen=gen)
    cases.append(E.attention_case(*a, True))
    args = (rand(2, 2, 3, 600, gen=gen), rand(2, 600, gen=gen), torch.rand(2, 600, generator=gen) + 0.5,
            rand(3, 600, gen=gen), rand(600, gen=gen), 5, 1e-5)
    cases.append(E.assemble_case(*args))
    x = rand(3, 5000, gen=gen)
    x[1, 4000] = x[1, 10] = 99.0
    cases.append(E.argmax_case(x))
    try:
        for smem in (E.SM90_SMEM_OPTIN, 64 * 1024):
            lib.configure(smem, reverse=False)
            fwd = [lib.run(c) for c in cases]
            lib.configure(smem, reverse=True)
            rev = [lib.run(c) for c in cases]
            for f, r in zip(fwd, rev):
                assert f.rc == r.rc == 0 and f.message == r.message == ""
                assert torch.equal(f.out.view(-1).view(torch.uint8) if f.out.dtype != torch.int64 else f.out,
                                   r.out.view(-1).view(torch.uint8) if r.out.dtype != torch.int64 else r.out)
    finally:
        lib.configure()


# ------------------------------------------------------------------------------ launch limits
def test_plan_matches_python_mirror_and_fits(lib):
    """The launcher's plan (C) and ops.limits (Python, what the dispatcher asks) agree, and every
    tested and shipped round fits sm_80 and sm_90 without launching past the limit."""
    shapes = [(16, 64), (25, 128), (273, 128), (218, 128), (219, 128), (16, 64), (2 * 8 + 1 + 16, 128),
              (4 * 64 + 1 + 16, 256), (1000, 64), (3, 8), (4096, 128)]
    for limit in (E.SM80_SMEM_OPTIN, E.SM90_SMEM_OPTIN, 64 * 1024):
        for S, D in shapes:
            got = lib.plan(S, D, limit)
            assert got == limits.round_attention_plan(S, D, limit), (S, D, limit)
            if got is None:  # only the 64 KiB test device is too small (D = 256: 27 keys fit)
                assert limit == 64 * 1024 and D == 256
                continue
            assert got[1] <= limit and (got[0] == S or got[0] % 32 == 0)
            assert got[1] == lib.lib.dlite_round_attention_smem_bytes(got[0], D)
    assert lib.plan(273, 128, E.SM90_SMEM_OPTIN)[0] == 192  # the old single-tile kernel asked 287 060 B
    assert lib.plan(218, 128, E.SM90_SMEM_OPTIN) == (218, limits.round_attention_smem_bytes(218, 128))
    assert lib.plan(100, 4096, E.SM90_SMEM_OPTIN) is None and limits.round_attention_plan(100, 4096) is None


def test_failed_launch_clears_the_error_and_the_next_one_runs(lib):
    gen = torch.Generator().manual_seed(3)
    a = attn_inputs(1, 2, 4, 3, 2, 1, 64, gen=gen)
    good = E.attention_case(*a, False)
    try:
        lib.configure(smem_optin=4096)  # not even 32 keys of D = 64 fit
        bad = lib.run(good)
        assert bad.rc == CUDA_ERROR_INVALID_CONFIGURATION and lib.lib.dlite_emu_peek_last_error() == 0
    finally:
        lib.configure()
    # a launch the emulated driver refuses (grid.x past 2^31 - 1): an error, then cleared
    L = lib.lib
    rc = L.dlite_assemble_round_inputs_cuda(0, None, None, None, None, None, None, 2 ** 31, 1, 0, 8, 1,
                                            1e-5, None)
    assert rc == CUDA_ERROR_INVALID_CONFIGURATION and L.dlite_emu_peek_last_error() == 0
    res = lib.run(good)
    assert res.rc == 0 and res.message == ""
    torch.testing.assert_close(res.out, R.round_attention(*a, False), atol=1e-5, rtol=1e-5)


def test_multi_tile_attention_under_a_small_device(lib):
    """The online softmax across key tiles (forced with a 64 KiB device) equals the reference."""
    gen = torch.Generator().manual_seed(4)
    try:
        lib.configure(smem_optin=64 * 1024)
        for C, D, dt in ((60, 128, F32), (100, 64, BF16), (130, 128, F16)):
            a = attn_inputs(2, 2, C, 7, 4, 2, D, dtype=dt, gen=gen)
            assert lib.plan(2 * C + 8, D, 64 * 1024)[0] < 2 * C + 8
            for causal in (False, True):
                res = lib.run(E.attention_case(*a, causal))
                assert res.rc == 0 and res.message == ""
                torch.testing.assert_close(res.out.float(), R.round_attention(*a, causal).float(),
                                           atol=TOL[dt], rtol=TOL[dt])
    finally:
        lib.configure()


# ------------------------------------------------------------------------------ host bf16 / fp16
def test_16_bit_conversions_match_torch(lib):
    """The shim's bf16/fp16 types: every 16-bit pattern to float, and float to 16 bits with
    round-to-nearest-even (ties, subnormals, overflow, NaN) bit-equal to torch's conversions."""
    pats = np.arange(65536, dtype=np.uint16)
    for fn, dt in (("from_bf16", BF16), ("from_f16", F16)):
        got = lib.convert(fn, pats, np.float32)
        want = torch.from_numpy(pats.view(np.int16).copy()).view(dt).float().numpy()
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan], want[~nan])
    # float inputs: every 16-bit value, the midpoints between neighbours (ties) and either side,
    # random floats across the whole exponent range, subnormal and overflow boundaries
    gen = np.random.default_rng(0)
    base = [gen.standard_normal(200_000).astype(np.float32) * np.float32(10.0) ** gen.integers(-12, 12, 200_000)]
    for dt in (BF16, F16):
        v = torch.from_numpy(pats.view(np.int16).copy()).view(dt).float().numpy()
        v = v[np.isfinite(v)]
        v = np.sort(v)
        mid = (v[:-1].astype(np.float64) + v[1:]) / 2
        base += [v, mid.astype(np.float32), np.nextafter(mid.astype(np.float32), np.float32(np.inf)),
                 np.nextafter(mid.astype(np.float32), np.float32(-np.inf))]
    base.append(np.array([65504, 65519.99, 65520, 1e6, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 1e-40, -0.0,
                          np.inf, -np.inf, np.nan, 3.4e38], dtype=np.float32))
    x = np.concatenate(base).astype(np.float32)
    for fn, dt in (("to_bf16", BF16), ("to_f16", F16)):
        got = lib.convert(fn, x, np.uint16)
        want = torch.from_numpy(x).to(dt).view(torch.int16).numpy().view(np.uint16)
        nan = np.isnan(x)
        bad = np.nonzero(got[~nan] != want[~nan])[0]
        assert bad.size == 0, f"{fn}: {bad.size} mismatches, e.g. {x[~nan][bad[:5]]}"
        assert np.all(np.isnan(lib.convert("from_" + fn[3:], got[nan], np.float32)))


# ------------------------------------------------------------------------------ dispatcher routing
def test_dispatcher_routes_a_round_past_the_limit(monkeypatch):
    """A round no tile of which fits the GPU's shared memory: `auto` takes the torch path, `cuda`
    refuses with the shape and the limit (the kernel is never launched past it)."""
    from sglang_dlite import ops
    from sglang_dlite.errors import DLiteInputError

    a = attn_inputs(1, 2, 3, 4, 2, 1, 64)
    monkeypatch.setattr(ops, "_pick", lambda *args, **kw: "cuda")
    monkeypatch.setattr(limits, "device_smem_optin", lambda device: 4096)
    ops.set_ops_mode("auto")
    out = ops.round_attention(*a, True)
    assert ops.last_impl("round_attention") == "torch"
    torch.testing.assert_close(out, R.round_attention(*a, True))
    ops.set_ops_mode("cuda")
    with pytest.raises(DLiteInputError, match=r"11 rows with head_dim 64 needs 7900 B .* allows 4096 B"):
        ops.round_attention(*a, True)
