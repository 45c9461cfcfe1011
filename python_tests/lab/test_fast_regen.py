"""gen-data's fast engine (training/fast_regen.py) on tiny random-weight Llamas: its text is the
float32 target's greedy text (HF, batch 1, turn by turn), its captured features are HF's hidden
states, the relabel/cut rule cuts at the first non-greedy token, and the gen-data CLI with
``--engine fast`` writes loadable, resumable shards."""

from __future__ import annotations

import functools
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch


from sglang_dlite import ops
from dlite_lab.training.exactness import count_disagreements, first_disagreement, reference_greedy, relabel
from dlite_lab.training.fast_llama import MklPackedLinear, mkl_available
from dlite_lab.training.fast_llama import FastLlama
from dlite_lab.training.fast_regen import FastRegenerator
from dlite_lab.training.turns import TurnRules

LAYERS = [1, 2]  # (not the last layer: HF reports the final-norm output as hidden_states[-1])


class FakeTurns(TurnRules):
    """The turn rules with a token-level stand-in for the chat template: a conversation's users
    are id lists; the first prompt is users[0], a later turn appends [SEP] + users[t]."""

    SEP = 5

    def __init__(self, eos, max_new, max_len, continue_truncated=False):
        self.eos, self.max_new, self.max_len, self.continue_truncated = eos, max_new, max_len, continue_truncated

    def start(self, conv):
        return list(conv["users"][0])

    def turn_suffix(self, user):
        return [self.SEP] + list(user)


def hf_greedy_conv(model, conv, eos, max_new, max_len, continue_truncated=False):
    """The reference: HF's float32 forward, batch 1, no cache, argmax token by token, with the
    same turn rules as the regenerators."""
    seq = list(conv["users"][0])
    mask = [0] * len(seq)
    if not len(seq) + 16 < max_len:
        return seq, mask
    for t in range(len(conv["users"])):
        if t > 0:
            suf = [FakeTurns.SEP] + list(conv["users"][t])
            if seq[-1] != eos:  # continue_truncated: close the cut turn (not a label)
                suf = [eos] + suf
            if len(seq) + len(suf) + 16 >= max_len:
                break
            seq += suf
            mask += [0] * len(suf)
        room = min(max_new, max_len - len(seq))
        for _ in range(room):
            with torch.no_grad():
                nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            mask.append(1)
            if nxt == eos:
                break
        if seq[-1] != eos and not continue_truncated:
            break
    return seq, mask


def _fast(model, eos, batch_size, max_new=24, max_len=256, dtype=torch.float32, layers=LAYERS, continue_truncated=False,
          cls=FastRegenerator, packed=True, attention="auto", **kw):
    """A ``cls`` engine whose chat template is ``FakeTurns``'s."""
    fr = cls(model, FakeTurns(eos, max_new, max_len, continue_truncated), capture_layers=layers,
             batch_size=batch_size, dtype=dtype, packed=packed, attention=attention, **kw)
    fr.engine.k.fill_(float("nan"))  # the cache is allocated unfilled: nothing unwritten may be read
    fr.engine.v.fill_(float("nan"))
    return fr


