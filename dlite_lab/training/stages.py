"""The DLite recipe's stages on cached target features (see train.py for the recipe):
teacher -> distill -> stabilize, each a ``loop.run_stage``; the data (sampled or streamed), the
drafter configs and the optional initialization from target layers."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

import torch

from sglang_dlite.model.config import DLiteConfig
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from dlite_lab.ablations import AblationDrafter
from sglang_dlite.model.dlite import DLiteDrafter
from dlite_lab.training import distributed as dist
from dlite_lab.training.checkpoint import plot_curves
from dlite_lab.training.data import DataError, read_json, read_manifest, select_shards
from dlite_lab.training.dataset import FeatureData
from dlite_lab.training.features import ensure_features
from dlite_lab.training.loop import Paused, run_stage
from dlite_lab.training.options import STAGES, Stage, TrainOptions
from dlite_lab.training.stream import ShardStream


def make_config(target_cfg, history: str, overrides: dict) -> DLiteConfig:
    """The drafter's config for this target: the one derivation (``DLiteConfig.for_target``: the
    target's widths, vocabulary, proportional capture layers, rank), then the trainer's options."""
    return DLiteConfig.for_target(target_cfg, **{**overrides, "history": history})


def init_from_drafter(model: DLiteDrafter, path: str) -> DLiteDrafter:
    """Start from a trained DLite checkpoint's weights (a second epoch, a fine-tune on new data): the
    checkpoint must describe this very drafter (same config but for its drafting vocabulary, which
    training does not use); the target's embedding and LM head stay the bound ones."""
    src = AblationDrafter.from_pretrained(path)  # names what is wrong with a bad folder
    mine, theirs = model.config.to_dict(), src.config.to_dict()
    diff = {k: (theirs.get(k), v) for k, v in mine.items()
            if k != "draft_vocab_size" and theirs.get(k) != v}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a!r} vs this run {b!r}" for k, (a, b) in sorted(diff.items())[:6])
        raise DLiteConfigError(f"--init-from-drafter {path!r} is a different drafter ({shown}); pass the "
                               f"options it was trained with (its config.json).")
    own = model.state_dict()
    state = {k: v for k, v in src.state_dict().items() if k in own and k != "draft_vocab"}
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].dtype))
    return model


def init_from_target_layers(model: DLiteDrafter, target, layer_ids) -> DLiteDrafter:
    """Copy the target's decoder layers ``layer_ids`` (attention, MLP and norms) into the drafter's
    backbone layers, one for one: a drafter that reads layer-12 states starts as the target's own
    next layers instead of from noise. Needs the drafter's layer shapes to equal the target's."""
    inner = getattr(target, "model", target)
    tl = inner.layers
    if len(layer_ids) != len(model.layers):
        raise DLiteConfigError(f"--init-from-target-layers names {len(layer_ids)} layers but the drafter has "
                               f"{len(model.layers)} backbone layers.")
    names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
             "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}
    with torch.no_grad():
        for mine, lid in zip(model.layers, layer_ids):
            if not 0 <= lid < len(tl):
                raise DLiteConfigError(f"--init-from-target-layers: layer {lid} is out of range for a target "
                                       f"with {len(tl)} layers (valid: 0..{len(tl) - 1}).")
            src = tl[lid]
            for a, b in names.items():
                w_dst = getattr(mine, a).weight
                w_src = src.get_submodule(b).weight
                if w_dst.shape != w_src.shape:
                    raise DLiteConfigError(
                        f"--init-from-target-layers: drafter {a} {tuple(w_dst.shape)} != target layer {lid} "
                        f"{b} {tuple(w_src.shape)}; the drafter's heads/head_dim/intermediate size must equal the target's.")
                w_dst.copy_(w_src.to(w_dst.dtype))
    return model


