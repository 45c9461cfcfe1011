"""The DLite drafter: history-freedom, config and checkpoint validation, save/load."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import tiny_dlite_config
from sglang_dlite.model.config import DLiteConfig, proportional_layer_ids
from dlite_lab.reference.drafters import DLiteEngineDrafter, DraftRequest
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.model.dlite import DLiteDrafter
from dlite_lab.ablations import AblationDrafter


def _drafter(target, **kw):
    """The served drafter, or the lab's ``AblationDrafter`` for an ablation's config."""
    torch.manual_seed(0)
    ablation = kw.get("history", "none") != "none" or kw.get("head_input") == "hidden"
    m = (AblationDrafter if ablation else DLiteDrafter)(tiny_dlite_config(target, **kw)).bind_hf_target(target)
    with torch.no_grad():  # a non-trivial head, so the test covers it
        m.head.out_proj.weight.normal_(0, 0.5)
    return m


def _forward(m, ctx, valid, anchor, history=None, round_offset=None):
    """The training forward (logits [B, K, V]): history rows only for the lab's ablations, and the
    token-fed head fed fixed tokens (teacher forcing, the same in every call)."""
    kw = {} if history is None else {"history": history, "round_offset": round_offset}
    if m.config.head_input == "token":
        kw["feedback_tokens"] = (torch.arange(m.config.block_size) * 7 % m.config.vocab_size).expand(anchor.shape[0], -1)
    return m(ctx, valid, anchor, **kw)


def _logits_after_history(model, hist_len, local):
    """Same local window (last C positions) + anchor after a history of hist_len positions."""
    L, C, H = local.shape
    g = torch.Generator().manual_seed(hist_len)
    history = torch.randn(L, hist_len, H, generator=g)
    hidden = torch.cat([history, local], dim=1)
    req = DraftRequest(tokens=[5] * (hist_len + C + 1), hidden=hidden, hidden_start=0)
    ctx, valid, hist, offset = DLiteEngineDrafter(model).context_inputs(req)
    with torch.no_grad():
        return _forward(model, ctx, valid, torch.tensor([7]), hist, offset)


def test_dlite_is_history_free(tiny_target):
    m = _drafter(tiny_target)
    local = torch.randn(2, 3, tiny_target.config.hidden_size)
    base = _logits_after_history(m, 0, local)
    for n in (1, 50, 400):
        torch.testing.assert_close(_logits_after_history(m, n, local), base, rtol=0, atol=0)


@pytest.mark.parametrize("history", ["full", "window:16"])
def test_history_variants_see_the_history(tiny_target, history):
    m = _drafter(tiny_target, history=history)
    local = torch.randn(2, 3, tiny_target.config.hidden_size)
    a = _logits_after_history(m, 20, local)
    b = _logits_after_history(m, 40, local)
    assert (a - b).abs().max() > 1e-3


def test_window_variant_ignores_history_beyond_its_window(tiny_target):
    m = _drafter(tiny_target, history="window:8")
    H = tiny_target.config.hidden_size
    local, recent = torch.randn(2, 3, H), torch.randn(2, 8, H)

    def run(old_len):
        old = torch.randn(2, old_len, H, generator=torch.Generator().manual_seed(old_len))
        hidden = torch.cat([old, recent, local], dim=1)
        req = DraftRequest(tokens=[5] * (hidden.shape[1] + 1), hidden=hidden, hidden_start=100 - old_len)
        ctx, valid, hist, offset = DLiteEngineDrafter(m).context_inputs(req)
        with torch.no_grad():
            return _forward(m, ctx, valid, torch.tensor([7]), hist, offset)

    torch.testing.assert_close(run(5), run(30), rtol=1e-5, atol=1e-5)


def test_invalid_context_slots_are_ignored(tiny_target):
    m = _drafter(tiny_target)
    ctx = torch.randn(1, 2, 3, tiny_target.config.hidden_size)
    valid = torch.tensor([[False, True, True]])
    other = ctx.clone()
    other[:, :, 0] = 123.0  # garbage in an invalid slot
    with torch.no_grad():
        torch.testing.assert_close(_forward(m, ctx, valid, torch.tensor([4])), _forward(m, other, valid, torch.tensor([4])))


def test_batched_forward_equals_per_request(tiny_target):
    m = _drafter(tiny_target, block_attention="causal")
    B = 5
    ctx = torch.randn(B, 2, 3, tiny_target.config.hidden_size)
    valid = torch.rand(B, 3) > 0.3
    anchors = torch.randint(0, tiny_target.config.vocab_size, (B,))
    with torch.no_grad():
        full = _forward(m, ctx, valid, anchors)
        for b in range(B):
            torch.testing.assert_close(_forward(m, ctx[b:b + 1], valid[b:b + 1], anchors[b:b + 1]), full[b:b + 1],
                                       rtol=1e-5, atol=1e-5)


def test_save_and_load_round_trip(tiny_target, tmp_path):
    m = _drafter(tiny_target)
    m.save_pretrained(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    m2 = DLiteDrafter.from_pretrained(str(tmp_path)).bind_hf_target(tiny_target)
    ctx = torch.randn(2, 2, 3, tiny_target.config.hidden_size)
    valid = torch.ones(2, 3, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(_forward(m, ctx, valid, torch.tensor([3, 4])), _forward(m2, ctx, valid, torch.tensor([3, 4])))
    # The target's embedding / LM head are not stored in the drafter checkpoint.
    from safetensors.torch import load_file
    assert not any("embed_weight" in k or "lm_head" in k for k in load_file(str(tmp_path / "model.safetensors")))


@pytest.mark.parametrize("kw, msg", [
    ({"block_size": 0}, "K=0 is out of range"),
    ({"block_size": 17}, "K=17 is out of range"),
    ({"target_layer_ids": [3, 30]}, "layer id 30 is out of range"),
    ({"target_layer_ids": [4, 4]}, "duplicates"),
    ({"target_layer_ids": []}, "empty"),
    ({"history": "window:0"}, "window:W"),
    ({"history": "sometimes"}, "not understood"),
    ({"block_attention": "diagonal"}, "block_attention"),
    ({"num_heads": 9, "num_kv_heads": 2}, "multiple of num_kv_heads"),
    ({"num_context_positions": 1000}, "num_context_positions"),
])
def test_config_errors(kw, msg):
    with pytest.raises(DLiteConfigError, match=msg):
        DLiteConfig(**kw)


def test_proportional_layer_ids_are_proportional():
    assert proportional_layer_ids(36) == [12, 14]
    assert proportional_layer_ids(30) == [10, 12]


def test_default_config_is_the_shipped_design():
    """``DLiteConfig()`` builds the shipped drafter's design: every field of its config.json but the
    drafting vocabulary (a property of its training data) and transformers' bookkeeping."""
    import json

    from sglang_dlite.model.dlite import SHIPPED_DRAFTER_DIR

    with open(f"{SHIPPED_DRAFTER_DIR}/config.json") as f:
        shipped = json.load(f)
    got = DLiteConfig().to_dict()
    skip = {"draft_vocab_size", "transformers_version", "target_model_type"}  # the data's, the library's, the target's
    diff = {k: (got.get(k), v) for k, v in shipped.items() if k not in skip and got.get(k) != v}
    assert not diff, diff
    assert DLiteConfig(target_num_layers=30).target_layer_ids == [2, 15, 27]


