"""Any target (issue 17 item 1): the drafter config is derived from the target in one function
(``config.drafter_config_for_target``), unsupported architectures are refused with the list of
supported ones, and tiny random Llama and Qwen3 targets go through the whole pipeline with no
code edit: gen-data (hf engine) -> train -> export -> reference engine (lossless greedy) ->
sglang DLITE on the CPU stack (output == the target's own greedy output).
"""

from __future__ import annotations

import json
import os

import pytest

from sglang_dlite.model.config import (
    SUPPORTED_TARGET_ARCHITECTURES, DLiteConfig, proportional_layer_ids, drafter_config_for_target,
    low_mid_high_layer_ids, target_info,
)
from sglang_dlite.errors import DLiteConfigError

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, vocab_size=49152,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536)


def _hf_config(arch: str, **kw):
    import transformers

    from dlite_lab.training.tiny_target import ARCHS

    cfg_name, model_name, extra = ARCHS[arch]
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2)
    base.update(extra)
    base.update(kw)
    return getattr(transformers, cfg_name)(architectures=[model_name], **base)


# ---------------------------------------------------------------------------- derivation
def test_bundled_target_derives_exactly_the_shipped_drafter_shape():
    """SmolLM2-135M's derived config is the DLiteConfig defaults the shipped drafter was built with."""
    got, want = drafter_config_for_target(SMOLLM2).to_dict(), DLiteConfig().to_dict()
    got.pop("target_model_type")
    want.pop("target_model_type")
    assert got == want


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_supported_architecture_sizes_the_drafter_from_the_target(arch):
    # Qwen3-4B-like widths: head_dim 128 with 32 heads != hidden / heads (the target's head_dim wins)
    kw = dict(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, intermediate_size=9728,
              num_hidden_layers=36, vocab_size=151936)
    if arch == "qwen3":
        kw["head_dim"] = 128
    cfg = _hf_config(arch, **kw)
    c = drafter_config_for_target(cfg)
    assert (c.target_hidden_size, c.vocab_size, c.target_num_layers) == (2560, 151936, 36)
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size) == (32, 8, 9728)
    assert c.head_dim == (128 if arch == "qwen3" else 80)
    assert c.rnn_rank == 320  # hidden / 8: the method's rank for Qwen3-4B
    assert c.target_layer_ids == [2, 18, 33]  # low / mid / high (DLiteConfig.default_layer_ids) for 36 layers
    assert c.target_model_type == target_info(cfg).model_type == SUPPORTED_TARGET_ARCHITECTURES[target_info(cfg).architecture]
    assert c.history == "none"


