"""The compiled C++ CPU draft-step ops against their torch references (ops/reference.py), and the
dispatcher (``ops.set_ops_mode``).

Tolerances: fp32 1e-5 (abs and rel); bf16 2e-2 and fp16 2e-3 (abs and rel) — one or two units in
the last place of the dtype, since the kernels accumulate in fp32 in another order than ATen.
C++ tests skip (with the reason) when the library is not built: `make build-ext`.
"""

from __future__ import annotations

import pytest
import torch

from sglang_dlite import ops
from sglang_dlite.errors import DLiteInputError, MissingDependencyError
from sglang_dlite.ops import _ext
from sglang_dlite.ops import reference as R

HAVE_CPP = _ext.has_cpu()
needs_cpp = pytest.mark.skipif(not HAVE_CPP, reason=f"C++ ops not built ({_ext.unavailable_reason()}); run `make build-ext`")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
cpp = torch.ops.sglang_dlite if HAVE_CPP else None


def close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (every other element of a wider buffer)."""
    buf = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    out = buf[..., ::2]
    out.copy_(x)
    assert not out.is_contiguous()
    return out


# ----------------------------------------------------------------------------- RNN scan
@needs_cpp
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("K", [1, 7, 16])
@pytest.mark.parametrize("r", [8, 72, 320, 512])
def test_scan_fp32(B, K, r):
    g = torch.randn(B, K, r) * 2
    u = torch.randn(B, K, r)
    close(cpp.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), torch.float32)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("r", [72, 320])
def test_scan_low_precision(dtype, r):
    g = (torch.randn(8, 7, r) * 2).to(dtype)
    u = torch.randn(8, 7, r).to(dtype)
    close(cpp.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), dtype)


@needs_cpp
def test_scan_non_contiguous():
    g, u = torch.randn(3, 5, 72), torch.randn(3, 5, 72)
    gt = torch.randn(5, 3, 72).transpose(0, 1)  # non-contiguous in the batch dims
    gt.copy_(g)
    close(cpp.lowrank_rnn_scan(gt, strided(u)), R.lowrank_rnn_scan(g, u), torch.float32)


# ----------------------------------------------------------------------------- assemble
def assemble_args(B, L, C, H, K, dtype=torch.float32):
    return (
        torch.randn(B, L, C, H).to(dtype), torch.randn(B, H).to(dtype),
        (torch.rand(L, H) + 0.5).to(dtype), torch.randn(L + 1, H).to(dtype), torch.randn(H).to(dtype),
        K, 1e-5,
    )


@needs_cpp
@pytest.mark.parametrize("B,L,C,K", [(1, 1, 0, 1), (1, 2, 1, 7), (64, 2, 4, 16), (3, 3, 8, 4), (2, 2, 5, 1)])
def test_assemble_fp32(B, L, C, K):
    args = assemble_args(B, L, C, 40, K)
    close(cpp.assemble_round_inputs(*args), R.assemble_round_inputs(*args), torch.float32)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_assemble_low_precision(dtype):
    args = assemble_args(4, 2, 4, 64, 7, dtype)
    close(cpp.assemble_round_inputs(*args), R.assemble_round_inputs(*args), dtype)


@needs_cpp
def test_assemble_non_contiguous():
    ctx, anc, nw, de, me, K, eps = assemble_args(2, 2, 3, 32, 5)
    ref = R.assemble_round_inputs(ctx, anc, nw, de, me, K, eps)
    out = cpp.assemble_round_inputs(strided(ctx), strided(anc), strided(nw), strided(de), strided(me[None])[0], K, eps)
    close(out, ref, torch.float32)


# ----------------------------------------------------------------------------- attention
def attn_args(B, L, C, K, Hq=4, Hkv=2, D=16, dtype=torch.float32, p_valid=0.7):
    S = L * C + 1 + K
    q, k, v = torch.randn(B, S, Hq, D), torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    cos, sin = R.rope_cos_sin(R.round_positions(L, C, K), D, 10000.0)
    valid = torch.rand(B, C) < p_valid
    return [t.to(dtype) for t in (q, k, v, cos, sin)] + [valid, L, K]


@needs_cpp
@pytest.mark.parametrize("C", range(0, 9))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_contexts(C, causal):
    args = attn_args(3, 2, C, 7)
    close(cpp.round_attention(*args, causal), R.round_attention(*args, causal), torch.float32)


@needs_cpp
@pytest.mark.parametrize("B,K,Hq,Hkv", [(1, 1, 2, 2), (1, 16, 9, 3), (64, 7, 4, 1), (64, 16, 4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_shapes(B, K, Hq, Hkv, causal):
    args = attn_args(B, 2, 4, K, Hq, Hkv)
    close(cpp.round_attention(*args, causal), R.round_attention(*args, causal), torch.float32)


@needs_cpp
def test_attention_all_context_invalid():
    args = attn_args(2, 2, 4, 5, p_valid=0.0)
    for causal in (False, True):
        close(cpp.round_attention(*args, causal), R.round_attention(*args, causal), torch.float32)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision(dtype):
    args = attn_args(4, 2, 4, 7, 6, 2, 32, dtype)
    close(cpp.round_attention(*args, True), R.round_attention(*args, True), dtype)


@needs_cpp
def test_attention_non_contiguous():
    q, k, v, cos, sin, valid, L, K = attn_args(2, 2, 3, 4)
    ref = R.round_attention(q, k, v, cos, sin, valid, L, K, False)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] view of a [B, H, S, D] buffer
    out = cpp.round_attention(qt, strided(k), strided(v), strided(cos), sin, valid, L, K, False)
    close(out, ref, torch.float32)


# ----------------------------------------------------------------------------- LM head argmax
def check_argmax(y, w, nw, dtype):
    ref_logits = torch.nn.functional.linear(R.rms_norm(y, nw, 1e-5), w).float()
    ref = ref_logits.argmax(-1)
    out = cpp.lm_head_argmax(y, nw, 1e-5, w)
    assert out.dtype == torch.int64 and out.shape == ref.shape
    # Where the top-2 margin is above the accumulation-order noise the ids must be equal; else the
    # chosen id must be (one of) the maximum logit(s).
    top2 = ref_logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 4 * TOL[dtype]
    assert torch.equal(out[clear], ref[clear])
    picked = ref_logits.gather(-1, out[..., None])[..., 0]
    torch.testing.assert_close(picked, top2[..., 0], atol=4 * TOL[dtype], rtol=4 * TOL[dtype])


@needs_cpp
@pytest.mark.parametrize("M,H,V", [(1, 64, 1000), (7, 576, 4099), (8, 100, 333), (9, 64, 5000), (64 * 7, 48, 3000)])
def test_lm_head_argmax_fp32(M, H, V):
    y, w, nw = torch.randn(M, H), torch.randn(V, H), torch.rand(H) + 0.5
    check_argmax(y, w, nw, torch.float32)
    check_argmax(y.view(M, 1, H), w, nw, torch.float32)  # leading dims are kept


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [7, 40])
def test_lm_head_argmax_low_precision(dtype, M):
    y, w, nw = torch.randn(M, 64), torch.randn(2000, 64), torch.rand(64) + 0.5
    check_argmax(y.to(dtype), w.to(dtype), nw.to(dtype), dtype)


@needs_cpp
def test_lm_head_argmax_non_contiguous():
    y, w, nw = torch.randn(5, 7, 64), torch.randn(700, 64), torch.rand(64) + 0.5
    check_argmax(strided(y), strided(w), nw, torch.float32)


# ----------------------------------------------------------------------------- KV-cache attention
def kv_args(slots, Hq, Hkv, L, D, starts, lens, seed=0):
    """One layer's caches filled with NaN past every row's last position (the kernel must never
    read them), and the new tokens' queries."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, Hkv, L, D, generator=g)
    v = torch.randn(slots, Hkv, L, D, generator=g)
    for b, (st, n) in enumerate(zip(starts, lens)):
        k[b, :, st + n:] = float("nan")
        v[b, :, st + n:] = float("nan")
    q = torch.randn(sum(lens), Hq, D, generator=g)
    return q, k, v, torch.tensor(starts), torch.tensor(lens)