def test_drafter_for_another_target_is_refused(tiny_target):
    c = tiny_target.config
    for kw, msg in (
        ({"target_hidden_size": 128, "head_dim": 32}, "hidden size: drafter expects 128, target has 64"),
        ({"vocab_size": 1000}, "vocabulary: drafter expects 1000 tokens"),
        ({"target_num_layers": 40, "target_layer_ids": [20, 30]}, "out of range for a target with 6 layers"),
    ):
        cfg = tiny_dlite_config(tiny_target, **kw)
        with pytest.raises(DLiteConfigError, match=msg):
            DLiteDrafter(cfg).bind_hf_target(tiny_target)
    assert c.num_hidden_layers == 6


def test_unbound_drafter_and_bad_shapes(tiny_target):
    m = DLiteDrafter(tiny_dlite_config(tiny_target))
    ctx = torch.randn(1, 2, 3, 64)
    with pytest.raises(DLiteConfigError, match="bind_target"):
        m(ctx, torch.ones(1, 3, dtype=torch.bool), torch.tensor([1]))
    m.bind_hf_target(tiny_target)
    with pytest.raises(DLiteInputError, match="context_hidden must be"):
        m(torch.randn(1, 2, 4, 64), torch.ones(1, 3, dtype=torch.bool), torch.tensor([1]))
    with pytest.raises(DLiteInputError, match="context_valid must be a bool"):
        m(ctx, torch.ones(1, 3), torch.tensor([1]))