@pytest.mark.parametrize("name", ["eagle3", "dflash", "dspark", "dlite-window128"])
def test_baselines_are_sized_by_the_same_derivation(name):
    """The baselines' configs come from the same DrafterConfig.for_target: the target's width,
    each drafter's own default layers; an unsupported target is refused the same way."""
    import transformers

    from dlite_lab.baselines.registry import new_model

    cfg = _hf_config("qwen3", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     intermediate_size=512, num_hidden_layers=12)
    c = new_model(name, cfg).config
    assert (c.target_hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (256, 8, 2, 32, 512)
    assert c.target_layer_ids == type(c).default_layer_ids(12) and max(c.target_layer_ids) <= 10
    with pytest.raises(DLiteConfigError, match="Qwen3ForCausalLM"):
        new_model(name, transformers.GemmaConfig(architectures=["GemmaForCausalLM"]))


def test_overrides_win_and_history_is_passed():
    c = drafter_config_for_target(SMOLLM2, history="full", target_layer_ids=[2, 15, 27], rnn_rank=16, num_layers=None)
    assert (c.history, c.target_layer_ids, c.rnn_rank, c.num_layers) == ("full", [2, 15, 27], 16, 3)


def test_derivation_from_a_folder_a_model_and_a_config_agree(tmp_path):
    import transformers

    from dlite_lab.training.tiny_target import save_tiny_target

    path = save_tiny_target(tmp_path / "t", "qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    a = drafter_config_for_target(path).to_dict()
    assert a == drafter_config_for_target(model).to_dict() == drafter_config_for_target(model.config).to_dict()
    assert (a["head_dim"], a["num_heads"], a["num_kv_heads"]) == (16, 4, 2)


@pytest.mark.parametrize("n", range(2, 97))
def test_layer_choices_are_capturable_by_sglang(n):
    """Both layer choices stay inside 0..N-2 (sglang never captures the last layer's output),
    sorted and distinct, for every depth."""
    for ids in (proportional_layer_ids(n), low_mid_high_layer_ids(n)):
        assert ids and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] <= n - 2, (n, ids)
    if n >= 6:
        assert low_mid_high_layer_ids(n) == sorted({2, n // 2, n - 3})


def test_known_layer_choices():
    assert proportional_layer_ids(36) == [12, 14] and proportional_layer_ids(30) == [10, 12]
    assert low_mid_high_layer_ids(30) == [2, 15, 27]  # the shipped drafter's layers


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("cfg_name,arch", [("GemmaConfig", "GemmaForCausalLM"), ("MambaConfig", "MambaForCausalLM"),
                                           ("GPT2Config", "GPT2LMHeadModel")])
def test_unsupported_architectures_are_refused_naming_the_supported_ones(cfg_name, arch):
    import transformers

    with pytest.raises(DLiteConfigError) as e:
        drafter_config_for_target(getattr(transformers, cfg_name)(architectures=[arch]))
    msg = str(e.value)
    assert arch in msg and all(a in msg for a in SUPPORTED_TARGET_ARCHITECTURES)


def test_every_command_refuses_an_unsupported_target_folder(tmp_path, capsys):
    """gen-data / train / train-default / serve all resolve their target through
    target.resolve_target: an unsupported checkpoint folder fails there, before any work."""
    import transformers

    from sglang_dlite.cli import main

    bad = tmp_path / "gpt2"
    transformers.GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=32, n_head=2).save_pretrained(bad)
    for argv in (["gen-data", "--target", str(bad), "--prompts", "stdlib:1", "--out", str(tmp_path / "d")],
                 ["train", "--target", str(bad), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")],
                 ["train-default", "--target", str(bad), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")],
                 ["serve", "--model-path", str(bad), "--draft", str(tmp_path), "--dry-run"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "unsupported target architecture GPT2LMHeadModel" in err and "Qwen3ForCausalLM" in err, (argv, err)


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pipeline(request, tmp_path_factory):
    """gen-data (hf engine) -> train (single-stage, 1 process) -> export, through the CLI."""
    from sglang_dlite.cli import main
    from dlite_lab.training import smoke
    from dlite_lab.training.recipe import export
    from dlite_lab.training.tiny_target import save_tiny_target

    arch = request.param
    d = tmp_path_factory.mktemp(f"any_{arch}")
    target = save_tiny_target(d / "target", arch)
    prompts = smoke.write_prompts(str(d / "prompts.jsonl"), 8)
    assert main(smoke.gen_data_argv(target, prompts, str(d / "data"))) == 0
    assert main(smoke.train_argv(target, str(d / "data"), str(d / "run"), steps=30)) == 0
    drafter = export(str(d / "run" / "stabilize" / "model"), str(d / "drafter"), "# tiny\n")
    return arch, target, drafter, str(d / "data")


def test_gen_data_captured_the_derived_layers(pipeline):
    arch, target, drafter, data = pipeline
    with open(os.path.join(data, "manifest.json")) as f:
        man = json.load(f)
    assert man["recipe"]["feature_layers"] == low_mid_high_layer_ids(6) == [2, 3]
    cfg = DLiteConfig.from_pretrained(drafter)
    assert cfg.target_layer_ids == [2, 3] and cfg.target_model_type == arch
    assert sum(s["num_loss_tokens"] for s in man["shards"]) == 8 * 24  # every turn ran to its budget


def test_reference_engine_is_lossless_with_the_trained_drafter(pipeline):
    from dlite_lab.training.smoke import check_lossless

    arch, target, drafter, _ = pipeline
    r = check_lossless(target, drafter, n_prompts=2, max_new_tokens=32)
    assert r["identical"], (r["outputs"], r["target"])
    assert r["tau"] > 1.2, r["tau"]  # the trained drafter is accepted (the target cycles)


@pytest.mark.parametrize("pipeline", ["qwen3"], indirect=True)
def test_train_default_recipe_runs_on_any_target(pipeline, tmp_path):
    """`train-default` on a Qwen3 target (on the pipeline's data, a few seconds of training): the
    recipe's low/mid/high layers for its depth, an export named after the target, a model card
    rendered from the drafter's own config."""
    from sglang_dlite.cli import main

    arch, target, _, data = pipeline
    out = tmp_path / "run"
    assert main(["train-default", "--target", target, "--data", data, "--out", str(out), "--skip-gen", "--single-stage",
                 "--stage-budget-min", "0.05", "--draft-vocab", "64", "--threads", "1", "--no-progress"]) == 0
    dest = tmp_path / "run-single-stage" / "dlite-target"
    cfg = DLiteConfig.from_pretrained(str(dest))
    assert cfg.target_layer_ids == low_mid_high_layer_ids(6) == [2, 3] and cfg.draft_vocab_size == 64
    card = (dest / "README.md").read_text()
    assert card.startswith("# DLite drafter for target (`dlite-target`)")
    assert f"K = {cfg.block_size} draft positions" in card and f"r = {cfg.rnn_rank} fed the previous draft token" in card and "layers 2, 3" in card


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_reference_engine_is_lossless_on_the_other_architectures(arch, tmp_path):
    """Mistral and Qwen2 (attention biases) targets: the derived random drafter in the reference
    engine gives the target's own greedy output (hidden-state capture works for them)."""
    import torch

    from sglang_dlite.model.dlite import DLiteDrafter
    from dlite_lab.training.smoke import check_lossless
    from dlite_lab.training.tiny_target import save_tiny_target

    target = save_tiny_target(tmp_path / arch, arch)
    torch.manual_seed(0)
    DLiteDrafter(drafter_config_for_target(target)).save_pretrained(str(tmp_path / "drafter"))
    r = check_lossless(target, str(tmp_path / "drafter"), n_prompts=2, max_new_tokens=24)
    assert r["identical"], (r["outputs"], r["target"])


def test_sglang_dlite_serves_the_trained_drafter_losslessly(pipeline):
    """The exported drafter in a real sglang engine on the CPU stack (DLITE, greedy, fp32): output
    == the target's own greedy output, with drafts accepted."""
    import sglang_fixtures as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dlite_lab.training.smoke import chat_prompts, target_greedy

    arch, target, drafter, _ = pipeline
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), 2)
    want = target_greedy(AutoModelForCausalLM.from_pretrained(target, dtype="float32").eval(), prompts, 32)
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == want
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) < 2 * 32  # drafts were accepted


def test_sglang_qwen2_target_captures_through_the_eagle3_setter(tmp_path):
    """sglang's Qwen2 model has no DFlash capture setter: the DLITE worker uses its EAGLE-3 one
    (same layer outputs for explicit ids). Random drafter: output == the target's greedy output."""
    import sglang_fixtures as F
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dlite.model.dlite import DLiteDrafter
    from dlite_lab.training.smoke import chat_prompts, target_greedy
    from dlite_lab.training.tiny_target import save_tiny_target

    target = save_tiny_target(tmp_path / "qwen2", "qwen2")
    torch.manual_seed(0)
    DLiteDrafter(drafter_config_for_target(target, block_size=4)).save_pretrained(str(tmp_path / "drafter"))
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), 2)
    want = target_greedy(AutoModelForCausalLM.from_pretrained(target, dtype="float32").eval(), prompts, 24)
    with F.engine(target, dlite=str(tmp_path / "drafter"), skip_tokenizer_init=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == want
