"""Capture safety without a GPU: what runs inside a CUDA graph must trace on CUDA tensors and never
wait for the host.

What runs in CUDA graphs on a GPU deployment:

* draft: ``DrafterCudaGraphs`` (serving/cuda_graphs.py) captures ``DLiteDrafter.propose``
  (greedy, ``num_drafts`` = the worker's DLite drafts, with or without the confidences hybrid
  drafting reads) once per batch-size bucket. Its ops take the CUDA kernels (``ops.set_ops_mode``
  auto, CUDA library built) or else the torch reference: both paths are checked here.
* verify: sglang's own TARGET_VERIFY graph of the *target* model (decode_cuda_graph_runner).
  DLITE contributes no code to it: only the spec info the plugin's ``get_spec_info`` hook returns
  at capture (a ``DLiteVerifyInput`` without tensors: width W, no custom mask, FULL hidden
  capture), which decides the graph's hidden-state output and whether a DLITE verify batch may
  replay it. The worker's verify glue (cache locations, ``prepare_for_verify``, accept, carry,
  the hybrid lookup's host-side choice with its ``.tolist()``) runs eagerly between replays, outside
  any graph, so its host syncs are not capture hazards.

Checked here, on a CPU-only torch:

1. ``propose`` of the shipped drafter's config (token head, 8192-token drafting vocabulary, with
   and without confidence; a hidden-head variant for the RNN-scan op) on fake CUDA tensors
   (FakeTensorMode) takes the dispatcher's CUDA-kernel branch and the fake kernels of
   ``ops/fake.py`` serve every ``torch.ops.sglang_dlite`` call. The compiled library here has CPU
   kernels only, so the test reports the CUDA library as loaded (``_ext.has_cuda``); the
   dispatcher itself runs unchanged (the device's shared-memory query answers as an sm_90 GPU).
   A CPU-only torch cannot index fake CUDA tensors from Python (``Tensor.__getitem__`` takes a CUDA
   device guard it does not have), so on such a build the tests route ``__getitem__`` of CUDA
   tensors through the aten view/index ops torch's own indexing uses (``_CudaIndexingOnCpuTorch``).
2. A host-sync audit (``no_host_sync``: a dispatch mode for ``_local_scalar_dense`` / ``nonzero`` /
   ``masked_select`` / bool-mask indexing / ``unique`` / device-to-host copies, and a function
   mode for ``.item()`` / ``.tolist()`` / ``.numpy()`` / ``.cpu()`` / ``bool(t)`` / ``int(t)``) armed
   exactly where ``DrafterCudaGraphs`` captures (a stand-in for ``torch.cuda.graph``), on fake CUDA
   tensors for both op paths, and around ``propose`` on real CPU tensors with the shipped weights.
3. ``torch.compile(fullgraph=True)`` of the shipped config's propose (aot_eager, CPU) equals eager.
4. The sglang CUDA-graph glue with mocks: the spec-info hook, a DLITE verify batch accepted by the
   graph runner's ``can_run_graph`` and its hidden-state capture check, the drafter graphs' bucket
   padding and replay.
5. Attention backends not verified for DLITE's verify (TARGET_VERIFY, ``custom_mask=None``) are
   refused at launch (``spec.check_deployment``) with a message naming the verified ones.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import sglang_dlite
from sglang_dlite import ops
from sglang_dlite.model.dlite import shipped_drafter_path
from sglang_dlite.ops import _ext

SHIPPED = shipped_drafter_path()
HAVE_LIB = _ext.has_cpu()
need_shipped = pytest.mark.skipif(SHIPPED is None, reason="the shipped drafter checkpoint is missing")
need_lib = pytest.mark.skipif(not HAVE_LIB, reason=f"compiled ops not built ({_ext.unavailable_reason()}); "
                                                   "run `make build-ext`")
aten = torch.ops.aten
PKG_DIR = os.path.dirname(sglang_dlite.__file__)


# ---------------------------------------------------------------------------- the host-sync audit
class HostSyncError(AssertionError):
    pass


def _where() -> str:
    """The innermost sglang_dlite frame of the current stack (where the sync was asked for)."""
    for fr in reversed(traceback.extract_stack()):
        if fr.filename.startswith(PKG_DIR):
            return f"{os.path.relpath(fr.filename, os.path.dirname(PKG_DIR))}:{fr.lineno} ({fr.name}: {fr.line})"
    return "outside sglang_dlite"


_SYNC_PACKETS = {
    aten._local_scalar_dense: ".item() / int() / float() / bool() of a tensor",
    aten.nonzero: "nonzero (data-dependent size)",
    aten.masked_select: "masked_select (data-dependent size)",
    aten.is_nonzero: "bool() of a tensor",
    aten.equal: "torch.equal (returns a host bool)",
    aten._unique2: "unique (data-dependent size)",
    aten.unique_dim: "unique (data-dependent size)",
    aten.unique_consecutive: "unique_consecutive (data-dependent size)",
    aten.bincount: "bincount (size from the data)",
}
_INDEX_PACKETS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _SyncDispatchAudit(TorchDispatchMode):
    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        pkt = func.overloadpacket
        why = _SYNC_PACKETS.get(pkt)
        if why is None and pkt in _INDEX_PACKETS:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in idx):
                why = "indexing with a bool mask (nonzero: data-dependent size)"
        if why is None and pkt is aten.repeat_interleave and func is not aten.repeat_interleave.self_int \
                and kwargs.get("output_size") is None:
            why = "repeat_interleave with tensor repeats and no output_size"
        ins = _tensors((args, kwargs))
        on_cuda = any(t.device.type == "cuda" for t in ins)
        if why is None and on_cuda:
            host = [t for t in ins if t.device.type == "cpu" and t.dim() > 0]
            if host:
                why = f"a host tensor {tuple(host[0].shape)} as input of a CUDA op (host-to-device copy)"
        if why is None:
            out = func(*args, **kwargs)
            if not (on_cuda and any(t.device.type == "cpu" for t in _tensors(out))):
                return out
            why = "a device-to-host copy"
        raise HostSyncError(f"host sync in a CUDA-graph region: {func} -- {why} -- at {_where()}")


_SYNC_METHODS = {
    torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()",
    torch.Tensor.cpu: ".cpu()", torch.Tensor.__bool__: "bool(tensor)", torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)", torch.Tensor.__index__: "tensor used as a Python index",
}


def _is_host(a) -> bool:
    if isinstance(a, str):
        try:
            a = torch.device(a)
        except RuntimeError:
            return False
    return isinstance(a, torch.device) and a.type == "cpu"


class _SyncFunctionAudit(TorchFunctionMode):
    """Host reads that never reach the dispatcher on CPU tensors (``.tolist()``, ``.numpy()``)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _SYNC_METHODS.get(func)
        if why is None and func is torch.Tensor.to and any(_is_host(a) for a in list(args[1:]) + list(kwargs.values())):
            why = ".to() onto the host"
        if why is not None:
            raise HostSyncError(f"host sync in a CUDA-graph region: {why} -- at {_where()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync():
    """Raise HostSyncError at the first host sync inside (real or fake tensors)."""
    with _SyncFunctionAudit(), _SyncDispatchAudit():
        yield


# ---------------------------------------------------------------------------- fake CUDA tensors
_MAX = 2 ** 63 - 1


def _apply_indexing(t, idx):
    """``t[idx]`` as torch's own ``applySlicing`` + ``index`` does it, one aten op per index."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out, dim, tensors = t, 0, []
    for i in idx:
        if i is Ellipsis:
            skip = t.dim() - real
            tensors += [None] * skip
            dim += skip
        elif i is None:
            out = aten.unsqueeze.default(out, dim)
            tensors.append(None)
            dim += 1
        elif isinstance(i, bool):
            raise NotImplementedError("bool scalar index")
        elif isinstance(i, int):
            out = aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            out = aten.slice.Tensor(out, dim, 0 if i.start is None else i.start, _MAX if i.stop is None else i.stop,
                                    1 if i.step is None else i.step)
            tensors.append(None)
            dim += 1
        elif isinstance(i, torch.Tensor):
            tensors.append(i)
            dim += 1
        else:
            raise NotImplementedError(f"index of type {type(i).__name__}")
    while tensors and tensors[-1] is None:
        tensors.pop()
    if tensors:
        return aten.index.Tensor(out, tensors)
    return aten.alias.default(out) if out is t else out


class _CudaIndexingOnCpuTorch(TorchFunctionMode):
    """CPU-only torch: ``Tensor.__getitem__`` of a (fake) CUDA tensor as aten ops (the Python
    binding takes a CUDA device guard such a build lacks)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and args[0].device.type == "cuda":
            return _apply_indexing(args[0], args[1])
        return func(*args, **(kwargs or {}))


def fake_cuda_mode():
    stack = contextlib.ExitStack()
    stack.enter_context(FakeTensorMode())
    if not torch.backends.cuda.is_built():
        stack.enter_context(_CudaIndexingOnCpuTorch())
    return stack


def _to_fake_cuda(m):
    """Every parameter/buffer of ``m`` -> a fake CUDA tensor of the same shape and dtype (call
    inside a FakeTensorMode)."""
    return m._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cuda"))


def _pretend_cuda_library(monkeypatch):
    """The compiled library reports CUDA kernels (here it has CPU kernels only: the fake kernels
    serve the CUDA calls), and the fake CUDA device answers the dispatcher's device query as an
    sm_90 GPU (H100 / H200) would. The dispatcher's own logic runs unchanged."""
    monkeypatch.setattr(_ext, "has_cuda", lambda: True)
    limits = getattr(ops, "limits", None)
    if limits is not None and hasattr(limits, "device_smem_optin"):
        monkeypatch.setattr(limits, "device_smem_optin", lambda device: limits.SM90_SMEM_OPTIN)


class _RecordOps(TorchDispatchMode):
    """The compiled ops called, and the devices of their outputs."""

    def __init__(self):
        super().__init__()
        self.custom, self.out_devices = set(), set()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "sglang_dlite":
            self.custom.add(func.overloadpacket.__name__)
            self.out_devices |= {t.device.type for t in _tensors(out)}
        return out


# ---------------------------------------------------------------------------- drafters
def _drafter(head_input: str = "token", dtype=torch.bfloat16, seed: int = 0):
    """The shipped drafter (config + weights; ``head_input='hidden'``: its config with the hidden
    RNN head, random weights) bound to a target embedding / LM head of SmolLM2's shape."""
    from sglang_dlite.model.dlite import DLiteDrafter

    if head_input == "token":
        m = DLiteDrafter.from_pretrained(SHIPPED, dtype=dtype)
        assert m.config.head_input == "token" and m.config.draft_vocab_size == 8192  # the shipped config
    else:
        from sglang_dlite.model.config import DLiteConfig

        from dlite_lab.ablations import AblationDrafter

        cfg = DLiteConfig.from_pretrained(SHIPPED)
        cfg.head_input = head_input
        torch.manual_seed(seed)
        m = AblationDrafter(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    emb = (torch.randn(m.config.vocab_size, m.config.target_hidden_size, generator=g) * 0.05).to(dtype)
    return m.bind_target(emb, emb)


def _inputs(cfg, B, device="cpu", dtype=torch.float32, seed=0):
    L, C, H = cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size
    if device == "cuda":  # fake: shapes only
        return (torch.empty(B, L, C, H, dtype=dtype, device="cuda"), torch.ones(B, C, dtype=torch.bool, device="cuda"),
                torch.zeros(B, dtype=torch.int64, device="cuda"))
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, C, dtype=torch.bool)
    valid[0, : C // 2] = False
    return (torch.randn(B, L, C, H, generator=g).to(dtype), valid,
            torch.randint(0, cfg.vocab_size, (B,), generator=g))


# The ops each variant of propose must send to the compiled library.
_TOKEN_HEAD_OPS = {"assemble_round_inputs", "round_attention"}
VARIANTS = [  # (id, head_input, return_confidence, num_drafts, compiled ops that must run)
    ("shipped-greedy", "token", False, None, _TOKEN_HEAD_OPS | {"lm_head_argmax"}),
    ("shipped-confidence", "token", True, None, _TOKEN_HEAD_OPS),
    ("shipped-greedy-4-drafts", "token", False, 4, _TOKEN_HEAD_OPS | {"lm_head_argmax"}),
    ("hidden-head-greedy", "hidden", False, None, _TOKEN_HEAD_OPS | {"lowrank_rnn_scan", "lm_head_argmax"}),
    ("hidden-head-confidence", "hidden", True, None, _TOKEN_HEAD_OPS | {"lowrank_rnn_scan"}),
]


# ---------------------------------------------------------------------------- 1. the audit itself
def _clean(x, m):
    y = (x * 2)[1:] + x[:-1]
    return y.argmax(-1), y[:, None].expand(-1, 3, -1).sum(1), x.gather(0, torch.zeros_like(x, dtype=torch.int64))


SYNCS = {
    "item": lambda x, m: x.sum().item(),
    "tolist": lambda x, m: x.tolist(),
    "int": lambda x, m: int(x[0, 0]),
    "if-tensor": lambda x, m: 1 if (x > 0).any() else 0,
    "nonzero": lambda x, m: x.nonzero(),
    "masked_select": lambda x, m: x.masked_select(m),
    "bool-mask-index": lambda x, m: x[m],
    "unique": lambda x, m: torch.unique(x),
    "cpu": lambda x, m: x.cpu(),
    "to-cpu": lambda x, m: x.to("cpu"),
    "numpy": lambda x, m: x.numpy(),
    "repeat_interleave-tensor": lambda x, m: x.repeat_interleave(torch.tensor([1, 2, 1, 1])[: x.shape[0]], dim=0),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_audit_catches_host_sync(name):
    x = torch.randn(4, 5)
    m = x > 0
    _clean(x, m)
    with no_host_sync():
        _clean(x, m)  # the audit lets sync-free code through
        with pytest.raises(HostSyncError) as ei:
            SYNCS[name](x, m)
    assert "host sync" in str(ei.value)


@pytest.mark.parametrize("case", ["host-index-tensor", "item", "nonzero", "bool-mask-index"])
def test_audit_catches_host_sync_on_fake_cuda(case):
    with fake_cuda_mode():
        x = torch.empty(4, 5, device="cuda")
        fn = {"host-index-tensor": lambda: x[torch.tensor([0, 2])],  # a host tensor copied in: not capturable
              "item": lambda: x.sum().item(), "nonzero": lambda: aten.nonzero.default(x),
              "bool-mask-index": lambda: x[x > 0]}[case]
        with no_host_sync():
            _ = x[1:] * 2 + x[:-1].sum(0)
            with pytest.raises(HostSyncError):
                fn()


@need_shipped
def test_audit_names_the_line_in_sglang_dlite(monkeypatch):
    """A sync planted in the drafter is caught and located (the audit can fail on propose)."""
    from sglang_dlite.model import dlite as model_mod

    monkeypatch.setattr(model_mod.DLiteDrafter, "_draft_ids", lambda self, idx: self.draft_vocab[idx.tolist()])
    m = _drafter(dtype=torch.float32)
    ctx, valid, anchor = _inputs(m.config, 2)
    with no_host_sync(), pytest.raises(HostSyncError, match=r"\.tolist\(\) -- at sglang_dlite/model/dlite\.py:"):
        m.propose(ctx, valid, anchor, return_confidence=True)


def test_fake_cuda_indexing_matches_torch():
    """The CPU-only-torch indexing shim gives torch's own shapes and values."""
    x = torch.arange(4 * 5 * 6, dtype=torch.float32).view(4, 5, 6)
    i = torch.tensor([[0, 2], [1, 3]])
    for idx in [(slice(None), slice(2, None)), (slice(None), 1), 2, (Ellipsis, slice(None, 3)), (None, 1, slice(1, 4, 2)),
                i, (slice(None), i), (1, slice(None), i), (slice(1, 3), None, Ellipsis)]:
        assert torch.equal(_apply_indexing(x, idx), x[idx]), idx


# ---------------------------------------------------------------------------- 2. fake CUDA dispatch
@need_shipped
@need_lib
@pytest.mark.parametrize("vid,head,conf,n,want", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_propose_on_fake_cuda_takes_cuda_kernels(monkeypatch, vid, head, conf, n, want):
    ops.set_ops_mode("auto")
    _pretend_cuda_library(monkeypatch)
    m = _drafter(head)
    cfg, B = m.config, 5
    ops._last_impl.clear()
    with fake_cuda_mode():
        _to_fake_cuda(m)
        ctx, valid, anchor = _inputs(cfg, B, "cuda", torch.bfloat16)
        with _RecordOps() as rec:
            prop = m.propose(ctx, valid, anchor, num_drafts=n, return_confidence=conf)
    k = n or cfg.block_size
    assert prop.tokens.device.type == "cuda" and prop.tokens.dtype == torch.int64
    assert tuple(prop.tokens.shape) == (B, k)
    if conf:
        assert prop.confidence.device.type == "cuda" and tuple(prop.confidence.shape) == (B, k)
        assert prop.confidence.dtype == torch.float32
    else:
        assert prop.confidence is None
    assert rec.custom == want  # every compiled op ran, through its fake kernel
    assert rec.out_devices == {"cuda"}  # ... which keeps the outputs on the device
    assert {op: ops.last_impl(op) for op in want} == {op: "cuda" for op in want}


@need_shipped
@pytest.mark.parametrize("path", ["cuda-kernels", "torch-reference"])
def test_dispatcher_routes_fake_cuda_tensors(monkeypatch, path):
    """Without the CUDA library the same fake CUDA round takes the torch reference (what a GPU
    without `make build-ext` captures), with it the CUDA kernels."""
    if path == "cuda-kernels":
        if not HAVE_LIB:
            pytest.skip("compiled ops not built")
        _pretend_cuda_library(monkeypatch)
    else:
        monkeypatch.setattr(_ext, "has_cuda", lambda: False)
    ops.set_ops_mode("auto")
    m = _drafter()
    ops._last_impl.clear()
    with fake_cuda_mode():
        _to_fake_cuda(m)
        with _RecordOps() as rec:
            m.propose(*_inputs(m.config, 3, "cuda", torch.bfloat16))
    want = "cuda" if path == "cuda-kernels" else "torch"
    assert {ops.last_impl(op) for op in _TOKEN_HEAD_OPS | {"lm_head_argmax"}} == {want}
    assert bool(rec.custom) == (want == "cuda")


# ---------------------------------------------------------------------------- 3. the drafter graphs
class _FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1

    def pool(self):
        return ("pool", id(self))


def _fake_cuda_graph_api(monkeypatch, log):
    """torch.cuda's stream / graph API as no-ops; ``torch.cuda.graph`` arms the host-sync audit,
    so the audit covers exactly the captured region."""
    stream = types.SimpleNamespace(wait_stream=lambda other: None)

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append(("capture", g))
        with no_host_sync():
            yield

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)


def _spy_propose(monkeypatch, m, log):
    real = m.propose

    def spy(ctx, valid, anchor, **kw):
        log.append(("propose", ctx.shape[0], kw.get("num_drafts"), kw.get("return_confidence")))
        return real(ctx, valid, anchor, **kw)

    monkeypatch.setattr(m, "propose", spy)


@need_shipped
@pytest.mark.parametrize("path", ["cuda-kernels", "torch-reference"])
@pytest.mark.parametrize("conf", [False, True], ids=["greedy", "confidence"])
def test_drafter_graph_capture_on_fake_cuda_has_no_host_sync(monkeypatch, path, conf):
    """DrafterCudaGraphs as the worker builds it (num_drafts, confidences for hybrid drafting),
    every bucket captured on fake CUDA tensors with the audit armed inside each capture."""
    from sglang_dlite.serving.cuda_graphs import DrafterCudaGraphs

    if path == "cuda-kernels":
        if not HAVE_LIB:
            pytest.skip("compiled ops not built")
        _pretend_cuda_library(monkeypatch)
        ops.set_ops_mode("auto")
    else:
        ops.set_ops_mode("torch")
    log = []
    _fake_cuda_graph_api(monkeypatch, log)
    m = _drafter()
    _spy_propose(monkeypatch, m, log)
    ops._last_impl.clear()
    with fake_cuda_mode():
        _to_fake_cuda(m)
        graphs = DrafterCudaGraphs(m, 6, "cuda", torch.bfloat16, num_drafts=6, with_confidence=conf)
    assert graphs.buckets == [1, 2, 4, 6]
    captures = [e for e in log if e[0] == "capture"]
    assert len(captures) == 4 and all(("propose", bs, 6, conf) in log for bs in graphs.buckets)
    assert ops.last_impl("round_attention") == ("cuda" if path == "cuda-kernels" else "torch")
    for bs in graphs.buckets:
        out = graphs.outs[bs]
        toks = out[0] if conf else out
        assert toks.device.type == "cuda" and tuple(toks.shape) == (bs, 6)
        if conf:
            assert tuple(out[1].shape) == (bs, 6)


@need_shipped
def test_drafter_graph_capture_fails_on_a_planted_sync(monkeypatch):
    """The capture audit is live: a `.item()` in propose passes the warm-ups (eager, real CPU
    tensors) and fails the capture."""
    from sglang_dlite.model import dlite as model_mod
    from sglang_dlite.serving.cuda_graphs import DrafterCudaGraphs

    real = model_mod.DLiteDrafter.greedy_drafts
    calls = []

    def syncing(self, y):
        calls.append(float(y.float().abs().sum().item()))
        return real(self, y)

    monkeypatch.setattr(model_mod.DLiteDrafter, "greedy_drafts", syncing)
    ops.set_ops_mode("torch")
    _fake_cuda_graph_api(monkeypatch, [])
    m = _drafter(dtype=torch.float32)
    with pytest.raises(HostSyncError, match=r"\.item\(\) -- at sglang_dlite/model/dlite\.py"):
        DrafterCudaGraphs(m, 2, "cpu", torch.float32)
    assert len(calls) == 2 * m.config.block_size  # both warm-ups ran it; the capture stopped at the first


@need_shipped
@pytest.mark.parametrize("path", ["torch", "cpp"])
@pytest.mark.parametrize("conf", [False, True], ids=["greedy", "confidence"])
def test_propose_on_cpu_has_no_host_sync(monkeypatch, path, conf):
    """Real tensors, the shipped weights: the same Python code a GPU captures, audited."""
    if path == "cpp" and not HAVE_LIB:
        pytest.skip("C++ ops not built")
    ops.set_ops_mode(path)
    m = _drafter(dtype=torch.float32)
    ctx, valid, anchor = _inputs(m.config, 3)
    eager = m.propose(ctx, valid, anchor, num_drafts=6, return_confidence=conf)
    with no_host_sync():
        audited = m.propose(ctx, valid, anchor, num_drafts=6, return_confidence=conf)
    assert ops.last_impl("round_attention") == path
    assert torch.equal(audited.tokens, eager.tokens)


@need_shipped
def test_drafter_graphs_glue_pads_and_replays(monkeypatch):
    """DrafterCudaGraphs.propose (real CPU tensors, graph API stubbed): inputs land in the static
    buffers, rows past the batch are padded invalid, the smallest fitting bucket replays, and the
    caller gets that bucket's outputs cut to its batch; a batch past the largest bucket -> None."""
    from sglang_dlite.serving.cuda_graphs import DrafterCudaGraphs

    ops.set_ops_mode("torch")
    log = []
    _fake_cuda_graph_api(monkeypatch, log)
    m = _drafter(dtype=torch.float32)
    _spy_propose(monkeypatch, m, log)
    graphs = DrafterCudaGraphs(m, 6, "cpu", torch.float32, num_drafts=5, with_confidence=True)
    proposes = [e for e in log if e[0] == "propose"]
    # largest bucket first (shared pool), two warm-ups outside the graph before each capture
    assert [e[1] for e in proposes] == [6, 6, 6, 4, 4, 4, 2, 2, 2, 1, 1, 1]
    assert all(e[2:] == (5, True) for e in proposes)
    graphs.valid.fill_(True)
    graphs.anchor.fill_(7)
    ctx, valid, anchor = _inputs(m.config, 3)
    toks, conf = graphs.propose(ctx, valid, anchor)
    assert torch.equal(graphs.ctx[:3], ctx) and torch.equal(graphs.valid[:3], valid)
    assert torch.equal(graphs.anchor[:3], anchor)
    assert not graphs.valid[3].any() and int(graphs.anchor[3]) == 0  # the padding row of bucket 4
    assert bool(graphs.valid[4:].all()) and bool((graphs.anchor[4:] == 7).all())  # beyond the bucket: untouched
    assert [g.replays for _, g in sorted(graphs.graphs.items())] == [0, 0, 1, 0]
    assert toks.data_ptr() == graphs.outs[4][0].data_ptr() and tuple(toks.shape) == (3, 5)
    assert tuple(conf.shape) == (3, 5)
    assert graphs.propose(*_inputs(m.config, 7)) is None


# ---------------------------------------------------------------------------- 4. torch.compile
@need_shipped
@pytest.mark.parametrize("path,conf,n", [("torch", False, None), ("torch", True, 4), ("cpp", False, 4),
                                         ("cpp", True, None)])
def test_shipped_config_compiles_fullgraph(monkeypatch, path, conf, n):
    if path == "cpp" and not HAVE_LIB:
        pytest.skip("C++ ops not built")
    ops.set_ops_mode(path)
    m = _drafter(dtype=torch.float32)
    ctx, valid, anchor = _inputs(m.config, 3)

    def round_(ctx, valid, anchor):
        p = m.propose(ctx, valid, anchor, num_drafts=n, return_confidence=conf)
        return (p.tokens, p.confidence) if conf else (p.tokens,)

    torch._dynamo.reset()
    try:
        eager = round_(ctx, valid, anchor)
        assert ops.last_impl("round_attention") == path
        compiled = torch.compile(round_, backend="aot_eager", fullgraph=True)(ctx, valid, anchor)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled[0], eager[0])
    if conf:
        torch.testing.assert_close(compiled[1], eager[1])


# ---------------------------------------------------------------------------- 5. sglang graph glue
@pytest.fixture(scope="module")
def sglang_side():
    import sglang_fixtures as F

    F.activate_cpu_standins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dlite.serving import register

    register()
    return SpeculativeAlgorithm.from_string("DLITE")


HOOK_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"


def _graph_runner(algo, width=8, max_bs=16, draft=False):
    """A DecodeCudaGraphRunner as __init__ leaves it for a plain (no DP / TBO / LoRA / PDMux /
    ragged) DLITE target: only the fields get_spec_info / can_run_graph read."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    r = object.__new__(DecodeCudaGraphRunner)
    r.model_runner = types.SimpleNamespace(spec_algorithm=algo, is_draft_worker=draft)
    r.captured_req_width, r.max_bs = width, max_bs
    r.capture_hidden_mode = CaptureHiddenMode.NULL  # return_hidden_states_mode without the flag
    r.ragged_verify_mode = r.require_mlp_tp_gather = r.require_mlp_sync = r.disable_padding = False
    r.enable_pdmux = r.record_nolora_graph = r.is_encoder_decoder = r.enable_two_batch_overlap = False
    r.attention_graph_variants = None
    return r


def _verify_batch(bs, W):
    """The worker's TARGET_VERIFY input (worker._forward_decode) as ForwardBatch.init_new carries it."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    from sglang_dlite.serving.info import DLiteVerifyInput

    block = torch.randint(0, 100, (bs, W))
    positions = (torch.arange(bs)[:, None] * 10 + torch.arange(W)[None]).reshape(-1)
    spec = DLiteVerifyInput(draft_token=block.reshape(-1), positions=positions, draft_token_num=W,
                            custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL)
    return types.SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec, capture_hidden_mode=spec.capture_hidden_mode,
        batch_size=bs, input_ids=spec.draft_token, replace_embeds=None, encoder_lens=None, lora_ids=None,
        can_run_tbo=False, can_run_decode_cuda_graph=True)


def test_spec_info_hook_is_registered_on_the_graph_runner(sglang_side):
    import pkgutil

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dlite.serving import _get_spec_info_hook

    hooks = HookRegistry._hooks.get(HOOK_TARGET, [])
    assert any(ht == HookType.AROUND and fn is _get_spec_info_hook for ht, fn, _ in hooks)
    owner, attr = HOOK_TARGET.rsplit(".", 1)
    assert pkgutil.resolve_name(owner) is DecodeCudaGraphRunner and callable(getattr(DecodeCudaGraphRunner, attr))


def test_spec_info_hook_captures_dlite_verify_graphs(sglang_side):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, get_required_capture_hidden_mode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    from sglang_dlite.serving import _get_spec_info_hook
    from sglang_dlite.serving.info import DLiteVerifyInput

    # sglang's own method: another test of this process may have registered the plugin, which wraps it
    original = inspect.unwrap(DecodeCudaGraphRunner.get_spec_info)
    runner = _graph_runner(sglang_side, width=8)
    assert original(runner, 4 * 8) is None  # sglang knows no plugin algorithm: why the hook exists
    with no_host_sync():  # capture_prepare runs it right before capturing
        spec = _get_spec_info_hook(original, runner, 4 * 8)
    assert isinstance(spec, DLiteVerifyInput) and spec.is_verify_input()
    assert spec.draft_token_num == spec.num_tokens_per_req == 8 and spec.custom_mask is None
    assert get_required_capture_hidden_mode(runner.capture_hidden_mode, spec) == CaptureHiddenMode.FULL
    draft = _graph_runner(sglang_side, draft=True)  # a draft worker's runner: sglang's own answer
    assert _get_spec_info_hook(original, draft, 8) is None


def test_graph_runner_accepts_a_dlite_verify_batch(sglang_side):
    from sglang.srt.model_executor.forward_batch_info import get_required_capture_hidden_mode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
        ragged_verify_compact_graphs_enabled,
    )

    from sglang_dlite.serving import _get_spec_info_hook

    algo = sglang_side
    assert not ragged_verify_compact_graphs_enabled(algo)  # the uniform-width path below is the one used
    assert algo.get_num_tokens_per_req_for_target_verify(8, False) == 8  # captured_req_width = W
    runner = _graph_runner(algo, width=8, max_bs=16)
    # sglang's own method: another test of this process may have registered the plugin, which wraps it
    original = inspect.unwrap(DecodeCudaGraphRunner.get_spec_info)
    hooked = runner.capture_hidden_mode
    runner.capture_hidden_mode = get_required_capture_hidden_mode(hooked, _get_spec_info_hook(original, runner, 8))
    for bs in (1, 5, 16):
        fb = _verify_batch(bs, 8)
        assert DecodeCudaGraphRunner.can_run_graph(runner, fb), bs
        runner._validate_capture_hidden_mode(fb)  # load_batch's check: the graph outputs the hidden states
    assert not DecodeCudaGraphRunner.can_run_graph(runner, _verify_batch(17, 8))  # past the largest graph
    assert not DecodeCudaGraphRunner.can_run_graph(runner, _verify_batch(4, 5))  # a narrower verify: eager
    unhooked = _graph_runner(algo, width=8)
    unhooked.capture_hidden_mode = get_required_capture_hidden_mode(unhooked.capture_hidden_mode,
                                                                    original(unhooked, 8))
    with pytest.raises(RuntimeError, match="hidden-state mode"):
        unhooked._validate_capture_hidden_mode(_verify_batch(2, 8))


