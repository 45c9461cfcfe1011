"""`sglang-dlite average-drafters`: the weighted average of DLite checkpoints of one lineage."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_dlite_config
from safetensors.torch import load_file

from sglang_dlite.cli import main as cli_main
from sglang_dlite.errors import DLiteInputError
from sglang_dlite.model.dlite import DLiteDrafter
from dlite_lab.training import average, model_card


def _save(target, path, seed, dtype=torch.float32, vocab=None, **overrides):
    torch.manual_seed(seed)
    m = DLiteDrafter(tiny_dlite_config(target, **overrides))
    if vocab is not None:
        m.set_draft_vocab(vocab)
    m.save_pretrained(str(path), dtype=dtype)
    return load_file(os.path.join(str(path), "model.safetensors"))


def test_average_is_the_weighted_mean_of_every_float_tensor(tiny_target, tmp_path):
    vocab = torch.arange(0, tiny_target.config.vocab_size, 2)
    a = _save(tiny_target, tmp_path / "a", 0, vocab=vocab)
    b = _save(tiny_target, tmp_path / "b", 1, vocab=vocab)
    c = _save(tiny_target, tmp_path / "c", 2, vocab=vocab)
    # a training.json on one source: the average's record carries it, the card renders it
    rec = {"format": 1, "data": {"sequences": 7, "generated_tokens": 99, "prompt_sources": ["agent:1"]},
           "run": {"steps": 5, "wall_s": 1.0, "heldout_tau": {"mean": 1.5, "anchors": 3}}}
    with open(tmp_path / "b" / "training.json", "w") as f:
        json.dump(rec, f)
    out = tmp_path / "soup"
    assert cli_main(["average-drafters", "--out", str(out), str(tmp_path / "a"), str(tmp_path / "b"),
                     str(tmp_path / "c"), "--weights", "1", "1", "2"]) == 0
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(a)
    n_float = 0
    for k, v in got.items():
        if v.is_floating_point():
            n_float += 1
            want = 0.25 * a[k] + 0.25 * b[k] + 0.5 * c[k]
            torch.testing.assert_close(v, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(v, a[k])  # the drafting vocabulary's ids, copied exactly
    assert n_float > 5 and torch.equal(got["draft_vocab"], vocab)
    # it loads as a drafter and drafts
    m = DLiteDrafter.from_pretrained(str(out))
    assert m.config.draft_vocab_size == len(vocab)
    t = json.load(open(out / "training.json"))
    srcs = t["average"]["sources"]
    assert [s["weight"] for s in srcs] == [0.25, 0.25, 0.5] and t["average"]["method"] == "weighted"
    assert srcs[0]["training"] is None and srcs[1]["training"] == rec
    card = (out / "README.md").read_text()
    assert "## Weight average" in card and f"`{tmp_path / 'b'}`, weight 0.250" in card
    assert "- Data: 7 sequences" in card  # source b's own record
    # re-rendering needs no --run/--data for an averaged checkpoint, and adds the measured table
    bench = tmp_path / "acc.json"
    bench.write_text(json.dumps({"workload": "humaneval", "tau": 1.75, "conversations": 3}))
    held = tmp_path / "heldout.json"
    held.write_text(json.dumps({"data": "d", "rows": [{"drafter": "x", "tau": 9.0}, {
        "drafter": "soup", "tau": 1.625, "tau_ci95": [1.5, 1.75], "anchors": 40, "acc_per_pos": [0.4],
        "by_source": {"agent": {"tau": 2.0}}}]}))
    assert model_card.main(["--dest", str(out), "--bench", f"soup={bench}", "--heldout", f"{held}:soup"]) == 0
    card = (out / "README.md").read_text()
    assert "| soup | humaneval | 3 | 1.75 |" in card and "## Weight average" in card
    assert "**1.625** (95 % CI 1.500-1.750)" in card and "by source: agent 2.00" in card
    t = json.load(open(out / "training.json"))
    assert t["heldout_tau"]["tau"] == 1.625 and t["average"]["sources"][1]["training"] == rec
    with pytest.raises(SystemExit):  # a label the result file does not hold
        model_card.main(["--dest", str(out), "--heldout", f"{held}:nope"])


def test_uniform_average_keeps_the_first_checkpoints_dtype(tiny_target, tmp_path):
    a = _save(tiny_target, tmp_path / "a", 0, dtype=torch.bfloat16)
    b = _save(tiny_target, tmp_path / "b", 1, dtype=torch.bfloat16)
    m, ws, dtype = average.average_drafters([str(tmp_path / "a"), str(tmp_path / "b")])
    assert ws == [0.5, 0.5] and dtype == torch.bfloat16
    k = next(k for k, v in a.items() if v.is_floating_point() and v.dim() == 2)
    want = (a[k].float() + b[k].float()) / 2
    torch.testing.assert_close(m.state_dict()[k], want)


def test_average_refuses_drafters_that_are_not_one_function(tiny_target, tmp_path):
    V = tiny_target.config.vocab_size
    _save(tiny_target, tmp_path / "a", 0)
    _save(tiny_target, tmp_path / "rank", 1, rnn_rank=4)
    with pytest.raises(DLiteInputError, match=r"configs differ in rnn_rank \(rnn_rank: 8 vs 4\)"):
        average.average_drafters([str(tmp_path / "a"), str(tmp_path / "rank")])
    _save(tiny_target, tmp_path / "v1", 0, vocab=torch.arange(0, V, 2))
    _save(tiny_target, tmp_path / "v2", 1, vocab=torch.arange(1, V, 2))
    with pytest.raises(DLiteInputError, match="drafting vocabulary differs"):
        average.average_drafters([str(tmp_path / "v1"), str(tmp_path / "v2")])
    with pytest.raises(DLiteInputError, match="at least 2 drafters"):
        average.average_drafters([str(tmp_path / "a")])
    _save(tiny_target, tmp_path / "b", 1)
    with pytest.raises(DLiteInputError, match="--weights has 3 values for 2 drafters"):
        average.average_drafters([str(tmp_path / "a"), str(tmp_path / "b")], [1, 1, 1])
    with pytest.raises(DLiteInputError, match="non-negative"):
        average.average_drafters([str(tmp_path / "a"), str(tmp_path / "b")], [1, -1])


def test_average_cli_reports_bad_input_without_a_traceback(tiny_target, tmp_path, capsys):
    _save(tiny_target, tmp_path / "a", 0)
    _save(tiny_target, tmp_path / "b", 1)
    assert cli_main(["average-drafters", "--out", str(tmp_path / "a"), str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "is one of the checkpoints being averaged" in capsys.readouterr().err
    assert cli_main(["average-drafters", "--out", str(tmp_path / "o"), str(tmp_path / "a"), str(tmp_path / "nope")]) == 2
    assert "no DLite checkpoint folder" in capsys.readouterr().err
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert cli_main(["average-drafters", "--out", str(tmp_path / "o"), "--weights", "1", a, "2", b]) == 2
    assert "the number '2' follows the checkpoint" in capsys.readouterr().err
    assert cli_main(["average-drafters", "--out", str(tmp_path / "o"), "--weights", a, b]) == 2
    assert "--weights needs numbers" in capsys.readouterr().err
    assert cli_main(["average-drafters", "--out", str(tmp_path / "o")]) == 2
    assert "at least 2 drafters, got 0" in capsys.readouterr().err


def test_weights_may_stand_before_or_after_the_checkpoints(tiny_target, tmp_path):
    """`--weights 0.7 0.3 A B` (the argparse trap: --weights swallows A and B) averages the same as
    `A B --weights 0.7 0.3` and `A --weights 0.7 0.3 B`, in the checkpoints' command-line order."""
    a, b = _save(tiny_target, tmp_path / "a", 0), _save(tiny_target, tmp_path / "b", 1)
    pa, pb = str(tmp_path / "a"), str(tmp_path / "b")
    outs = []
    for i, argv in enumerate([[pa, pb, "--weights", "0.7", "0.3"], ["--weights", "0.7", "0.3", pa, pb],
                              [pa, "--weights", "0.7", "0.3", pb]]):
        out = tmp_path / f"o{i}"
        assert cli_main(["average-drafters", "--out", str(out)] + argv) == 0
        outs.append(load_file(str(out / "model.safetensors")))
        rec = json.load(open(out / "training.json"))["average"]["sources"]
        assert [(r["path"], round(r["weight"], 3)) for r in rec] == [(pa, 0.7), (pb, 0.3)]
    k = next(k for k, v in a.items() if v.is_floating_point() and not torch.equal(v, b[k]))
    want = (0.7 * a[k].float() + 0.3 * b[k].float()).to(a[k].dtype)
    for got in outs:
        torch.testing.assert_close(got[k], want)


