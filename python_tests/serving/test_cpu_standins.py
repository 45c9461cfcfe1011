"""The CPU stand-ins that patch sglang in the test / benchmark scheduler processes
(``cpu_support/sglang_cpu``):

- the attention (``dlite_cpu_verify_hook.py``) that runs sglang's TARGET_VERIFY forwards (and, with
  the setting ``cpu_attention: "same"``, its DECODE and prefill forwards) on the ``torch_native`` backend: every
  case against brute-force softmax attention in float64, one query head and one request at a time.
  Contiguous and scattered KV slots, chain and tree verify, decode, prefill over cached prefixes,
  grouped-query heads, bf16,
  request by request and as one padded batch;
- the packed-weight bf16 linear (``dlite_cpu_packed_linear.py`` over ``sglang_dlite.ops.cpu_linear``)
  against ``F.linear``, the float32 pass-through, and the repack after an in-place weight update."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.ops import cpu_linear

STANDINS = Path(__file__).resolve().parents[2] / "sglang_dlite" / "serving" / "cpu_support" / "sglang_cpu"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", STANDINS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hook = _load("dlite_cpu_verify_hook")
packed = _load("dlite_cpu_packed_linear")

HQ, HK, D = 6, 2, 16


class Pool:
    def __init__(self, n, dtype):
        g = torch.Generator().manual_seed(1)
        self.k = torch.randn(n, HK, D, generator=g).to(dtype)
        self.v = torch.randn(n, HK, D, generator=g).to(dtype)

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.out_cache_loc] = k.view(-1, HK, D).to(self.k.dtype)
        self.v[loc.out_cache_loc] = v.view(-1, HK, D).to(self.v.dtype)

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def reference(q, pool, slots, allowed, scale):
    """q [W, HQ, D]; slots [T]; allowed [W, T] bool -> [W, HQ, D] float64."""
    k, v = pool.k[slots].double(), pool.v[slots].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(HQ):
        kh = h // (HQ // HK)
        s = (q[:, h].double() @ k[:, kh].T) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        out[:, h] = s.softmax(-1) @ v[:, kh]
    return out


def _layer_backend(pool, r2t):
    """A fake attention layer, the backend's pools and sglang's ``KVWriteLoc`` for the hook's functions."""
    layer = SimpleNamespace(tp_q_head_num=HQ, tp_k_head_num=HK, qk_head_dim=D, v_head_dim=D, layer_id=0,
                            scaling=D ** -0.5)
    backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                              swa_out_cache_loc=None)
    loc = lambda out_cache_loc, swa: SimpleNamespace(out_cache_loc=out_cache_loc)  # noqa: E731
    return layer, backend, loc


def run(prefixes, width, slots_of, dtype=torch.float32, tree=None, decode=False):
    bs = len(prefixes)
    pool = Pool(4096, dtype)
    r2t = torch.zeros(bs, 1024, dtype=torch.int32)
    new_locs = []
    for i, p in enumerate(prefixes):
        total = p + (0 if decode else width)
        slots = slots_of(i, total)
        r2t[i, :total] = slots
        new_locs.append(slots[total - width:total])
    g = torch.Generator().manual_seed(2)
    q = torch.randn(bs * width, HQ * D, generator=g).to(dtype)
    k = torch.randn(bs * width, HK * D, generator=g).to(dtype)
    v = torch.randn(bs * width, HK * D, generator=g).to(dtype)
    fb = SimpleNamespace(
        batch_size=bs, seq_lens=torch.tensor(prefixes), req_pool_indices=torch.arange(bs),
        out_cache_loc=torch.cat(new_locs).long(), spec_info=SimpleNamespace(custom_mask=tree))
    layer, backend, loc = _layer_backend(pool, r2t)
    hook._plan_cache[0] = None
    out = hook._attend_blocks(backend, q, k, v, layer, fb, True, loc, decode=decode).view(bs * width, HQ, D)
    for i, p in enumerate(prefixes):
        total = p + (0 if decode else width)
        pre = total - width
        if tree is None:
            allowed = torch.arange(total)[None, :] <= (pre + torch.arange(width))[:, None]
        else:
            t = tree.view(bs, width, width)[i].bool()
            allowed = torch.cat([torch.ones(width, pre, dtype=torch.bool), t], dim=1)
        ref = reference(q[i * width:(i + 1) * width].view(width, HQ, D), pool, r2t[i, :total].long(), allowed,
                        layer.scaling)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[i * width:(i + 1) * width].double(), ref, atol=tol, rtol=tol)
    return hook._plan_cache[0]