@needs_cpp
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (4, 4, 16), (6, 2, 48), (2, 1, 256)])
@pytest.mark.parametrize("starts,lens", [([0], [1]), ([0, 5, 17, 100, 31], [1, 3, 16, 5, 1]),
                                         ([15, 16, 31, 200], [1, 1, 2, 9]), ([0, 0], [40, 7])])
def test_kv_cache_attention_fp32(Hq, Hkv, D, starts, lens):
    """Every row to its own length (1..S keys, key-block edges at 16), decode (lens 1) and verify
    rows, GQA group sizes 1..4, head_dims 16..256; equal to the reference, no NaN read."""
    q, k, v, st, ln = kv_args(6, Hq, Hkv, 256, D, starts, lens)
    out = cpp.kv_cache_attention(q, k, v, st, ln, D ** -0.5)
    close(out, R.kv_cache_attention(q, k, v, st, ln, D ** -0.5), torch.float32)


@needs_cpp
def test_kv_cache_attention_strided_cache_and_large_scores():
    """A layer view of a 5-D cache (the engine's [layers, slots, Hkv, L, D]) and scores far from 0
    (the softmax's max subtraction; scores up to ~+-40, so fp32 rounding of the scores alone moves
    the outputs by ~1e-5: tolerance 1e-4)."""
    q, k, v, st, ln = kv_args(4, 6, 2, 300, 64, [3, 250, 0, 77], [2, 50, 1, 4], seed=3)
    big_k = torch.stack([k * 0, k * 4])[1]  # a view into a [2, ...] buffer
    out = cpp.kv_cache_attention(q * 2, big_k, v, st, ln, 0.125)
    ref = R.kv_cache_attention(q * 2, big_k, v, st, ln, 0.125)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    five = torch.stack([torch.zeros_like(k), k, torch.zeros_like(k)])  # [layers, slots, Hkv, L, D]
    close(cpp.kv_cache_attention(q, five[1], v, st, ln, 0.125), R.kv_cache_attention(q, k, v, st, ln, 0.125), torch.float32)


