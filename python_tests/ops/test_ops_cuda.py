"""The CUDA draft-step kernels against their torch references, on the GPU.

Skips cleanly without a CUDA device or without the CUDA ops built (`make build-ext` on a machine
with a CUDA torch and nvcc; `bench/gpu_check.sh` does both). Tolerances as in test_ops.py:
fp32 1e-5, bf16 2e-2, fp16 2e-3 (abs and rel).
"""

from __future__ import annotations

import pytest
import torch

from sglang_dlite import ops
from sglang_dlite.ops import _ext
from sglang_dlite.ops import reference as R

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA kernel tests run on a GPU machine", allow_module_level=True)
if not _ext.has_cuda():
    pytest.skip("the CUDA ops are not built: run `make build-ext` with a CUDA torch and nvcc",
                allow_module_level=True)

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
K_OPS = torch.ops.sglang_dlite


def close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


@pytest.mark.parametrize("B", [1, 64, 300])
@pytest.mark.parametrize("K", [1, 7, 16])
@pytest.mark.parametrize("r", [8, 72, 320, 512, 700])
def test_scan(B, K, r):
    g, u = rand(B, K, r, scale=2), rand(B, K, r)
    close(K_OPS.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scan_low_precision(dtype):
    g, u = rand(16, 7, 320, dtype=dtype, scale=2), rand(16, 7, 320, dtype=dtype)
    close(K_OPS.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), dtype)


def test_scan_non_contiguous():
    g, u = rand(5, 16, 72).transpose(0, 1), rand(16, 5, 144)[..., ::2]
    close(K_OPS.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), torch.float32)


@pytest.mark.parametrize("B,L,C,K,H", [(1, 1, 0, 1, 64), (1, 2, 4, 7, 576), (64, 2, 8, 16, 2560), (3, 3, 5, 4, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_assemble(B, L, C, K, H, dtype):
    args = (rand(B, L, C, H, dtype=dtype), rand(B, H, dtype=dtype), (torch.rand(L, H, device=DEV) + 0.5).to(dtype),
            rand(L + 1, H, dtype=dtype), rand(H, dtype=dtype), K, 1e-5)
    close(K_OPS.assemble_round_inputs(*args), R.assemble_round_inputs(*args), dtype)


def attn_args(B, L, C, K, Hq, Hkv, D, dtype=torch.float32):
    S = L * C + 1 + K
    cos, sin = R.rope_cos_sin(R.round_positions(L, C, K, device=DEV), D, 10000.0)
    return [rand(B, S, Hq, D, dtype=dtype), rand(B, S, Hkv, D, dtype=dtype), rand(B, S, Hkv, D, dtype=dtype),
            cos.to(dtype), sin.to(dtype), torch.rand(B, C, device=DEV) < 0.7, L, K]


@pytest.mark.parametrize("C", range(0, 9))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_contexts(C, causal):
    args = attn_args(3, 2, C, 7, 4, 2, 64)
    close(K_OPS.round_attention(*args, causal), R.round_attention(*args, causal), torch.float32)


@pytest.mark.parametrize("B,L,C,K,Hq,Hkv,D", [(1, 2, 4, 1, 9, 3, 64), (64, 2, 4, 16, 32, 8, 128), (2, 4, 64, 16, 4, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_shapes(B, L, C, K, Hq, Hkv, D, dtype):
    args = attn_args(B, L, C, K, Hq, Hkv, D, dtype)
    for causal in (False, True):
        close(K_OPS.round_attention(*args, causal), R.round_attention(*args, causal), dtype)


def test_attention_non_contiguous():
    q, k, v, cos, sin, valid, L, K = attn_args(2, 2, 3, 4, 4, 2, 32)
    ref = R.round_attention(q, k, v, cos, sin, valid, L, K, True)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    close(K_OPS.round_attention(qt, k, v, cos, sin, valid, L, K, True), ref, torch.float32)


@pytest.mark.parametrize("M,V,H", [(1, 1000, 64), (7, 49152, 576), (448, 151936, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_argmax(M, V, H, dtype):
    y, w, nw = rand(M, H, dtype=dtype), rand(V, H, dtype=dtype, scale=0.05), (torch.rand(H, device=DEV) + 0.5).to(dtype)
    logits = torch.nn.functional.linear(R.rms_norm(y, nw, 1e-5), w).float()
    out = K_OPS.lm_head_argmax(y, nw, 1e-5, w)
    picked = logits.gather(-1, out[:, None])[:, 0]
    torch.testing.assert_close(picked, logits.max(-1).values, atol=4 * TOL[dtype], rtol=4 * TOL[dtype])


def test_wrong_device_and_dtype():
    g = rand(2, 3, 8)
    with pytest.raises(ValueError, match="CUDA tensor"):
        K_OPS.lowrank_rnn_scan(g, g.cpu())
    with pytest.raises(TypeError, match="same dtype"):
        K_OPS.lowrank_rnn_scan(g, g.half())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        K_OPS.lowrank_rnn_scan(g.double(), g.double())


def test_dispatcher_picks_cuda(monkeypatch):
    g, u = rand(2, 3, 8), rand(2, 3, 8)
    for mode in ("auto", "cuda"):
        ops.set_ops_mode(mode)
        close(ops.lowrank_rnn_scan(g, u), R.lowrank_rnn_scan(g, u), torch.float32)
        assert ops.last_impl("lowrank_rnn_scan") == "cuda"