def contiguous(i, total):
    return torch.arange(1000 * i + 7, 1000 * i + 7 + total, dtype=torch.int32)


def scattered(i, total):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randperm(4000, generator=g)[:total].to(torch.int32)


@pytest.mark.parametrize("slots_of", [contiguous, scattered], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chain_verify_matches_brute_force(slots_of, dtype):
    plan = run([5, 130, 1], 4, slots_of, dtype)
    kinds = {type(ix) for ix in plan.kv}
    assert kinds == ({slice} if slots_of is contiguous else {torch.Tensor})  # views vs gathers


def test_decode_matches_brute_force():
    run([9, 300, 1], 1, contiguous, decode=True)
    run([9, 300, 2], 1, scattered, decode=True)


def test_tree_verify_matches_brute_force():
    width, bs = 4, 2
    # node 0 root; 1 and 2 children of 0; 3 child of 1
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    run([17, 40], width, scattered, tree=anc.repeat(bs, 1, 1).reshape(-1).to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_similar_contexts_attend_as_one_padded_batch(dtype):
    plan = run([120, 100, 131], 4, scattered, dtype)  # chain verify
    assert plan.padded and plan.kv == [] and plan.index.numel() == 3 * 135
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert run([40, 37], 4, contiguous, dtype, tree=anc.repeat(2, 1, 1).reshape(-1).to(torch.uint8)).padded
    assert run([300, 290, 250], 1, scattered, dtype, decode=True).padded


def test_ragged_contexts_and_one_request_attend_request_by_request():
    assert not run([5, 130, 1], 4, scattered).padded  # 3 x 134 padded rows for 148 real ones
    assert not run([300], 4, scattered).padded
    longest = int(100 * hook.PADDED_BATCH_LIMIT / (2 - hook.PADDED_BATCH_LIMIT))  # 2 * longest <= limit * (100 + longest)
    assert run([100, longest], 1, scattered, decode=True).padded
    assert not run([100, longest + 1], 1, scattered, decode=True).padded


def test_contiguous_run_detection():
    assert hook.contiguous_run(torch.tensor([5, 6, 7], dtype=torch.int32)) == slice(5, 8)
    assert hook.contiguous_run(torch.tensor([5], dtype=torch.int32)) == slice(5, 6)
    gap = hook.contiguous_run(torch.tensor([5, 6, 8], dtype=torch.int32))
    assert isinstance(gap, torch.Tensor) and gap.tolist() == [5, 6, 8]
    # same span, not consecutive: must not be taken for a run
    perm = hook.contiguous_run(torch.tensor([5, 7, 6, 8], dtype=torch.int32))
    assert isinstance(perm, torch.Tensor)


def test_plan_is_rebuilt_for_a_new_forward():
    first = run([5, 6], 3, contiguous)
    second = run([5, 6], 3, contiguous)
    assert first is not second


def run_prefill(prefixes, news, slots_of, dtype=torch.float32):
    """``_attend_prefill`` over requests that continue cached prefixes (``prefixes[i]`` cached tokens,
    ``news[i]`` new ones), each request against brute force: new token j sees positions 0 .. prefix + j."""
    pool = Pool(4096, dtype)
    r2t = torch.zeros(len(prefixes), 2048, dtype=torch.int32)
    new_locs = []
    for i, (p, n) in enumerate(zip(prefixes, news)):
        slots = slots_of(i, p + n)
        r2t[i, :p + n] = slots
        new_locs.append(slots[p:])
    rows = sum(news)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(rows, HQ * D, generator=g).to(dtype)
    k = torch.randn(rows, HK * D, generator=g).to(dtype)
    v = torch.randn(rows, HK * D, generator=g).to(dtype)
    fb = SimpleNamespace(
        batch_size=len(prefixes), seq_lens=torch.tensor(prefixes) + torch.tensor(news),
        req_pool_indices=torch.arange(len(prefixes)), out_cache_loc=torch.cat(new_locs).long(),
        extend_prefix_lens=torch.tensor(prefixes), extend_seq_lens=torch.tensor(news),
        extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None)
    layer, backend, loc = _layer_backend(pool, r2t)
    out = hook._attend_prefill(backend, q, k, v, layer, fb, True, loc).view(rows, HQ, D)
    start = 0
    for i, (p, n) in enumerate(zip(prefixes, news)):
        allowed = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        ref = reference(q[start:start + n].view(n, HQ, D), pool, r2t[i, :p + n].long(), allowed, layer.scaling)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=tol, rtol=tol)
        start += n


@pytest.mark.parametrize("slots_of", [contiguous, scattered], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_over_cached_prefixes_matches_brute_force(slots_of, dtype, monkeypatch):
    """A fresh prompt (no prefix: one causal sdpa), prompts continuing cached prefixes (a bottom-right
    causal mask), a decode-like request of one new token (a MIXED batch), and a chunk longer than
    one query block (blocks of 7 here)."""
    monkeypatch.setattr(hook, "PREFILL_QUERY_BLOCK", 7)
    run_prefill([0, 40, 13, 300, 0], [25, 9, 30, 1, 5], slots_of, dtype)


def test_prefill_switch_and_layers_it_leaves_to_sglang(monkeypatch):
    """The setting ``cpu_attention``: off unless "same"; cross attention,
    encoder-only layers and sliding windows stay on the backend's own code."""
    monkeypatch.delenv("SGLANG_DLITE_CONFIG", raising=False)
    assert not hook.cpu_attention_enabled()
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"cpu_attention": "sglang"}')
    assert not hook.cpu_attention_enabled()
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"cpu_attention": "same"}')
    assert hook.cpu_attention_enabled()
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"cpu_attention": "1"}')
    with pytest.raises(DLiteConfigError, match="cpu_attention"):
        hook.cpu_attention_enabled()
    fb = SimpleNamespace(encoder_lens=None)
    plain = dict(is_cross_attention=False, sliding_window_size=None, attn_type=SimpleNamespace(name="DECODER"))
    assert hook._plain_causal(SimpleNamespace(**plain), fb)
    assert hook._plain_causal(SimpleNamespace(**{**plain, "sliding_window_size": -1}), fb)
    assert not hook._plain_causal(SimpleNamespace(**{**plain, "sliding_window_size": 128}), fb)
    assert not hook._plain_causal(SimpleNamespace(**{**plain, "is_cross_attention": True}), fb)
    assert not hook._plain_causal(SimpleNamespace(**{**plain, "attn_type": SimpleNamespace(name="ENCODER_ONLY")}), fb)
    assert not hook._plain_causal(SimpleNamespace(**plain), SimpleNamespace(encoder_lens=torch.tensor([3])))