def test_kv_cache_attention_dispatch(monkeypatch):
    """auto: the kernel for float32 CPU tensors (when built), the reference for bf16 or a head_dim
    it does not take; forced torch: the reference; bad inputs: a DLiteInputError naming them."""
    q, k, v, st, ln = kv_args(3, 4, 2, 64, 16, [0, 9, 20], [2, 1, 5])
    ops.set_ops_mode("auto")
    close(ops.kv_cache_attention(q, k, v, st, ln, 0.25), R.kv_cache_attention(q, k, v, st, ln, 0.25), torch.float32)
    assert ops.last_impl("kv_cache_attention") == ("cpp" if HAVE_CPP else "torch")
    assert ops.kv_cache_attention_kernel_available(torch.float32, 16) == HAVE_CPP
    assert not ops.kv_cache_attention_kernel_available(torch.bfloat16, 16)
    assert not ops.kv_cache_attention_kernel_available(torch.float32, 24)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    ops.kv_cache_attention(qb, kb, vb, st, ln, 0.25)
    assert ops.last_impl("kv_cache_attention") == "torch"
    ops.set_ops_mode("torch")
    ops.kv_cache_attention(q, k, v, st, ln, 0.25)
    assert ops.last_impl("kv_cache_attention") == "torch"
    with pytest.raises(DLiteInputError, match="sum to q's 8 tokens"):
        ops.kv_cache_attention(q, k, v, st, torch.tensor([2, 1, 4]), 0.25)
    with pytest.raises(DLiteInputError, match="within the cache's 64 positions"):
        ops.kv_cache_attention(q, k, v, torch.tensor([0, 9, 60]), ln, 0.25)
    with pytest.raises(DLiteInputError, match="head_dim must match"):
        ops.kv_cache_attention(q[..., :8], k, v, st, ln, 0.25)
    with pytest.raises(DLiteInputError, match="B <= 3 slots"):
        ops.kv_cache_attention(q, k, v, torch.zeros(4, dtype=torch.long), torch.tensor([2, 1, 4, 1]), 0.25)


@needs_cpp
def test_kv_cache_attention_kernel_errors():
    q, k, v, st, ln = kv_args(3, 4, 2, 64, 16, [0, 9, 20], [2, 1, 5])
    with pytest.raises(TypeError, match="takes float32"):
        cpp.kv_cache_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), st, ln, 0.25)
    with pytest.raises(ValueError, match="does not fit a cache of 64 positions"):
        cpp.kv_cache_attention(q, k, v, torch.tensor([0, 9, 60]), ln, 0.25)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpp.kv_cache_attention(q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous(), st, ln, 0.25)
    with pytest.raises(TypeError, match="int64"):
        cpp.kv_cache_attention(q, k, v, st.int(), ln, 0.25)