def test_checkpoint_errors(tiny_target, tmp_path):
    with pytest.raises(DLiteConfigError, match="no DLite checkpoint folder"):
        DLiteDrafter.from_pretrained(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DLiteConfigError, match="needs config.json"):
        DLiteDrafter.from_pretrained(str(tmp_path / "empty"))
    good = tmp_path / "good"
    _drafter(tiny_target).save_pretrained(str(good))
    # A checkpoint of another model type.
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (other / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    with pytest.raises(DLiteConfigError, match="not a DLite drafter"):
        DLiteDrafter.from_pretrained(str(other))
    # Corrupt weights.
    (good / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DLiteConfigError, match="not a readable safetensors"):
        DLiteDrafter.from_pretrained(str(good))
    # Weights that do not fit the config.
    small = tmp_path / "small"
    _drafter(tiny_target).save_pretrained(str(small))
    cfg = json.loads((small / "config.json").read_text())
    cfg["num_layers"] = 3
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DLiteConfigError, match="does not fit"):
        DLiteDrafter.from_pretrained(str(small))


@pytest.mark.parametrize("head_input", ["hidden", "token"])
def test_propose_a_prefix_of_the_chain(tiny_target, head_input):
    """propose(num_drafts=n) stops the causal head and the projection after n positions: the
    tokens equal the first n of the full chain (greedy), and n outside [1, K] is refused."""
    m = _drafter(tiny_target, head_input=head_input, block_size=6)
    g = torch.Generator().manual_seed(3)
    cfg = m.config
    ctx = torch.randn(5, cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size, generator=g) * 3
    valid = torch.ones(5, cfg.num_context_positions, dtype=torch.bool)
    anchor = torch.randint(0, cfg.vocab_size, (5,), generator=g)
    full = m.propose(ctx, valid, anchor).tokens
    assert full.shape == (5, 6) and len(set(full.flatten().tolist())) > 1
    for n in (1, 2, 5, 6):
        assert torch.equal(m.propose(ctx, valid, anchor, num_drafts=n).tokens, full[:, :n])
    with pytest.raises(DLiteInputError, match=r"num_drafts=0 must be in \[1, K=6\]"):
        m.propose(ctx, valid, anchor, num_drafts=0)
    with pytest.raises(DLiteInputError, match=r"num_drafts=7"):
        m.propose(ctx, valid, anchor, num_drafts=7)