# ---------------------------------------------------------------------------- 6. attention backends
def _server_args(**kw):
    a = dict(tp_size=1, dp_size=1, pp_size=1, disaggregation_mode="null", attn_dp_size=1, attn_cp_size=1,
             enable_dp_attention=False, attention_backend=None, prefill_attention_backend=None,
             decode_attention_backend=None, speculative_attention_mode="prefill")
    a.update(kw)
    return types.SimpleNamespace(**a)


def test_verified_attention_backends_pass():
    from sglang_dlite.serving.algorithm import VERIFY_ATTENTION_BACKENDS, check_deployment

    assert set(VERIFY_ATTENTION_BACKENDS) == {"flashinfer", "fa3", "triton", "torch_native"}
    for name in VERIFY_ATTENTION_BACKENDS:
        check_deployment(_server_args(attention_backend=name))
    check_deployment(_server_args())  # unset at launch: sglang picks later, the worker checks that one


@pytest.mark.parametrize("name", ["intel_amx", "trtllm_mha", "fa4", "flex_attention", "aiter", "flashmla"])
def test_unverified_attention_backend_refused_at_launch(name):
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving.algorithm import VERIFY_ATTENTION_BACKENDS, check_deployment

    with pytest.raises(DLiteConfigError) as ei:
        check_deployment(_server_args(attention_backend=name))
    msg = str(ei.value)
    assert f"--attention-backend {name}" in msg and "--attention-backend NAME" in msg
    assert all(v in msg for v in VERIFY_ATTENTION_BACKENDS)