def test_the_card_of_a_soup_of_a_soup_lists_the_inner_sources_records(tiny_target, tmp_path):
    vocab = torch.arange(0, tiny_target.config.vocab_size, 3)
    for i, n in enumerate("abc"):
        _save(tiny_target, tmp_path / n, i, vocab=vocab)
    rec_b = {"format": 1, "data": {"sequences": 7, "generated_tokens": 99}, "run": {"steps": 5, "heldout_tau": {}}}
    rec_c = {"format": 1, "data": {"sequences": 11, "generated_tokens": 123}, "run": {"steps": 9, "heldout_tau": {}}}
    (tmp_path / "b" / "training.json").write_text(json.dumps(rec_b))
    (tmp_path / "c" / "training.json").write_text(json.dumps(rec_c))
    inner, outer = tmp_path / "soup1", tmp_path / "soup2"
    assert cli_main(["average-drafters", "--out", str(inner), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert cli_main(["average-drafters", "--out", str(outer), str(inner), str(tmp_path / "c")]) == 0
    t = json.load(open(outer / "training.json"))
    assert t["average"]["sources"][0]["training"]["average"]["sources"][1]["training"] == rec_b
    card = (outer / "README.md").read_text()
    assert f"### Source 1: `{inner}` (itself a weight average)" in card
    assert f"`{tmp_path / 'a'}` (0.500), `{tmp_path / 'b'}` (0.500)" in card
    assert f"#### Source 1.2: `{tmp_path / 'b'}`" in card and "- Data: 7 sequences" in card
    assert f"### Source 2: `{tmp_path / 'c'}`" in card and "- Data: 11 sequences" in card
    assert "- Data: None" not in card  # the inner average is not rendered as if it were a training run