# ----------------------------------------------------------------------------- errors
@needs_cpp
def test_errors_name_the_problem():
    g = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="gate_logits must be float32, bfloat16 or float16"):
        cpp.lowrank_rnn_scan(g.long(), g)
    with pytest.raises(TypeError, match="same dtype"):
        cpp.lowrank_rnn_scan(g, g.double().to(torch.bfloat16))
    with pytest.raises(ValueError, match="same shape"):
        cpp.lowrank_rnn_scan(g, g[:, :2])
    with pytest.raises(ValueError, match=r"\[B, K, r\]"):
        cpp.lowrank_rnn_scan(g[0], g[0])
    args = attn_args(2, 2, 3, 4)
    with pytest.raises(ValueError, match="L\\*C\\+1\\+K"):
        cpp.round_attention(*args[:6], 2, 5, False)
    with pytest.raises(TypeError, match="context_valid must be a bool"):
        cpp.round_attention(*args[:5], args[5].int(), 2, 4, False)
    a = list(assemble_args(2, 2, 3, 16, 4))
    a[3] = a[3][:2]
    with pytest.raises(ValueError, match="depth_embed must be"):
        cpp.assemble_round_inputs(*a)
    with pytest.raises(ValueError, match="disagree on the hidden size"):
        cpp.lm_head_argmax(torch.randn(3, 16), torch.ones(16), 1e-5, torch.randn(10, 17))


# ----------------------------------------------------------------------------- dispatcher
def test_forced_torch_path(monkeypatch):
    ops.set_ops_mode("torch")
    g, u = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    close(ops.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), torch.float32)
    assert ops.last_impl("lowrank_rnn_scan") == "torch"


@needs_cpp
@pytest.mark.parametrize("mode", ["cpp", "auto"])
def test_forced_and_auto_cpp_path(monkeypatch, mode):
    ops.set_ops_mode(mode)
    g, u = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    close(ops.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), torch.float32)
    assert ops.last_impl("lowrank_rnn_scan") == "cpp"
    # a gradient-requiring call goes through the reference (the compiled ops have no backward)
    g.requires_grad_(True)
    ops.lowrank_rnn_scan(g, u).sum().backward()
    assert ops.last_impl("lowrank_rnn_scan") == "torch" and g.grad is not None


def test_auto_takes_torch_where_it_measured_faster(monkeypatch):
    """bf16 lm_head_argmax: the reference below CPU_TORCH_FASTER_BELOW rows, the C++ kernel from
    there on; fp32 (and the other ops) always the C++ kernel; forced cpp is never overridden."""
    limit = ops.CPU_TORCH_FASTER_BELOW[("lm_head_argmax", torch.bfloat16)]
    assert ops.torch_faster_on_cpu("lm_head_argmax", torch.bfloat16, limit - 1)
    assert not ops.torch_faster_on_cpu("lm_head_argmax", torch.bfloat16, limit)
    assert not ops.torch_faster_on_cpu("lm_head_argmax", torch.float32, 1)
    assert not ops.torch_faster_on_cpu("round_attention", torch.bfloat16, 1)
    monkeypatch.setattr(_ext, "has_cpu", lambda: True)
    ops.set_ops_mode("auto")
    cpu = torch.device("cpu")
    bf, f32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    assert ops._pick("lm_head_argmax", (bf,), cpu, rows=limit - 1) == "torch"
    assert ops._pick("lm_head_argmax", (bf,), cpu, rows=limit) == "cpp"
    assert ops._pick("lm_head_argmax", (f32,), cpu, rows=7) == "cpp"
    ops.set_ops_mode("cpp")
    assert ops._pick("lm_head_argmax", (bf,), cpu, rows=limit - 1) == "cpp"


@needs_cpp
def test_lm_head_argmax_dispatch_by_rows(monkeypatch):
    ops.set_ops_mode("auto")
    limit = ops.CPU_TORCH_FASTER_BELOW[("lm_head_argmax", torch.bfloat16)]
    torch.manual_seed(0)
    w, nw = torch.randn(50, 16, dtype=torch.bfloat16), torch.ones(16, dtype=torch.bfloat16)
    for rows, want in ((1, "torch"), (limit, "cpp")):
        h = torch.randn(rows, 16, dtype=torch.bfloat16)
        assert torch.equal(ops.lm_head_argmax(h, nw, 1e-5, w), R.lm_head_argmax(h, nw, 1e-5, w))
        assert ops.last_impl("lm_head_argmax") == want


