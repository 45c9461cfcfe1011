"""Baseline drafters (EAGLE-3, DFlash, DSpark, n-gram): lossless in the reference engine, their own
KV cache exact when extended incrementally and cropped on rollback / new turns, training_forward
consistent with what the engine drafts, checkpoints, the registry, memory per request."""

from __future__ import annotations

import json
import os
import math
import random

import pytest
import torch

from conftest import tiny_dlite_config
from dlite_lab.baselines.common import anchor_targets
from dlite_lab.baselines.ngram import NGramDrafter, lookup
from dlite_lab.baselines.registry import (
    DLITE_ABLATIONS, DRAFTER_NAMES, engine_adapter, make_baseline_drafter, new_model,
)
from dlite_lab.reference.drafters import DLiteEngineDrafter, DraftRequest
from dlite_lab.registry import make_engine_drafter
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.model.dlite import DLiteDrafter
from dlite_lab.ablations import build_drafter
from sglang_dlite.model.proposal import DraftProposal

EOS = 2
KV_NAMES = ["eagle3", "dflash", "dspark"]
TINY = dict(num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, block_size=4)


def tiny_baseline(name, target, seed=0):
    m = new_model(name, target.config, seed=seed, **TINY)
    if name == "dspark":  # the Markov head starts at zero: give it weight so the tests see it
        torch.nn.init.normal_(m.markov_out.weight, std=0.5)
    return m.bind_hf_target(target).eval()


def greedy_ref(target, prompt, n):
    eng = ReferenceEngine(target, None, [EOS])
    return eng.generate(prompt, n).output_ids


class Checked:
    """Wraps a KV baseline adapter: every round, also drafts from scratch (empty state) and checks
    the incremental cache gives the same logits; then replaces the first j drafts (random j) by the
    target's own continuation so rounds accept 0..K tokens and the cache sees every increment."""

    def __init__(self, inner, truth: dict, rng: random.Random):
        self.inner, self.truth, self.rng = inner, truth, rng
        self.num_drafts = inner.num_drafts
        self.capture_layer_ids = inner.capture_layer_ids
        self.hidden_rows_needed = inner.hidden_rows_needed
        self.checks = 0

    def draft(self, req: DraftRequest) -> DraftProposal:
        prop = self.inner.draft(req)
        inc = self.inner.last_logits.clone()
        fresh = DraftRequest(list(req.tokens), req.hidden, req.hidden_start, state={})
        self.inner.draft(fresh)
        torch.testing.assert_close(inc, self.inner.last_logits, atol=1e-4, rtol=1e-4)
        self.checks += 1
        toks = prop.tokens.clone()
        for seq, cont in self.truth.items():
            n = len(req.tokens)
            if tuple(req.tokens[:len(seq)]) == seq and n >= len(seq):
                done = n - len(seq)
                nxt = cont[done:done + self.num_drafts]
                j = min(self.rng.randrange(self.num_drafts + 1), len(nxt))
                toks[0, :j] = torch.tensor(nxt[:j], dtype=toks.dtype)
        return DraftProposal(toks, None)


@pytest.mark.parametrize("name", KV_NAMES)
def test_kv_baseline_lossless_incremental_cache_multi_turn(tiny_target, name):
    rng = random.Random(1)
    V = tiny_target.config.vocab_size
    p1 = [1] + [rng.randrange(3, V) for _ in range(30)]
    ref1 = greedy_ref(tiny_target, p1, 24)
    drafter = Checked(engine_adapter(name, tiny_baseline(name, tiny_target)), {tuple(p1): ref1}, rng)
    eng = ReferenceEngine(tiny_target, drafter, [EOS])
    sess = eng.new_session()
    out1 = eng.generate(p1, 24, session=sess)
    assert out1.output_ids == ref1
    assert max(r.accepted for r in out1.rounds) >= 2  # multi-token rounds happened
    # turn 2 extends the conversation (prefix reuse: the drafter's cache is extended)
    p2 = p1 + out1.output_ids + [rng.randrange(3, V) for _ in range(8)]
    ref2 = greedy_ref(tiny_target, p2, 20)
    drafter.truth = {tuple(p2): ref2}
    assert eng.generate(p2, 20, session=sess).output_ids == ref2
    # turn 3 edits an early token: the drafter must crop its cache back to the divergence
    p3 = list(p2)
    p3[10] = (p3[10] + 1) % V or 3
    ref3 = greedy_ref(tiny_target, p3, 16)
    drafter.truth = {tuple(p3): ref3}
    assert eng.generate(p3, 16, session=sess).output_ids == ref3
    assert drafter.checks > 10
    eng.close()