def _convs(model, n, seed=0):
    """Conversations of 1-3 turns and varied prompt lengths; the EOS is a token the target's
    greedy text of the first prompt reaches after a few steps, so some turns end by EOS."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    convs = []
    for i in range(n):
        turns = 1 + i % 3
        users = [torch.randint(6, V, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(turns)]
        convs.append({"id": str(i), "users": users})
    seen = {}
    for c in convs:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([c["users"][0]]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        for t in set(out[0, len(c["users"][0]) + 1:].tolist()):
            seen[t] = seen.get(t, 0) + 1
    eos = max(sorted(seen), key=lambda t: seen[t])  # reached by the most conversations
    return convs, eos


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama with an untied LM head (the tied conftest model repeats its first token
    forever; this one produces varied, cycling text, so turns end by EOS at different steps)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.3)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("batch_size,packed,attention", [(1, True, "auto"), (3, True, "auto"), (16, True, "auto"),
                                                        (3, False, "auto"), (3, True, "sdpa")])
def test_fast_text_equals_hf_fp32_greedy(tiny, batch_size, packed, attention):
    """Same sequences and masks as HF batch-1 float32 greedy decoding, whatever the number of
    slots (1: one at a time; 3 < 9 conversations: slots refilled and compacted mid-run), with the
    weights MKL-packed (the default) or plain, the decode attention the C++ kernel (auto, when
    built) or chunked SDPA."""
    convs, eos = _convs(tiny, 9)
    fr = _fast(tiny, eos, batch_size, packed=packed, attention=attention)
    assert fr.engine.kernel_attention == (attention == "auto" and ops.kv_cache_attention_kernel_available(torch.float32, 16))
    want = MklPackedLinear if packed and mkl_available() else functools.partial
    assert isinstance(fr.engine.layers[0]["qkv"], want) and isinstance(fr.engine.head_linear, want)
    seqs, masks, feats = fr.run(convs)
    n_eos_turns = 0
    for c, s, m in zip(convs, seqs, masks):
        rs, rm = hf_greedy_conv(tiny, c, eos, fr.turns.max_new, fr.turns.max_len)
        assert s == rs, f"conversation {c['id']} differs from HF greedy"
        assert m == rm
        n_eos_turns += sum(1 for j in range(1, len(s)) if s[j] == eos and m[j] == 1)
    assert n_eos_turns >= 2, "the test should exercise turns that end by EOS"
    assert any(len(c["users"]) > 1 and s.count(FakeTurns.SEP) >= 1 for c, s in zip(convs, seqs)), "no multi-turn case"
    assert fr.new_tokens == sum(sum(m) for m in masks)


def test_continue_truncated_turns(tiny):
    """With continue_truncated a turn cut by max_new_tokens is closed by a non-label EOS and the
    conversation goes on (HF reference with the same rule)."""
    convs, eos = _convs(tiny, 6, seed=5)
    fr = _fast(tiny, eos, 3, max_new=6, continue_truncated=True)
    seqs, masks, feats = fr.run(convs)
    closed = 0
    for c, s, m, f in zip(convs, seqs, masks, feats):
        assert (s, m) == hf_greedy_conv(tiny, c, eos, 6, fr.turns.max_len, continue_truncated=True)
        assert s.count(FakeTurns.SEP) == len(c["users"]) - 1  # every turn was reached
        closed += sum(1 for j in range(len(s)) if s[j] == eos and m[j] == 0)
        assert len(f) == len(s) - 1
    assert closed >= 1


def test_fast_features_equal_hf_hidden_states(tiny):
    convs, eos = _convs(tiny, 5, seed=1)
    fr = _fast(tiny, eos, 2)
    seqs, masks, feats = fr.run(convs)
    for s, f in zip(seqs, feats):
        assert f.shape == (len(s) - 1, len(LAYERS) + 1, tiny.config.hidden_size) and f.dtype == torch.float16
        with torch.no_grad():
            hs = tiny(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states
        ref = torch.stack([hs[l + 1][0] for l in LAYERS] + [hs[-1][0]], 1)[: len(s) - 1]
        torch.testing.assert_close(f.float(), ref.to(torch.float16).float(), atol=2e-3, rtol=2e-3)


def test_reference_greedy_and_relabel_cut_at_first_disagreement(tiny):
    convs, eos = _convs(tiny, 4, seed=2)
    fr = _fast(tiny, eos, 4)
    seqs, masks, _ = fr.run(convs)
    preds, feats = reference_greedy(tiny, seqs, LAYERS)
    assert all(count_disagreements(s, m, p) == 0 for s, m, p in zip(seqs, masks, preds))
    # corrupt one generated token of sequence 0 (and one of sequence 1 later on)
    bad = [list(s) for s in seqs]
    gen0 = [j for j, x in enumerate(masks[0]) if x][3]
    bad[0][gen0] = (bad[0][gen0] + 1) % tiny.config.vocab_size
    gen1 = [j for j, x in enumerate(masks[1]) if x][-2]
    bad[1][gen1] = (bad[1][gen1] + 7) % tiny.config.vocab_size
    bpreds, _ = reference_greedy(tiny, bad)
    assert first_disagreement(bad[0], masks[0], bpreds[0]) == gen0
    assert first_disagreement(bad[1], masks[1], bpreds[1]) == gen1
    out_s, out_m, out_f, counts = relabel(tiny, bad, masks, LAYERS)
    assert counts["sequences_cut"] == 2 and counts["tokens_not_fp32_greedy"] >= 2
    # cut: everything before the bad token, then the target's own choice there
    assert out_s[0] == seqs[0][:gen0 + 1] and out_m[0] == masks[0][:gen0 + 1]
    assert out_s[1] == seqs[1][:gen1 + 1] and out_m[1] == masks[1][:gen1 + 1]
    assert counts["generated_tokens_dropped"] == sum(masks[0][gen0:]) - 1 + sum(masks[1][gen1:]) - 1
    assert out_s[2:] == seqs[2:] and out_m[2:] == masks[2:]
    for s, f in zip(out_s, out_f):
        assert len(f) == len(s) - 1
    torch.testing.assert_close(out_f[2].float(), feats[2][: len(out_s[2]) - 1].float())


def test_bf16_engine_runs_and_relabel_makes_it_greedy(tiny):
    """bf16 text may leave the fp32 greedy choice; after relabel it never does."""
    convs, eos = _convs(tiny, 4, seed=3)
    fr = _fast(tiny, eos, 4, dtype=torch.bfloat16)
    seqs, masks, _ = fr.run(convs)
    out_s, out_m, _, _ = relabel(tiny, seqs, masks)
    preds, _ = reference_greedy(tiny, out_s)
    assert all(count_disagreements(s, m, p) == 0 for s, m, p in zip(out_s, out_m, preds))


def test_max_len_and_long_prompt_rules(tiny):
    """A first prompt too long for max_len generates nothing; a turn stops at max_len."""
    convs, eos = _convs(tiny, 3, seed=4)
    convs.append({"id": "long", "users": [list(range(6, 6 + 60))]})
    fr = _fast(tiny, eos, 2, max_new=40, max_len=70)
    seqs, masks, feats = fr.run(convs)
    for c, s, m in zip(convs, seqs, masks):
        rs, rm = hf_greedy_conv(tiny, c, eos, 40, 70)
        assert (s, m) == (rs, rm)
        assert len(s) <= 70
    assert sum(masks[-1]) == 0 and feats[-1] is None


# ---------------------------------------------------------------------------- gen-data CLI (tiny_ckpt: conftest)
def _args(tiny_ckpt, prompts, out, **kw):
    a = SimpleNamespace(target=tiny_ckpt, prompts=[f"jsonl:{prompts}"], out=str(out), shard_size=3, max_new_tokens=12,
                        max_len=256, max_turns=2, max_user_tokens=64, temperature=0.0, top_p=1.0, seed=0, threads=1,
                        max_shards=None, budget_min=None, worker="0/1", reverse=False, capture_layers="1,4",
                        no_features=False, engine="fast", min_free_gb=0.0, batch_size=4, dtype="float32", relabel=False)
    a.__dict__.update(kw)
    return a


def _seven_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        for i in range(7):
            msgs = [{"role": "user", "content": f"Question {i}: " + "word " * (3 + 5 * i)},
                    {"role": "assistant", "content": "x"}, {"role": "user", "content": f"And then {i}?"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return prompts


def _assert_same_shards(got, want):
    """Every shard of gen-data folder ``want`` is in ``got`` with the same ids, masks and offsets,
    and features within float rounding."""
    from dlite_lab.training.data import load_shard, read_manifest
    from dlite_lab.training.features import load_features

    for sh in read_manifest(str(want))["shards"]:
        a_ids, a_mask, a_off = load_shard(str(got / sh["file"]))
        b_ids, b_mask, b_off = load_shard(str(want / sh["file"]))
        np.testing.assert_array_equal(a_ids, b_ids)
        np.testing.assert_array_equal(a_mask, b_mask)
        np.testing.assert_array_equal(a_off, b_off)
        fa = load_features(str(got / sh["file"]), [1, 4], len(a_ids))
        fb = load_features(str(want / sh["file"]), [1, 4], len(b_ids))
        np.testing.assert_allclose(np.asarray(fa, np.float32), np.asarray(fb, np.float32), atol=2e-3, rtol=2e-3)


def test_gen_data_fast_engine_matches_hf_engine_and_resumes(tiny_ckpt, tmp_path):
    from dlite_lab.training import gen_data
    from dlite_lab.training.data import DataError, read_manifest

    prompts = _seven_prompts(tmp_path)
    fast, hf = tmp_path / "fast", tmp_path / "hf"
    assert gen_data.run(_args(tiny_ckpt, prompts, fast, max_shards=2)) == 0
    man = read_manifest(str(fast))
    assert len(man["shards"]) == 2
    first = {s["file"]: os.path.getmtime(fast / s["file"]) for s in man["shards"]}
    # a rerun with other settings would mix two recipes in one folder: refused, naming the field
    with pytest.raises(DataError, match=r"shard_size: folder 3, this run 2"):
        gen_data.run(_args(tiny_ckpt, prompts, fast, shard_size=2))
    with pytest.raises(DataError, match=r"feature_layers: folder \[1, 4\], this run \[1, 3\]"):
        gen_data.run(_args(tiny_ckpt, prompts, fast, capture_layers="1,3"))
    # resume: the finished shards are skipped, the last one is generated
    assert gen_data.run(_args(tiny_ckpt, prompts, fast)) == 0
    man = read_manifest(str(fast))
    assert len(man["shards"]) == 3 and all(os.path.getmtime(fast / f) == t for f, t in first.items())
    assert gen_data.run(_args(tiny_ckpt, prompts, hf, engine="hf")) == 0
    _assert_same_shards(fast, hf)
    assert any(r.get("engine") == "fast-float32" for r in read_manifest(str(fast))["runs"])


_FAST_STREAM = FastRegenerator.stream


class _Killed(Exception):
    """Stands for the end of a run from outside (a kill, the end of a working period)."""


def _admitting_stream(monkeypatch, admitted, stop_after=None):
    """FastRegenerator.stream, recording the conversations it is given; with ``stop_after`` the run
    is stopped (``_Killed``) once that many conversations have finished."""
    real = _FAST_STREAM  # (not FastRegenerator.stream: an earlier patch of this test may sit there)

    def stream(self, items):
        def recorded():
            for key, conv in items:
                admitted.append(key)
                yield key, conv
        for n, out in enumerate(real(self, recorded())):
            if stop_after is not None and n == stop_after:
                raise _Killed
            yield out
    monkeypatch.setattr(FastRegenerator, "stream", stream)


def test_gen_data_fast_engine_keeps_finished_conversations_of_a_stopped_run(tiny_ckpt, tmp_path, monkeypatch):
    """A run stopped mid-shard leaves its finished conversations in <shard>.parts/; the rerun reads
    them back, generates only the others, writes the same shards as an uninterrupted run and
    removes the parts. Parts made under other generation settings are not reused."""
    from dlite_lab.training import gen_data
    from dlite_lab.training.data import DataError, read_manifest
    from dlite_lab.training.shard_parts import conversation_key, load_parts

    prompts = _seven_prompts(tmp_path)
    ref, out, other = tmp_path / "ref", tmp_path / "out", tmp_path / "other"
    assert gen_data.run(_args(tiny_ckpt, prompts, ref)) == 0  # uninterrupted: shards of 3, 3, 1

    first = []
    _admitting_stream(monkeypatch, first, stop_after=4)
    with pytest.raises(_Killed):
        gen_data.run(_args(tiny_ckpt, prompts, out))
    written = {s["file"]: s["num_seqs"] for s in read_manifest(str(out))["shards"]}
    parts = {d[: -len(".parts")]: sorted(os.listdir(out / d)) for d in os.listdir(out) if d.endswith(".parts")}
    assert parts and not set(parts) & set(written)
    assert sum(written.values()) + sum(len(v) for v in parts.values()) == 4  # every finished one is on disk
    kept = {(f, int(n[:-3])) for f, names in parts.items() for n in names}

    again = []
    _admitting_stream(monkeypatch, again)
    assert gen_data.run(_args(tiny_ckpt, prompts, out)) == 0
    assert not set(again) & kept  # the saved conversations were not generated again
    assert len(again) == 7 - 4
    assert not [d for d in os.listdir(out) if d.endswith(".parts")]
    ref_shards = read_manifest(str(ref))["shards"]
    assert sorted(s["file"] for s in read_manifest(str(out))["shards"]) == sorted(s["file"] for s in ref_shards)
    _assert_same_shards(out, ref)

    # a stopped run's folder is continued only with its own settings; its parts are keyed by them
    stopped = []
    _admitting_stream(monkeypatch, stopped, stop_after=2)
    with pytest.raises(_Killed):
        gen_data.run(_args(tiny_ckpt, prompts, other))
    parts = [d[: -len(".parts")] for d in os.listdir(other) if d.endswith(".parts")]
    assert parts
    with pytest.raises(DataError, match=r"other settings \(max_new_tokens_per_turn: folder 12, this run 8\)"):
        gen_data.run(_args(tiny_ckpt, prompts, other, max_new_tokens=8))
    plan = {f: convs for f, _, convs in gen_data.plan_shards(_args(tiny_ckpt, prompts, other))}
    own, eight = _args(tiny_ckpt, prompts, other), _args(tiny_ckpt, prompts, other, max_new_tokens=8)
    for f in parts:  # read back under the settings that made them, not under others
        assert load_parts(str(other), f, [conversation_key(c, own, [1, 4]) for c in plan[f]])
        assert load_parts(str(other), f, [conversation_key(c, eight, [1, 4]) for c in plan[f]]) == {}


def test_gen_data_only_sources_keeps_the_full_plan(tiny_ckpt, tmp_path):
    """--only-sources generates just that source's planned shards (same names as the full plan);
    a later run without it fills in the rest and leaves them alone; an unknown source is refused."""
    from dlite_lab.training import gen_data
    from dlite_lab.training.data import DataError, read_manifest

    files = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{name} {i}: " + "w " * i}]}) + "\n"
                                for i in range(4)))
        files.append(f"jsonl:{path}")
    out = tmp_path / "o"

    def args(**kw):
        a = _args(tiny_ckpt, "unused", out, shard_size=2, max_new_tokens=4, **kw)
        a.prompts = files
        return a

    full = args()
    plan = gen_data.plan_shards(full)
    b_name = plan[1][1]
    assert len(plan) == 4 and plan[0][1] != b_name
    with pytest.raises(DataError, match="not a source of --prompts"):
        gen_data.run(args(only_sources="nope"))
    assert gen_data.run(args(only_sources=b_name, worker="1/2")) == 0  # worker 1 of 2: the second b shard
    assert gen_data.run(args(only_sources=b_name, worker="0/2")) == 0
    got = {s["file"]: s["source"] for s in read_manifest(str(out))["shards"]}
    assert got == {f: src for f, src, _ in plan if src == b_name}
    first = {f: os.path.getmtime(out / f) for f in got}
    assert gen_data.run(full) == 0
    assert sorted(s["file"] for s in read_manifest(str(out))["shards"]) == sorted(f for f, _, _ in plan)
    assert all(os.path.getmtime(out / f) == t for f, t in first.items())


def test_gen_data_sort_window_claims_shards_as_it_reads_ahead(tiny_ckpt, tmp_path, monkeypatch):
    """--sort-window bounds the read-ahead: with one slot and a window of one shard, a run stopped
    after its first conversation has claimed only that shard; the default window (64) has read,
    and claimed, all three. A window below 1 is refused before anything is written."""
    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.training import gen_data

    prompts = _seven_prompts(tmp_path)
    with pytest.raises(DLiteInputError, match=r"--sort-window 0: must be >= 1"):
        gen_data.run(_args(tiny_ckpt, prompts, tmp_path / "bad", sort_window=0))
    assert not (tmp_path / "bad").exists()
    for window, claimed, read in ((3, 1, 3), (64, 3, 7)):  # 7 prompts: shards of 3, 3 and 1
        out, admitted = tmp_path / f"w{window}", []
        _admitting_stream(monkeypatch, admitted, stop_after=0)
        with pytest.raises(_Killed):
            gen_data.run(_args(tiny_ckpt, prompts, out, batch_size=1, sort_window=window))
        assert len([f for f in os.listdir(out) if f.endswith(".claim")]) == claimed, window
        assert len(admitted) == read, window


def test_gen_data_fast_engine_refuses_sampling(tiny_ckpt, tmp_path):
    from sglang_dlite.errors import DLiteInputError
    from dlite_lab.training import gen_data

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DLiteInputError, match="greedily"):
        gen_data.run(_args(tiny_ckpt, prompts, tmp_path / "o", temperature=0.7))


def test_agent_prompt_source_avoids_eval_sources():
    """agent traces: several turns each, never over an evaluation package or agent-stdlib module."""
    from dlite_lab.training.prompt_code import EVAL_PACKAGES, _eval_stdlib_files
    from dlite_lab.training.prompts import load_prompts

    name, convs = load_prompts("agent:12", 0, 3)
    assert name == "agent" and len(convs) == 12
    excl = _eval_stdlib_files()
    for c in convs:
        assert 4 <= len(c["users"]) <= 6 and c["system"]
        rel = c["id"].split(":")[1]
        mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
        assert mod not in excl and rel.split("/")[0] not in EVAL_PACKAGES
        assert "Tool result (read_file" in "\n".join(c["users"])
    assert load_prompts("agent:12", 0, 3)[1] == convs  # deterministic: resumable plans


def test_codegen_prompt_source_is_signature_and_docstring_only():
    """codegen: a function's signature + docstring (never its body) from the agent traces' files
    (no evaluation package, no agent-stdlib module), under one of the instructions; deterministic."""
    import ast

    from dlite_lab.training.prompt_code import CODEGEN_INSTRUCTIONS, EVAL_PACKAGES, _eval_stdlib_files
    from dlite_lab.training.prompts import load_prompts

    name, convs = load_prompts("codegen:10", 0, 3)
    assert name == "codegen" and len(convs) == 10
    excl = _eval_stdlib_files()
    for c in convs:
        (user,) = c["users"]
        assert c["system"] is None and user.startswith(CODEGEN_INSTRUCTIONS)
        code = user.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        fn = ast.parse(code + "\n    ...").body[0]  # header + docstring parse once a body is added
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn)
        assert len(fn.body) == 2  # the docstring and our `...`: no statement of the real body leaked
        _, rel, fname = c["id"].split(":")
        assert fname == fn.name and rel.split("/")[0] not in EVAL_PACKAGES
        assert rel[:-3].replace("/", ".").removesuffix(".__init__") not in excl
    assert load_prompts("codegen:10", 0, 3)[1] == convs


def test_toolchat_prompt_source_renders_tools_like_the_workloads():
    """toolchat: 2-4 single-turn bfcl questions per conversation, never a multi-turn (evaluation)
    entry, their functions as tool schemas written exactly as workloads.render writes them."""
    import json

    pytest.importorskip("bfcl_eval")
    from dlite_lab.training.prompts import load_prompts
    from dlite_lab.workloads.render import DEFAULT_TOOL_SYSTEM, TOOLS_SYSTEM_FOOTER, TOOLS_SYSTEM_HEADER

    name, convs = load_prompts("toolchat:8", 0, 3)
    assert name == "toolchat" and len(convs) == 8
    for c in convs:
        ids = c["id"].split(":", 1)[1].split("+")
        assert 1 <= len(c["users"]) == len(ids) <= 4 and not any("multi_turn" in i for i in ids)
        assert c["system"].startswith(DEFAULT_TOOL_SYSTEM + "\n\n" + TOOLS_SYSTEM_HEADER)
        assert c["system"].endswith(TOOLS_SYSTEM_FOOTER)
        body = c["system"][len(DEFAULT_TOOL_SYSTEM + "\n\n" + TOOLS_SYSTEM_HEADER):-len(TOOLS_SYSTEM_FOOTER)]
        tools = [json.loads(line) for line in body.split("\n")]
        assert tools and all(t["type"] == "function" and t["function"]["name"] for t in tools)
        assert all(t["function"]["parameters"].get("type") != "dict" for t in tools)  # JSON schema types
    assert sum(len(c["users"]) for c in convs) > len(convs)  # multi-turn
    assert load_prompts("toolchat:8", 0, 3)[1] == convs


def test_attention_choice_errors(tiny, monkeypatch):
    """attention='kernel' without the C++ op says what is missing; an unknown choice is named."""
    from sglang_dlite.errors import DLiteInputError, MissingDependencyError
    from dlite_lab.training import fast_llama

    with pytest.raises(DLiteInputError, match="attention must be one of"):
        FastLlama(tiny, 2, 32, attention="flash")
    monkeypatch.setattr(fast_llama.ops, "kv_cache_attention_kernel_available", lambda dtype, head_dim: False)
    with pytest.raises(MissingDependencyError, match="needs the C.. ops"):
        FastLlama(tiny, 2, 32, attention="kernel")
    assert not FastLlama(tiny, 2, 32).kernel_attention  # auto falls back to SDPA


@pytest.mark.skipif(not mkl_available(), reason="torch built without MKL")
@pytest.mark.parametrize("with_bias", [False, True])
def test_mkl_packed_linear_equals_f_linear_at_every_row_count(with_bias):
    """One packed copy serves every row count (the pack does not depend on M): equal to F.linear
    within the last bits below ~16 rows and bit for bit above, any leading shape, empty input."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 96, generator=g) * 0.1
    b = torch.randn(200, generator=g) if with_bias else None
    lin = MklPackedLinear(w, b)
    for shape in [(1, 96), (3, 96), (8, 96), (21, 96), (64, 96), (300, 96), (2, 7, 96)]:
        x = torch.randn(*shape, generator=g)
        got, want = lin(x), F.linear(x, w, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if x.numel() // 96 >= 32:
            assert torch.equal(got, want)
    assert lin(torch.randn(0, 96)).shape == (0, 200)
    x = torch.randn(4, 96)
    assert torch.equal(lin(x[:, None, :].expand(4, 1, 96)), lin(x)[:, None])  # non-contiguous input
    with pytest.raises(ValueError, match="input is torch.bfloat16"):
        lin(x.bfloat16())
    with pytest.raises(ValueError, match="float32 CPU weight"):
        MklPackedLinear(w.bfloat16())
    plain = MklPackedLinear.maybe(w.bfloat16())  # not packable: F.linear, same call
    torch.testing.assert_close(plain(x.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