def test_verify_backend_follows_speculative_attention_mode():
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving.algorithm import check_deployment

    split = dict(prefill_attention_backend="triton", decode_attention_backend="trtllm_mha")
    check_deployment(_server_args(**split))  # TARGET_VERIFY runs on the prefill backend by default
    with pytest.raises(DLiteConfigError, match="--decode-attention-backend trtllm_mha"):
        check_deployment(_server_args(speculative_attention_mode="decode", **split))
    with pytest.raises(DLiteConfigError, match="--prefill-attention-backend intel_amx"):
        check_deployment(_server_args(attention_backend="flashinfer", prefill_attention_backend="intel_amx"))


def test_scheduler_check_sees_sglangs_resolved_backend(monkeypatch, sglang_side):
    """In a scheduler process the flags may be unset (auto): the worker's check reads the backend
    sglang resolved (e.g. intel_amx, its CPU default; trtllm_mha, its Blackwell default)."""
    import sglang.srt.runtime_context as rc

    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving.algorithm import check_deployment

    monkeypatch.setattr(rc, "attention_backends", lambda: ("fa3", "fa3"))
    check_deployment(_server_args())
    monkeypatch.setattr(rc, "attention_backends", lambda: ("intel_amx", "intel_amx"))
    with pytest.raises(DLiteConfigError, match="'intel_amx' attention backend .sglang's resolved choice"):
        check_deployment(_server_args())