def test_unavailable_paths_error_clearly(monkeypatch):
    g, u = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    ops.set_ops_mode("cuda")
    if not torch.cuda.is_available():
        with pytest.raises(MissingDependencyError, match="cuda"):
            ops.lowrank_rnn_scan(g, u)
    ops.set_ops_mode("cpp")
    monkeypatch.setattr(_ext, "has_cpu", lambda: False)
    with pytest.raises(MissingDependencyError, match="make build-ext"):
        ops.lowrank_rnn_scan(g, u)
    ops.set_ops_mode("auto")
    close(ops.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), torch.float32)
    assert ops.last_impl("lowrank_rnn_scan") == "torch"
    with pytest.raises(DLiteInputError, match="ops mode 'fast' is not understood.*auto, torch, cpp, cuda"):
        ops.set_ops_mode("fast")
    assert ops.ops_mode() == "auto"  # a refused mode changes nothing
    with ops.using_ops("torch"):
        ops.lowrank_rnn_scan(g, u)
        assert ops.last_impl("lowrank_rnn_scan") == "torch"
    assert ops.ops_mode() == "auto"


@needs_cpp
def test_forced_cpp_rejects_other_devices(monkeypatch):
    ops.set_ops_mode("cpp")
    g = torch.empty(2, 3, 8, device="meta")
    with pytest.raises(DLiteInputError, match="CPU kernels"):
        ops.lowrank_rnn_scan(g, g)


# ----------------------------------------------------------------------------- model level
@needs_cpp
@pytest.mark.parametrize("block_attention, head_input", [("bidirectional", "token"), ("causal", "token"),
                                                        ("bidirectional", "hidden")])
def test_drafter_same_with_cpp_and_torch(monkeypatch, tiny_target, block_attention, head_input):
    """The served drafter (token-fed head) and the hidden-head ablation (the low-rank RNN scan)."""
    from conftest import tiny_dlite_config
    from dlite_lab.ablations import build_drafter

    torch.manual_seed(0)
    cfg = tiny_dlite_config(tiny_target, block_attention=block_attention, head_input=head_input)
    m = build_drafter(cfg).eval().bind_hf_target(tiny_target)
    torch.nn.init.normal_(m.head.out_proj.weight, std=0.05)
    B, L, C, H = 5, cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size
    ctx = torch.randn(B, L, C, H)
    valid = torch.rand(B, C) < 0.8
    anchor = torch.randint(0, cfg.vocab_size, (B,))
    out = {}
    for mode in ("torch", "cpp"):
        ops.set_ops_mode(mode)
        with torch.no_grad():
            fb = m.propose(ctx, valid, anchor).tokens if head_input == "token" else None
            out[mode] = (m(ctx, valid, anchor, feedback_tokens=fb), m.propose(ctx, valid, anchor).tokens)
        assert ops.last_impl("round_attention") == mode and ops.last_impl("lm_head_argmax") == mode
    close(out["cpp"][0], out["torch"][0], torch.float32)
    assert torch.equal(out["cpp"][1], out["torch"][1])


# ---------------------------------------------------------------- packed bf16 CPU linears
@pytest.mark.skipif(not ops.cpu_linear.available(),
                    reason="torch built without oneDNN, or a CPU its bf16 path does not run on (no AVX-512)")
def test_pack_cpu_linears_matches_f_linear_and_follows_weight_updates():
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32, bias=False)).bfloat16()
    fp = nn.Linear(8, 8)  # float32: left alone
    m.append(nn.Sequential(fp))
    assert ops.pack_cpu_linears(m) == 2
    x = torch.randn(3, 5, 64).bfloat16()
    with torch.no_grad():
        want = F.linear(F.relu(F.linear(x, m[0].weight, m[0].bias)), m[2].weight)
        got = m[2](m[1](m[0](x)))
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        m[0].weight.mul_(-1.0)  # in-place update: the packed copy must follow it
        torch.testing.assert_close(m[0](x).float(), F.linear(x, m[0].weight, m[0].bias).float(),
                                   atol=3e-2, rtol=3e-2)
    assert "forward" not in vars(fp)
    # with gradients the layer is plain nn.Linear again (autograd through F.linear)
    m[0].weight.requires_grad_(True)
    y = m[0](x.requires_grad_(True))
    y.float().sum().backward()
    assert m[0].weight.grad is not None