@pytest.mark.parametrize("name", KV_NAMES + ["ngram"])
def test_baseline_lossless_plain_and_sampling_runs(tiny_target, name):
    drafter = NGramDrafter(num_drafts=4) if name == "ngram" else engine_adapter(name, tiny_baseline(name, tiny_target))
    eng = ReferenceEngine(tiny_target, drafter, [EOS])
    rng = random.Random(2)
    for _ in range(3):
        p = [1] + [rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))]
        assert eng.generate(p, 16).output_ids == greedy_ref(tiny_target, p, 16)
    res = eng.generate(p, 12, temperature=0.8, top_p=0.9, seed=0)  # sampling path: probs shapes
    assert 1 <= len(res.output_ids) <= 12
    eng.close()


@pytest.mark.parametrize("name", KV_NAMES)
def test_training_forward_matches_engine_draft(tiny_target, name):
    """training_forward on [committed tokens + the engine's own greedy drafts] gives the logits the
    engine drafted with (EAGLE-3: every unrolled step; DSpark: with the Markov bias)."""
    m = tiny_baseline(name, tiny_target)
    ad = engine_adapter(name, m)
    K = m.config.block_size
    rng = random.Random(3)
    ids = [1] + [rng.randrange(3, 96) for _ in range(20)]
    anchors = [5, 12, 20]
    seqs, logits_inf = [], []
    for a in anchors:
        toks = ids[:a + 1]
        with torch.no_grad():
            hs = tiny_target(torch.tensor([toks]), output_hidden_states=True).hidden_states
        hidden = torch.stack([hs[i + 1][0] for i in m.config.target_layer_ids])[:, :a]
        prop = ad.draft(DraftRequest(toks, hidden, 0, state={}))
        logits_inf.append(ad.last_logits)
        seqs.append(toks + prop.tokens[0].tolist())
    for a, seq, li in zip(anchors, seqs, logits_inf):
        with torch.no_grad():
            hs = tiny_target(torch.tensor([seq]), output_hidden_states=True).hidden_states
            hidden = torch.stack([hs[i + 1] for i in m.config.target_layer_ids], dim=1)
            out = m.training_forward(hidden, torch.tensor([seq]), torch.tensor([[1, a, 3]]))
        assert out.shape == (1, 3, K, 96)
        torch.testing.assert_close(out[0, 1], li, atol=1e-4, rtol=1e-4)
    tgt, valid = anchor_targets(torch.tensor([seqs[0]]), torch.tensor([[anchors[0]]]), K)
    assert tgt[0, 0].tolist() == seqs[0][anchors[0] + 1:anchors[0] + 1 + K] and valid.all()
    # gradients flow to the drafter, not to the bound target weights
    m.train()
    hidden.requires_grad_(False)
    loss = m.training_forward(hidden, torch.tensor([seqs[-1]]), torch.tensor([[2, 4]])).logsumexp(-1).mean()
    loss.backward()
    assert m.fc.weight.grad is not None and m.embed_weight.grad is None


@pytest.mark.parametrize("name", KV_NAMES)
def test_save_load_round_trip(tiny_target, name, tmp_path):
    m = tiny_baseline(name, tiny_target)
    m.save_pretrained(str(tmp_path / name))
    files = sorted(p.name for p in (tmp_path / name).iterdir())
    assert files == ["config.json", "model.safetensors"]
    d = make_baseline_drafter(name, str(tmp_path / name), tiny_target)
    assert d.model.config.target_layer_ids == m.config.target_layer_ids
    for k, v in m.state_dict().items():
        torch.testing.assert_close(d.model.state_dict()[k], v)
    assert "embed_weight" not in m.state_dict()  # the target's, bound, not stored
    other = "dflash" if name != "dflash" else "eagle3"
    with pytest.raises(DLiteConfigError, match="not a"):
        make_baseline_drafter(other, str(tmp_path / name), tiny_target)