# ---------------------------------------------------------------------- drafting vocabulary
def _round_inputs(m, B=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    cfg = m.config
    ctx = torch.randn(B, cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size, generator=g) * 3
    valid = torch.ones(B, cfg.num_context_positions, dtype=torch.bool)
    anchor = torch.randint(0, cfg.vocab_size, (B,), generator=g)
    return ctx, valid, anchor


@pytest.mark.parametrize("head_input", ["hidden", "token"])
def test_draft_vocab_greedy_is_the_argmax_over_the_subset(tiny_target, head_input):
    """A drafter with a drafting vocabulary drafts the argmax of the full logits restricted to
    those ids (hidden head: all positions at once; token head: step by step, so compare the first
    position), and a vocabulary of every id drafts exactly what no vocabulary drafts."""
    m = _drafter(tiny_target, head_input=head_input)
    ctx, valid, anchor = _round_inputs(m)
    V = m.config.vocab_size
    full = m.propose(ctx, valid, anchor).tokens
    m.set_draft_vocab(torch.arange(V))
    assert torch.equal(m.propose(ctx, valid, anchor).tokens, full)
    # drop each request's first drafted token from the vocabulary
    banned = set(full[:, 0].tolist())
    ids = torch.tensor([i for i in range(V) if i not in banned])
    m.set_draft_vocab(ids)
    assert m.config.draft_vocab_size == len(ids) and m.draft_head_weight.shape == (len(ids), m.config.target_hidden_size)
    got = m.propose(ctx, valid, anchor).tokens
    assert set(got.flatten().tolist()) <= set(ids.tolist())
    if head_input == "hidden":
        with torch.no_grad():
            logits = m(ctx, valid, anchor)  # full-vocabulary scoring forward (training / eval)
        want = ids[logits[..., ids].argmax(-1)]
        assert torch.equal(got, want)
    else:
        with torch.no_grad():
            logits = m(ctx, valid, anchor, feedback_tokens=got)
        assert torch.equal(got[:, 0], ids[logits[:, 0, ids].argmax(-1)])
    m.set_draft_vocab(None)
    assert m.config.draft_vocab_size == 0 and torch.equal(m.propose(ctx, valid, anchor).tokens, full)


@pytest.mark.parametrize("head_input", ["hidden", "token"])
def test_greedy_chain_is_the_teacher_forced_argmax(tiny_target, head_input):
    """Greedy drafting (the fused norm + projection + argmax path) drafts, at every position, the
    argmax of the scoring forward fed its own drafts; asking for the confidences drafts the same
    chain, and each confidence is that argmax's softmax probability."""
    m = _drafter(tiny_target, head_input=head_input, block_size=5)
    ctx, valid, anchor = _round_inputs(m, seed=7)
    got = m.propose(ctx, valid, anchor).tokens
    with torch.no_grad():
        logits = m(ctx, valid, anchor, feedback_tokens=got if head_input == "token" else None).float()
    assert torch.equal(got, logits.argmax(-1))
    conf = m.propose(ctx, valid, anchor, return_confidence=True)
    assert torch.equal(conf.tokens, got)
    torch.testing.assert_close(conf.confidence, logits.softmax(-1).amax(-1), rtol=1e-4, atol=1e-5)


def test_draft_vocab_sampling_keeps_full_vocabulary_probs(tiny_target):
    m = _drafter(tiny_target)
    ids = torch.arange(0, m.config.vocab_size, 3)
    m.set_draft_vocab(ids)
    ctx, valid, anchor = _round_inputs(m)
    prop = m.propose(ctx, valid, anchor, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert prop.probs.shape[-1] == m.config.vocab_size
    assert set(prop.tokens.flatten().tolist()) <= set(ids.tolist())
    outside = torch.ones(m.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert prop.probs[..., outside].abs().max() == 0
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(prop.probs.shape[:2]))
    # the sampled token's probability is positive under the returned distribution
    assert (prop.probs.gather(-1, prop.tokens[..., None]) > 0).all()


def test_draft_vocab_survives_a_bf16_checkpoint(tiny_target, tmp_path):
    """Token ids are saved as integers even when the weights are exported in bf16 (bf16 cannot
    hold ids above 256 exactly), and the LM-head rows are gathered again at bind time."""
    m = _drafter(tiny_target)
    V = m.config.vocab_size
    ids = torch.tensor(sorted({0, 1, 5, V // 2, V - 1}))
    m.set_draft_vocab(ids)
    m.save_pretrained(str(tmp_path / "d"), dtype=torch.bfloat16)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_size"] == len(ids)
    back = DLiteDrafter.from_pretrained(str(tmp_path / "d"))
    assert torch.equal(back.draft_vocab, ids) and back.draft_vocab.dtype == torch.int64
    back.bind_hf_target(tiny_target)
    torch.testing.assert_close(back.draft_head_weight, tiny_target.lm_head.weight[ids])


def test_draft_vocab_errors(tiny_target):
    m = _drafter(tiny_target)
    V = m.config.vocab_size
    with pytest.raises(DLiteConfigError, match="sorted ascending without duplicates"):
        m.set_draft_vocab(torch.tensor([3, 1, 2]))
    with pytest.raises(DLiteConfigError, match=r"outside \[0, %d\)" % V):
        m.set_draft_vocab(torch.tensor([0, V]))
    with pytest.raises(DLiteConfigError, match="draft_vocab_size=99999 must be in"):
        DLiteConfig(vocab_size=V, target_hidden_size=64, target_num_layers=6, draft_vocab_size=99999)


def test_draft_vocab_cli_counts_the_data(tiny_target, tmp_path):
    """`sglang-dlite draft-vocab` picks the data's most frequent ids (ties: lower id first),
    reports their coverage, keeps the checkpoint's bf16 weights and model card; size 0 removes it."""
    import numpy as np

    from sglang_dlite.cli import main

    m = _drafter(tiny_target)
    m.save_pretrained(str(tmp_path / "d"), dtype=torch.bfloat16)
    (tmp_path / "d" / "README.md").write_text("card\n")
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "a_00000.npz", ids=np.array([7, 7, 7, 3, 3, 9, 1], dtype=np.int32),
             mask=np.zeros(7, dtype=np.int8), offsets=np.array([0, 7]))
    assert main(["draft-vocab", "--drafter", str(tmp_path / "d"), "--data", str(data), "--size", "3",
                 "--out", str(tmp_path / "o")]) == 0
    back = DLiteDrafter.from_pretrained(str(tmp_path / "o"))
    assert back.draft_vocab.tolist() == [1, 3, 7]  # 7 x3, 3 x2, then 1 and 9 once each: 1 first
    assert (tmp_path / "o" / "README.md").read_text().startswith("card")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "o" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("mask_embed").get_dtype() == "BF16"
    assert main(["draft-vocab", "--drafter", str(tmp_path / "o"), "--data", str(data), "--size", "0"]) == 0
    assert DLiteDrafter.from_pretrained(str(tmp_path / "o")).config.draft_vocab_size == 0
    assert main(["draft-vocab", "--drafter", str(tmp_path / "d"), "--data", str(tmp_path), "--size", "3"]) == 2


@pytest.mark.parametrize("head_input", ["hidden", "token"])
def test_training_vocab_subset_logits_are_the_full_logits_columns(tiny_target, head_input):
    """The training-time vocabulary subset (``forward(..., vocab=ids)``, what ``--vocab-subset``
    trains on) gives exactly the full logits' columns ``ids``, for both heads (regression: the
    token-feedback head ignored the subset, so its logits and the subset labels disagreed)."""
    from dlite_lab.training.evaluation import model_forward

    m = _drafter(tiny_target, head_input=head_input)
    ctx, valid, anchor = _round_inputs(m)
    K, V = m.config.block_size, m.config.vocab_size
    fb = torch.randint(0, V, (anchor.shape[0], K)) if head_input == "token" else None
    ids = torch.tensor(sorted(torch.randperm(V)[: V // 3].tolist()))
    with torch.no_grad():
        full = m(ctx, valid, anchor, feedback_tokens=fb)
        sub = m(ctx, valid, anchor, feedback_tokens=fb, vocab=ids)
    assert sub.shape == (*full.shape[:-1], len(ids))
    torch.testing.assert_close(sub, full[..., ids])
    b = {"context_hidden": ctx, "context_valid": valid, "anchor_ids": anchor, "round_offset": None,
         "labels": fb if fb is not None else torch.zeros(anchor.shape[0], K, dtype=torch.long)}
    with torch.no_grad():
        torch.testing.assert_close(model_forward(m, b, ids), full[..., ids])


@pytest.mark.parametrize("head_input", ["hidden", "token"])
def test_float32_drafter_on_a_bf16_target_drafts_as_on_its_fp32_copy(tiny_target, head_input):
    """sglang's CPU path runs a float32 drafter beside a bf16 target: bound to the bf16 embedding and
    LM head, it drafts exactly what it drafts bound to their float32 copies (bf16 -> fp32 is exact),
    greedy and with confidences; the projection's cast copy is made once and remade when the bound
    weight changes in place."""
    m = _drafter(tiny_target, head_input=head_input)
    V = m.config.vocab_size
    emb = tiny_target.get_input_embeddings().weight.detach().to(torch.bfloat16)
    head = tiny_target.get_output_embeddings().weight.detach().to(torch.bfloat16).clone()
    ctx, valid, anchor = _round_inputs(m)
    for vocab in (None, torch.arange(0, V, 2)):
        m.set_draft_vocab(vocab)
        m.bind_target(emb.float(), head.float())
        want = m.propose(ctx, valid, anchor, return_confidence=True)
        m.bind_target(emb, head)
        assert m._draft_head().dtype == torch.float32 and m._draft_head() is m._draft_head()
        assert torch.equal(m.propose(ctx, valid, anchor).tokens, want.tokens)
        got = m.propose(ctx, valid, anchor, return_confidence=True)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.confidence, want.confidence)
    m.set_draft_vocab(None)
    before = m._draft_head().clone()
    with torch.no_grad():
        head.mul_(-1)  # an in-place weight update (sglang's update_weights_from_disk)
    assert torch.equal(m._draft_head(), -before)


def test_drafter_dtype_follows_the_device_and_the_setting(monkeypatch):
    from sglang_dlite import ops
    from sglang_dlite.settings import ENV_CONFIG, drafter_dtype

    monkeypatch.delenv(ENV_CONFIG, raising=False)
    monkeypatch.setattr(ops, "cpu_has_native_bf16", lambda: False)
    assert drafter_dtype(torch.bfloat16, "cpu") == torch.float32
    assert drafter_dtype(torch.float32, "cpu") == torch.float32
    assert drafter_dtype(torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16
    monkeypatch.setattr(ops, "cpu_has_native_bf16", lambda: True)  # avx512_bf16 / AMX: the target's dtype
    assert drafter_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    monkeypatch.setenv(ENV_CONFIG, '{"drafter_dtype": "target"}')
    assert drafter_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    monkeypatch.setenv(ENV_CONFIG, '{"drafter_dtype": "float16"}')
    assert drafter_dtype(torch.bfloat16, "cuda:0") == torch.float16
    monkeypatch.setenv(ENV_CONFIG, '{"drafter_dtype": "fp8"}')
    with pytest.raises(DLiteConfigError, match="drafter_dtype='fp8'.*float32"):
        drafter_dtype(torch.bfloat16, "cpu")


def test_cpu_flags_reads_the_first_processor(tmp_path):
    from sglang_dlite.ops.cpu_linear import cpu_flags

    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\nbogomips\t: 1\n\n"
                 "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(f)) == {"fpu", "avx512f", "avx512_bf16", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