# ---------------------------------------------------------------- packed-weight bf16 linear
def _fake_unquant_module():
    import torch.nn.functional as F

    class UnquantizedLinearMethod:
        def process_weights_after_loading(self, layer):
            pass

        def apply(self, layer, x, bias=None):
            layer.plain_calls = getattr(layer, "plain_calls", 0) + 1
            return F.linear(x, layer.weight, bias)

    return SimpleNamespace(UnquantizedLinearMethod=UnquantizedLinearMethod)


NO_BF16_PACKING = "oneDNN's bf16 packing does not run on this CPU (needs avx512bw/vl/dq or avx_ne_convert)"


@pytest.mark.skipif(not cpu_linear.available(), reason=NO_BF16_PACKING)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(with_bias):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if with_bias else None
    p = cpu_linear.pack_weight(w)
    for shape in [(1, 64), (4, 64), (3, 5, 64)]:
        x = torch.randn(*shape, generator=g).bfloat16()
        got = cpu_linear.packed_linear(x, p, b)
        assert got.shape == (*shape[:-1], 96)
        torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=2e-2, rtol=2e-2)
    assert cpu_linear.pack_weight(w.float()) is None  # float32 weights are not packed


@pytest.mark.skipif(not cpu_linear.available(), reason=NO_BF16_PACKING)
def test_packed_linear_patch_routes_bf16_only_and_repacks_after_update(monkeypatch):
    import torch.nn.functional as F

    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"cpu_packed_linear": true}')
    mod = _fake_unquant_module()
    packed.patch(mod)
    method = mod.UnquantizedLinearMethod()
    g = torch.Generator().manual_seed(4)
    bf = SimpleNamespace(weight=torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.1).bfloat16(),
                                                   requires_grad=False))
    fp = SimpleNamespace(weight=torch.nn.Parameter(torch.randn(32, 16, generator=g), requires_grad=False))
    method.process_weights_after_loading(bf)
    method.process_weights_after_loading(fp)
    assert hasattr(bf, "_dlite_packed") and not hasattr(fp, "_dlite_packed")
    x = torch.randn(4, 16, generator=g)
    assert torch.equal(method.apply(fp, x), F.linear(x, fp.weight))  # float32: F.linear, bit for bit
    assert fp.plain_calls == 1
    xb = x.bfloat16()
    torch.testing.assert_close(method.apply(bf, xb).float(), F.linear(xb, bf.weight).float(), atol=2e-2, rtol=2e-2)
    assert not hasattr(bf, "plain_calls")
    with torch.no_grad():
        bf.weight.mul_(-2.0)  # an in-place weight update (e.g. update_weights_from_disk)
    torch.testing.assert_close(method.apply(bf, xb).float(), F.linear(xb, bf.weight).float(), atol=4e-2, rtol=2e-2)


