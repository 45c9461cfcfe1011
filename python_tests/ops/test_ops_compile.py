"""The compiled ops trace: fake (meta) kernels registered for every torch.ops.sglang_dlite op.

``torch.library.opcheck`` checks each op's schema, its fake kernel against the real CPU kernel
(shapes, dtypes, strides) and that it works under AOT dispatch; ``torch.compile(fullgraph=True)``
of the whole greedy draft round (C++ ops) must trace without graph breaks and give the eager
tokens. Skips when the C++ library is not built (`make build-ext`).
"""

from __future__ import annotations

import pytest
import torch

from sglang_dlite import ops
from sglang_dlite.ops import _ext
from sglang_dlite.ops import reference as R

HAVE_CPP = _ext.has_cpu()
pytestmark = pytest.mark.skipif(not HAVE_CPP, reason=f"C++ ops not built ({_ext.unavailable_reason()}); run `make build-ext`")


def _op_cases():
    B, L, C, K, H = 3, 2, 4, 7, 32
    S = L * C + 1 + K
    cos, sin = R.rope_cos_sin(R.round_positions(L, C, K), 16, 10000.0)
    yield "assemble_round_inputs", (
        torch.randn(B, L, C, H), torch.randn(B, H), torch.rand(L, H) + 0.5, torch.randn(L + 1, H),
        torch.randn(H), K, 1e-5,
    )
    yield "round_attention", (
        torch.randn(B, S, 4, 16), torch.randn(B, S, 2, 16), torch.randn(B, S, 2, 16), cos, sin,
        torch.rand(B, C) < 0.7, L, K, True,
    )
    yield "lowrank_rnn_scan", (torch.randn(B, K, 24), torch.randn(B, K, 24))
    yield "lm_head_argmax", (torch.randn(B, K, H), torch.rand(H) + 0.5, 1e-5, torch.randn(100, H))
    yield "kv_cache_attention", (torch.randn(6, 4, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16),
                                 torch.tensor([0, 7, 30]), torch.tensor([1, 3, 2]), 0.25)


@pytest.mark.parametrize("name,args", list(_op_cases()), ids=[n for n, _ in _op_cases()])
def test_opcheck(name, args):
    op = getattr(torch.ops.sglang_dlite, name).default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("name,args", list(_op_cases()), ids=[n for n, _ in _op_cases()])
def test_fake_kernel_matches_real_output(name, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(torch.ops.sglang_dlite, name)
    real = op(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    assert fake.shape == real.shape and fake.dtype == real.dtype and fake.device == real.device


@pytest.mark.parametrize("head_input, head_op", [("token", "lm_head_argmax"), ("hidden", "lowrank_rnn_scan")])
def test_draft_round_compiles_fullgraph(monkeypatch, tiny_target, head_input, head_op):
    """The served drafter's round (the token-fed head) and the hidden-head ablation's (the scan)."""
    from conftest import tiny_dlite_config
    from dlite_lab.ablations import build_drafter

    ops.set_ops_mode("cpp")
    torch.manual_seed(0)
    m = build_drafter(tiny_dlite_config(tiny_target, head_input=head_input)).eval().bind_hf_target(tiny_target)
    cfg = m.config
    B = 4
    ctx = torch.randn(B, cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size)
    valid = torch.ones(B, cfg.num_context_positions, dtype=torch.bool)
    valid[0, :2] = False
    anchor = torch.randint(0, cfg.vocab_size, (B,))

    def round_tokens(ctx, valid, anchor):
        return m.propose(ctx, valid, anchor).tokens

    torch._dynamo.reset()
    with torch.no_grad():
        eager = round_tokens(ctx, valid, anchor)
        assert ops.last_impl(head_op) == "cpp"
        compiled = torch.compile(round_tokens, backend="aot_eager", fullgraph=True)(ctx, valid, anchor)
    assert torch.equal(compiled, eager)