@need_shipped
def test_launch_validation_refuses_unverified_backend():
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving.algorithm import validate_server_args

    args = _server_args(model_path=None, speculative_draft_model_path=SHIPPED, speculative_num_draft_tokens=None,
                        speculative_num_steps=None, speculative_eagle_topk=None)
    validate_server_args(args)
    args.attention_backend = "intel_amx"
    with pytest.raises(DLiteConfigError, match="intel_amx"):
        validate_server_args(args)


def test_verified_gpu_backends_run_dflash_verify_without_a_custom_mask(sglang_side):
    """The GPU backends named as verified are registered sglang backends on which sglang's DFLASH
    runs this same verify input (DLiteVerifyInput is its DFlashVerifyInput) with custom_mask=None;
    the CPU one is the backend the project's TARGET_VERIFY hook patches."""
    import dlite_cpu_verify_hook
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.dflash_utils import _DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS as NO_MASK

    from sglang_dlite.serving.info import DLiteVerifyInput
    from sglang_dlite.serving.algorithm import VERIFY_ATTENTION_BACKENDS

    assert issubclass(DLiteVerifyInput, DFlashVerifyInput)
    classes = {"flashinfer": "FlashInferAttnBackend", "fa3": "FlashAttentionBackend", "triton": "TritonAttnBackend"}
    gpu = {n for n, where in VERIFY_ATTENTION_BACKENDS.items() if where == "GPU"}
    assert gpu == set(classes)
    for name in gpu:
        assert name in ATTENTION_BACKENDS and classes[name] in NO_MASK, name
    assert "torch_native" in ATTENTION_BACKENDS
    assert dlite_cpu_verify_hook.TARGET_MODULE.endswith(".torch_native_backend")