def test_ngram_proposes_the_continuation():
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 5, 6, 7]
    assert lookup(toks, 4) == [8, 9, 10, 11]
    assert lookup([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # runs into its own proposals
    assert lookup([1, 9, 3, 4, 9], 3) == [3, 4, 9]  # falls back to a 1-gram
    assert lookup([1, 2, 3, 4], 3) is None
    d = NGramDrafter(num_drafts=3)
    assert d.draft(DraftRequest([1, 2, 3, 4], torch.zeros(1, 1, 4), 2)).tokens.tolist() == [[4, 4, 4]]
    assert d.draft(DraftRequest(toks, torch.zeros(1, 1, 4), 11)).tokens.tolist() == [[8, 9, 10]]


def test_ngram_accepts_repeats_in_engine(tiny_target):
    # the target's greedy output of this prompt loops, which prompt lookup continues
    p = [1, 5, 6, 7, 8, 9]
    eng = ReferenceEngine(tiny_target, NGramDrafter(num_drafts=4), [EOS])
    res = eng.generate(p, 24)
    assert res.output_ids == greedy_ref(tiny_target, p, 24)
    assert res.tau > 2.0


def test_registry_names_and_errors(tiny_target, tmp_path, monkeypatch):
    import dlite_lab.baselines.registry as registry

    monkeypatch.setenv("SGLANG_DLITE_BASELINES", str(tmp_path))
    monkeypatch.setattr(registry, "SHIPPED_BASELINES", {})  # the missing-checkpoint path
    for name in ("eagle3", "dflash", "dspark", *DLITE_ABLATIONS):
        with pytest.raises(DLiteConfigError, match="make train-baselines"):
            make_engine_drafter(name, tiny_target)
    with pytest.raises(DLiteConfigError, match="no checkpoint there"):
        make_engine_drafter(f"eagle3:{tmp_path / 'nope'}", tiny_target)
    with pytest.raises(DLiteInputError) as e:
        make_engine_drafter("medusa", tiny_target)
    for n in DRAFTER_NAMES:
        assert n in str(e.value)
    with pytest.raises(DLiteInputError, match="no checkpoint"):
        make_engine_drafter("ngram:/x", tiny_target)
    assert isinstance(make_engine_drafter("ngram", tiny_target), NGramDrafter)
    # DLite ablations: DLite checkpoints whose history matches the name
    torch.manual_seed(0)
    build_drafter(tiny_dlite_config(tiny_target, history="window:128")).save_pretrained(str(tmp_path / "dlite-window128"))
    d = make_engine_drafter("dlite-window128", tiny_target)
    assert isinstance(d, DLiteEngineDrafter) and d.hidden_rows_needed == 3 + 128
    DLiteDrafter(tiny_dlite_config(tiny_target)).save_pretrained(str(tmp_path / "dlite-teacher"))
    with pytest.raises(DLiteConfigError, match="history='full'"):
        make_engine_drafter("dlite-teacher", tiny_target)
    # a baseline checkpoint in the default folder is found without a path
    tiny_baseline("dflash", tiny_target).save_pretrained(str(tmp_path / "dflash"))
    assert make_engine_drafter("dflash", tiny_target).model.config.model_type == "dlite-dflash"
    # a bare checkpoint folder is taken by its config.json's model_type; other folders are refused
    assert make_engine_drafter(str(tmp_path / "dflash"), tiny_target).model.config.model_type == "dlite-dflash"
    d = make_engine_drafter(str(tmp_path / "dlite-window128"), tiny_target)
    assert isinstance(d, DLiteEngineDrafter) and d.hidden_rows_needed == 3 + 128
    (tmp_path / "empty").mkdir()
    with pytest.raises(DLiteInputError, match="a folder, but not a drafter checkpoint"):
        make_engine_drafter(str(tmp_path / "empty"), tiny_target)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(DLiteInputError, match="model_type 'llama', not a drafter"):
        make_engine_drafter(str(tmp_path / "hf"), tiny_target)


def test_memory_per_request_grows_with_context_for_kv_baselines_not_dlite(tiny_target):
    torch.manual_seed(0)
    dl = DLiteEngineDrafter(DLiteDrafter(tiny_dlite_config(tiny_target)).bind_hf_target(tiny_target))
    rng = random.Random(4)
    ids = [1] + [rng.randrange(3, 96) for _ in range(100)]
    with torch.no_grad():
        hs = tiny_target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for name in KV_NAMES + ["dlite", "ngram"]:
        d = dl if name == "dlite" else NGramDrafter() if name == "ngram" else engine_adapter(name, tiny_baseline(name, tiny_target))
        sizes = []
        for T in (20, 100):
            state: dict = {}
            hidden = torch.stack([hs[i + 1][0] for i in d.capture_layer_ids])[:, :T - 1]
            d.draft(DraftRequest(ids[:T], hidden, 0, state=state))
            sizes.append(d.memory_bytes(state) if hasattr(d, "memory_bytes") else len(state))
        if name in KV_NAMES:
            cfg = d.model.config
            per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
            assert sizes == [19 * per_pos, 99 * per_pos], name  # one entry per committed position
        else:
            assert sizes == [0, 0], name


def test_reference_training_loop_learns_and_writes_a_loadable_checkpoint(tiny_target, tmp_path):
    """A few steps of the baselines' training loop on a tiny gen-data folder (features computed
    with the tiny target); the checkpoint loads through the registry."""
    from dlite_lab.baselines.train import sequence_inputs, train_kv_baseline
    from dlite_lab.training.data import save_shard, write_manifest
    from dlite_lab.training.train import FeatureData

    rng = random.Random(5)
    data = tmp_path / "data"
    data.mkdir()
    seqs, masks = [], []
    for _ in range(6):  # prompt + the target's own greedy continuation (regenerated data)
        p = [1] + [rng.randrange(3, 96) for _ in range(rng.randrange(4, 12))]
        out = greedy_ref(tiny_target, p, 24)
        seqs.append(p + out)
        masks.append([0] * len(p) + [1] * len(out))
    info = save_shard(str(data / "s_0.npz"), seqs, masks)
    write_manifest(str(data), {"shards": [info]})
    for name in KV_NAMES:
        out = tmp_path / name
        steps = 30 if name == "dflash" else 3
        # dspark: the vocabulary-subset + bf16 + wall-budget path (budget far above what it needs)
        # eagle3: every position as an anchor (--anchor-tokens all)
        extra = dict(vocab_subset=16, bf16=True, budget_min=10.0) if name == "dspark" else {}
        extra = dict(anchor_tokens="all") if name == "eagle3" else extra
        train_kv_baseline(name, tiny_target, str(data), str(out), steps=steps, lr=3e-3, batch_size=16,
                          seqs_per_batch=2, progress=False, log_every=1, **extra)
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(recs) == steps and all(math.isfinite(r["loss"]) for r in recs)
        if name == "dflash":
            first = sum(r["loss"] for r in recs[:5]) / 5
            last = sum(r["loss"] for r in recs[-5:]) / 5
            assert last < first
        d = make_baseline_drafter(name, str(out), tiny_target)
        if name == "eagle3":  # prompt-side labels count only with anchor_tokens="all"
            L = json.loads((out / "config.json").read_text())["target_layer_ids"]
            for mode, want in (("generated", False), ("all", True)):  # the label at 2 is a prompt token
                fd = FeatureData(str(data), L, anchor_tokens=mode)
                assert bool(sequence_inputs(fd, 0, [1], 2, len(L))[4][0, 0, 0]) is want, mode
        eng = ReferenceEngine(tiny_target, d, [EOS])
        assert eng.generate(seqs[0][:8], 8).output_ids == greedy_ref(tiny_target, seqs[0][:8], 8)
        if name == "eagle3":  # shipping it: bf16 + training.json + a card rendered from that record
            _check_export(out, data, tmp_path, tiny_target, seqs[0][:8])


def _check_export(src, data, tmp_path, target, prompt):
    from safetensors import safe_open

    from dlite_lab.baselines.export import export, main as export_main
    from dlite_lab.training.run_summary import read_training_json

    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"drafter": "eagle3", "workload": "agent-stdlib", "tau": 1.234, "lossless": True}))
    dst = export("eagle3", str(src), str(tmp_path / "shipped"), str(data), [str(acc)])
    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    rec = read_training_json(dst)
    assert rec["drafter"] == "eagle3" and rec["run"]["steps"] == 3
    assert rec["data"]["sequences"] == 6 and rec["data"]["generated_tokens"] == 6 * 24
    assert rec["acceptance"] == [{"drafter": "eagle3", "workload": "agent-stdlib", "tau": 1.234, "lossless": True}]
    card = open(os.path.join(dst, "README.md")).read()
    assert "6 sequences" in card and "144 generated by the target" in card and "| agent-stdlib | 1.234 |" in card
    d = make_baseline_drafter("eagle3", dst, target)  # the bf16 copy loads and drafts losslessly
    assert ReferenceEngine(target, d, [EOS]).generate(prompt, 8).output_ids == greedy_ref(target, prompt, 8)
    with pytest.raises(DLiteConfigError, match="train_info.json"):
        export_main(["--drafter-type", "eagle3", "--src", str(data), "--dst", str(tmp_path / "x")])