def this_command() -> str:
    """This process's command line, as a user would type it (``python -m sglang_dlite ...`` for the
    package's ``__main__``; torchrun's own options are not in ``sys.argv``)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    prog = "python -m sglang_dlite" if prog == "__main__.py" else prog
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def check_resume_selection(out_dir: str, opts: TrainOptions, info: dict) -> None:
    """A --resume run continues the data schedule saved in its checkpoint, the shard list included,
    so a --shards selection other than the one the folder (its train_info.json: ``info``) was trained
    with would be silently ignored: refuse it, naming both and the ways on."""
    before = info.get("options")
    if not opts.resume or before is None:  # nothing trained here yet
        return
    # a folder written before --shards existed trained on every shard
    was, now = list(before.get("shards") or []), list(opts.shards or [])
    if was != now:
        def show(specs):
            return "--shards " + " ".join(specs) if specs else "no --shards (every shard of --data)"
        raise DLiteInputError(
            f"--resume into {out_dir!r}: that run was trained with {show(was)}, this command asks for {show(now)}. "
            "A resumed run continues the shard schedule saved in its checkpoint, so the new selection would be "
            f"ignored. Resume with {show(was)}, or train the new selection into a new --out "
            f"(--init-from-drafter {os.path.join(out_dir, 'STAGE', 'model')} starts from this run's weights).")


def train_pipeline(target, data_dir: str, out_dir: str, opts: TrainOptions) -> dict:
    """Run the stages; returns {stage: model folder}. ``target``: a HF causal LM (frozen, on the
    CPU). Runs on ``opts.device``; under torchrun, as one rank of the data-parallel group."""
    dist.setup(opts.device)
    # what an earlier invocation wrote into this folder, read by every rank before rank 0 rewrites it
    before = read_json(os.path.join(out_dir, "train_info.json")) or {}
    check_resume_selection(out_dir, opts, before)
    main = dist.is_main()
    if main:
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    torch.manual_seed(opts.seed)
    opts.started_at = opts.started_at or time.time()
    tc = target.config
    student_cfg = make_config(tc, opts.student_history, opts.config_overrides)
    layer_ids = student_cfg.target_layer_ids
    shards = select_shards(read_manifest(data_dir).get("shards", []), opts.shards)
    if not shards:
        raise DataError(f"{data_dir!r} lists no finished shards; run `sglang-dlite gen-data` first.")
    if main:  # missing features are computed once, by rank 0
        ensure_features(data_dir, shards, lambda: target, layer_ids, progress=opts.progress)
    dist.barrier()
    stream_info = None
    if opts.stream_window:
        data, stream_info = _streaming_data(data_dir, shards, layer_ids, opts)
    else:
        data = FeatureData(data_dir, layer_ids, anchor_tokens=opts.anchor_tokens,
                           shard_files=[sh["file"] for sh in shards] if opts.shards else None)
    embed_w = target.get_input_embeddings().weight.detach()
    head_w = target.get_output_embeddings().weight.detach()
    stages = list(opts.stages)
    for s in stages:
        if s not in STAGES:
            raise DLiteInputError(f"unknown stage {s!r}; stages are {','.join(STAGES)}.")
    if "distill" in stages and "teacher" not in stages and not os.path.isfile(os.path.join(out_dir, "teacher", "DONE.json")):
        raise DLiteInputError("the distill stage needs a trained teacher: include 'teacher' in --stages (or train it first into the same --out).")
    st = dist.STATE
    info = {"data": data_dir, "train_sequences": len(data.train_idx), "eval_sequences": len(data.eval_idx),
            "train_anchors": data.num_train_anchors,
            "options": {k: v for k, v in opts.__dict__.items() if k != "engine_eval"},
            "processes": st.world, "device": str(st.device),
            "global_batch": {"anchors": opts.batch_size * st.world, "sequences": opts.seqs_per_batch * st.world}}
    if stream_info is not None:  # FeatureData is only the held-out view here
        info.update(stream_info, train_sequences=stream_info["streaming"]["sequences"], train_anchors=None)
    # every command that wrote the folder: a --resume run keeps the earlier ones, a fresh run starts its own list
    info["invocations"] = (list(before.get("invocations", [])) if opts.resume else []) + [
        {"command": this_command(), "processes": st.world, "started": time.strftime("%Y-%m-%d %H:%M:%S")}]
    if main:
        with open(os.path.join(out_dir, "train_info.json"), "w") as f:
            json.dump(info, f, indent=1, default=str)
        if stream_info is not None:
            sd = stream_info["streaming"]
            print(f"train: streaming {sd['shards']} shards ({sd['sequences']} sequences, {sd['generated_tokens']} generated "
                  f"tokens), window {sd['window']}; held-out: {len(data.eval_idx)} sequences of {sd['eval_shards']} shards")
        else:
            print(f"train: {len(data.train_idx)} train / {len(data.eval_idx)} held-out sequences, "
                  f"{data.num_train_anchors} training anchors")
        if st.world > 1 or st.device.type != "cpu":
            print(f"train: {st.world} process(es) on {st.device.type}, global batch {opts.batch_size * st.world} anchors "
                  f"({opts.seqs_per_batch * st.world} sequences) per step")
    done = {}
    try:
        _run_stages(stages, opts, target, student_cfg, data, out_dir, embed_w, head_w, done)
    except Paused as p:
        done["paused"] = str(p)
    if main:
        plot_curves(out_dir)
    return done


def _streaming_data(data_dir: str, shards: list, layer_ids, opts):
    """(held-out FeatureData over ``opts.eval_shards`` evenly spaced shards, with ``.stream`` the
    training ShardStream over all ``shards``; info for train_info.json). Every rank builds the same
    stream and trains on its slice of each global batch."""
    files = sorted(sh["file"] for sh in shards)
    step = max(1, len(files) // max(1, opts.eval_shards))
    data = FeatureData(data_dir, layer_ids, anchor_tokens=opts.anchor_tokens, shard_files=files[::step][:opts.eval_shards])
    data.stream = ShardStream(data_dir, layer_ids, files, window=opts.stream_window,
                              per=max(1, opts.batch_size // opts.seqs_per_batch), anchor_tokens=opts.anchor_tokens)
    gen = sum(sh["num_loss_tokens"] for sh in shards)
    info = {"streaming": {"window": opts.stream_window, "shards": len(files), "eval_shards": len(files[::step][:opts.eval_shards]),
                          "sequences": sum(sh["num_seqs"] for sh in shards), "tokens": sum(sh["num_tokens"] for sh in shards),
                          "generated_tokens": gen, "selected": opts.shards}}
    return data, info


def _finished(out_dir: str, name: str, opts: TrainOptions) -> bool:
    """The stage is done, for the number of steps this run asks (asking for another number with
    --resume extends it from its checkpoint)."""
    path = os.path.join(out_dir, name, "DONE.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("requested", opts.steps.get(name)) == opts.steps.get(name) or not opts.resume


def _run_stages(stages, opts, target, student_cfg, data, out_dir, embed_w, head_w, done: dict) -> None:
    """The stages in order, each trained or (finished before) loaded; ``done`` gets {stage: model folder}."""

    def stage(name, lr, loss, history, start, teacher=None):
        model_dir = os.path.join(out_dir, name, "model")
        if _finished(out_dir, name, opts):
            model = AblationDrafter.from_pretrained(model_dir).bind_target(embed_w, head_w).train()
        else:
            model = run_stage(Stage(name, opts.steps[name], lr, loss, history), start(), data, out_dir, opts, teacher)
        done[name] = model_dir
        return model

    def fresh(cfg, init_drafter=None):
        """A new drafter, started from --init-from-drafter or the target's --init-from-target-layers."""
        model = AblationDrafter(cfg).bind_target(embed_w, head_w)
        if init_drafter:
            init_from_drafter(model, init_drafter)
        elif opts.init_layers:
            init_from_target_layers(model, target, opts.init_layers)
        return model

    def distill_start():
        student = AblationDrafter(student_cfg).bind_target(embed_w, head_w)
        if opts.distill_init == "teacher":
            student.load_state_dict(teacher.state_dict(), strict=False)
        teacher.requires_grad_(False)
        return student

    teacher = student = None
    if "teacher" in stages or "distill" in stages:
        teacher = stage("teacher", opts.lr, "ce", "full", lambda: fresh(make_config(target.config, "full", opts.config_overrides)))
    if "distill" in stages:
        student = stage("distill", opts.lr, "kl", opts.student_history, distill_start, teacher)
    if "stabilize" in stages:
        lr = opts.lr if "distill" not in stages else opts.lr * 0.5
        stage("stabilize", lr, "ce+tv", opts.student_history,
              lambda: student if student is not None else fresh(student_cfg, opts.init_drafter))