def test_packed_linear_falls_back_where_the_cpu_cannot_pack(monkeypatch):
    """An AVX2-only CPU (e.g. AMD EPYC without AVX-512): oneDNN's bf16 reorder raises there, so
    nothing is packed, sglang's linears and the drafter's run F.linear, and no call reaches oneDNN."""
    import torch.nn as nn
    import torch.nn.functional as F

    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"cpu_packed_linear": true}')
    monkeypatch.setattr(cpu_linear, "available", lambda: False)

    def refuse(*args, **kwargs):
        raise AssertionError("oneDNN packing called on a CPU that cannot run it")

    monkeypatch.setattr(cpu_linear, "packed_linear", refuse)
    w = (torch.randn(32, 16) * 0.1).bfloat16()
    assert cpu_linear.pack_weight(w) is None and not cpu_linear.can_pack(w)
    lin = nn.Linear(16, 32).bfloat16()
    assert cpu_linear.pack_cpu_linears(lin) == 0
    mod = _fake_unquant_module()
    packed.patch(mod)
    method = mod.UnquantizedLinearMethod()
    layer = SimpleNamespace(weight=torch.nn.Parameter(w, requires_grad=False))
    method.process_weights_after_loading(layer)
    assert not hasattr(layer, "_dlite_packed")
    x = torch.randn(4, 16).bfloat16()
    assert torch.equal(method.apply(layer, x), F.linear(x, w)) and layer.plain_calls == 1


def test_packed_linear_off_switch(monkeypatch):
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"cpu_packed_linear": false}')
    mod = _fake_unquant_module()
    before = mod.UnquantizedLinearMethod.apply
    packed.patch(mod)
    assert mod.UnquantizedLinearMethod.apply is before