def test_acceptance_harness_runs_baselines_and_report_renders(tmp_path):
    """bench/acceptance.py --drafter ngram / dspark:PATH on a tiny target with SmolLM2's tokenizer,
    then bench/report.py over those results + a small draft-cost run."""
    import importlib.util
    import os

    from transformers import AutoTokenizer

    from conftest import make_tiny_llama
    from sglang_dlite.model.bundled_target import resolve_target
    from test_acceptance import CONVS

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def load(name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "bench", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    tok = AutoTokenizer.from_pretrained(resolve_target("default"))
    target = make_tiny_llama(seed=3, vocab=len(tok), hidden=64, layers=6)
    target.config.eos_token_id = tok.eos_token_id
    ckpt = tmp_path / "target"
    target.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    tiny_baseline("dspark", target).save_pretrained(str(tmp_path / "dspark"))
    res = tmp_path / "results"
    acc = load("acceptance")
    for spec in ("ngram", f"dspark:{tmp_path / 'dspark'}"):
        name = spec.split(":")[0]
        rc = acc.main(["--drafter", spec, "--target", str(ckpt), "--workload", str(wl), "--max-new-tokens", "12",
                       "--check-lossless", "--threads", "1", "--no-progress", "--out", str(res / f"acc_{name}_tiny.json")])
        assert rc == 0
        r = json.loads((res / f"acc_{name}_tiny.json").read_text())
        assert r["lossless_mismatches"] == 0 and r["rounds"] > 0
    assert load("draft_cost").main(["--drafter", "dlite,dflash,ngram", "--contexts", "64,256", "--rounds", "2",
                                    "--warmup", "1", "--out", str(res / "draft_cost.json")]) == 0
    dc = json.loads((res / "draft_cost.json").read_text())
    mem = {(r["drafter"], r["context"]): r["memory_bytes"] for r in dc["results"]}
    assert mem[("dflash", 256)] > mem[("dflash", 64)] > 0 and mem[("dlite", 256)] == 0
    # an sglang end-to-end result in bench/e2e.py's format (median of repeats, divergences)
    row = lambda m, c, tps: {"mode": m, "concurrency": c, "tokens_per_s": tps, "tokens_per_s_min": tps - 1,  # noqa: E731
                             "tokens_per_s_max": tps + 1}
    e2e = {"command": "python bench/e2e.py --repeats 3", "engine": "sglang", "device": "cpu", "workload": "agent-stdlib",
           "dtype": "bfloat16", "max_new_tokens": 128, "repeats": 3,
           "rows": [row("dlite", 1, 15.0), row("nospec", 1, 12.0), row("dlite", 4, 30.0), row("nospec", 4, 20.0)],
           "table": [{"mode": "dlite", "concurrency": c, "spec_tok_s": s_, "nospec_tok_s": n_, "speedup": round(s_ / n_, 3),
                      "tau": 1.5, "identical": 7, "requests": 8, "ties": 1, "mismatches": 0}
                     for c, s_, n_ in ((1, 15.0, 12.0), (4, 30.0, 20.0))],
           "divergences": {"nospec@4 vs nospec@1": [{"tie": True}]}}
    (res / "e2e.json").write_text(json.dumps(e2e))
    assert load("report").main(["--results", str(res), "--out", str(tmp_path / "RESULTS.md"),
                                "--plots", str(tmp_path / "plots"), "--e2e", str(res / "e2e.json")]) == 0
    md = (tmp_path / "RESULTS.md").read_text()
    assert "| ngram |" in md and "| dspark:" in md and "cost 256/64" in md
    assert "| dlite | 1 | 15.0 (14.0-16.0) | 12.0 (11.0-13.0) | 1.25x | 1.5 | 7/8 | 1 | 0 |" in md
    assert "nospec@4 vs nospec@1: 1 of the requests differ, 1 of them at bf16 precision ties" in md
    assert sorted(os.listdir(tmp_path / "plots")) == ["draft_ms_vs_context.png", "e2e_speedup.png",
                                                      "speedup_per_workload.png", "tau_vs_context.png",
                                                      "tau_vs_output_position.png"]


@pytest.mark.parametrize("name", KV_NAMES)
def test_training_vocab_subset_selects_lm_head_rows(tiny_target, name):
    """--vocab-subset: the baselines' training logits over a token subset equal the full logits'
    columns for those tokens (DSpark's Markov bias included), as DLite's trainer does it."""
    model = new_model(name, tiny_target.config, seed=0)
    model.bind_hf_target(tiny_target).eval()
    with torch.no_grad():  # a non-zero Markov head, so the subset path of the bias is exercised
        for p in model.parameters():
            if p.requires_grad and p.abs().sum() == 0:
                p.normal_(0, 0.02)
    T = 12
    L = model.config.num_capture_layers
    torch.manual_seed(0)
    hidden = torch.randn(1, L, T, tiny_target.config.hidden_size)
    ids = torch.randint(3, 96, (1, T))
    anchors = torch.tensor([[2, 5]])
    vocab = torch.tensor([3, 7, 11, 40, 95])
    with torch.no_grad():
        full = model.training_forward(hidden, ids, anchors)
        model.train_vocab = vocab
        sub = model.training_forward(hidden, ids, anchors)
        model.train_vocab = None
    torch.testing.assert_close(sub, full[..., vocab])


def test_ablation_cli_forwards_the_shared_training_options(monkeypatch, tmp_path):
    """`python -m dlite_lab.baselines.train --drafter-type dlite-window128 ...` runs DLite's own
    trainer: lr, step counts, anchor tokens, vocabulary subset and the wall budget must reach it
    (regression: lr and steps were dropped, so an ablation stopped after the trainer's default
    300 steps at lr 1e-3)."""
    import dlite_lab.baselines.train as bt

    seen = {}

    def fake(name, data_dir, out, target_support, extra):
        seen.update(name=name, extra=extra)
        return out

    monkeypatch.setattr(bt, "train_dlite_ablation", fake)
    assert bt.main(["--drafter-type", "dlite-window128", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                    "--lr", "0.0015", "--steps", "40000", "--anchor-tokens", "all", "--vocab-subset", "8192",
                    "--budget-min", "15", "--single-stage"]) == 0
    ex = seen["extra"]
    opt = {k: v for k, v in zip(ex, ex[1:]) if k.startswith("--")}
    assert seen["name"] == "dlite-window128"
    assert (opt["--lr"], opt["--steps-stabilize"], opt["--anchor-tokens"], opt["--vocab-subset"]) == \
        ("0.0015", "40000", "all", "8192")
    assert opt["--stage-budget-min"] == "4.5,4.5,6" and "--single-stage" in ex  # single-stage: the sum


def test_default_checkpoint_prefers_trained_then_shipped(tmp_path, monkeypatch):
    import dlite_lab.baselines.registry as registry

    monkeypatch.setenv("SGLANG_DLITE_BASELINES", str(tmp_path))
    shipped = registry.shipped_checkpoint("eagle3")
    assert registry.default_checkpoint("eagle3") == (shipped or str(tmp_path / "eagle3"))
    assert registry.default_checkpoint("dflash") == str(tmp_path / "dflash")  # ships none
    trained = tmp_path / "eagle3"
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    (trained / "model.safetensors").write_bytes(b"")
    assert registry.default_checkpoint("eagle3") == str(trained)
    assert registry.training_output_dir("eagle3") == str(trained)


def test_shipped_eagle3_checkpoint_is_small_bf16_and_lossless(real_target, monkeypatch, tmp_path):
    """The committed EAGLE-3-style baseline: bf16, <= 25 MB, loads by name on a fresh clone (no
    trained one in the baselines folder) and drafts losslessly for the bundled target."""
    from safetensors import safe_open

    import dlite_lab.baselines.registry as registry
    from dlite_lab.commands.generate import chat_ids

    path = registry.shipped_checkpoint("eagle3")
    if path is None:
        pytest.skip("no shipped EAGLE-3 checkpoint in this checkout")
    st = os.path.join(path, "model.safetensors")
    assert os.path.getsize(st) <= 25 * 2 ** 20
    with safe_open(st, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    info = json.load(open(os.path.join(path, "training.json")))
    assert info["drafter"] == "eagle3" and info["run"]["steps"] > 0 and info["data"]["generated_tokens"] > 0
    monkeypatch.setenv("SGLANG_DLITE_BASELINES", str(tmp_path))  # nothing trained here
    model, tok = real_target
    eos = [tok.eos_token_id]
    p = chat_ids(tok, "Write a Python function that reverses a list.")
    ref = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                         attention_mask=torch.ones(1, len(p), dtype=torch.long), eos_token_id=eos)[0, len(p):].tolist()
    eng = ReferenceEngine(model, make_engine_drafter("eagle3", model), eos)
    res = eng.generate(p, 24)
    assert res.output_ids == ref
    assert res.tau > 1.2  # a trained drafter, not a random one
