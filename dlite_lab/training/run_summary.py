"""What a training run produced, read back from its folder: stages finished (DONE files), the last
held-out evaluation and loss per stage, the data it trained on (the gen-data manifest), and the
``training.json`` record written beside each finished stage's ``config.json``. The trainer writes
it, the model card and the recipe's export read it."""

from __future__ import annotations

import json
import os
from typing import Optional

from dlite_lab.training.checkpoint import read_metrics
from dlite_lab.training.data import read_json, read_manifest, select_shards, shard_source
from dlite_lab.training.options import STAGES


def summarize_run(out_dir: str) -> dict:
    """Stages (DONE files), final held-out eval and loss per stage, train_info of a run folder."""
    stages = {}
    for st in STAGES:
        p = os.path.join(out_dir, st, "DONE.json")
        if os.path.isfile(p):
            with open(p) as f:
                stages[st] = json.load(f)
    recs = read_metrics(out_dir)
    s = {"stages": stages, "final_eval": {}}
    for st in stages:
        ev = [r for r in recs if r.get("stage") == st and "tau_proxy" in r]
        tr = [r for r in recs if r.get("stage") == st and "loss" in r]
        if ev:
            last = ev[-1]
            s["final_eval"][st] = {k: last[k] for k in ("tau_proxy", "acc_per_pos", "eval_anchors", "tau_ci95", "epochs")
                                   if k in last}
            s["final_eval"][st].update({k: v for k, v in last.items() if k.startswith("engine_")})
        if tr:
            s["final_eval"].setdefault(st, {})["final_loss"] = round(tr[-1]["loss"], 4)
            s["final_eval"][st]["anchors_per_s"] = tr[-1].get("anchors_per_s")
    info = read_json(os.path.join(out_dir, "train_info.json"))
    if info is not None:
        s["train_info"] = info
    return s


def summarize(out_dir: str, data_dir: str) -> dict:
    """Numbers for the model card, from the manifest, train_info, DONE files and metrics. The data
    counts are those of the shards the run trained on (``train --shards``, saved in train_info)."""
    run = summarize_run(out_dir)
    man = read_manifest(data_dir)
    selected = run.get("train_info", {}).get("options", {}).get("shards")
    shards = select_shards(man.get("shards", []), selected)
    s = {"data": {"shards": len(shards), "sequences": sum(x["num_seqs"] for x in shards),
                  "tokens": sum(x["num_tokens"] for x in shards),
                  "generated_tokens": sum(x["num_loss_tokens"] for x in shards),
                  "by_source": {}, "recipe": man.get("recipe", {}), "runs": man.get("runs", [])}}
    for x in shards:
        src = x.get("source") or shard_source(x["file"])
        d = s["data"]["by_source"].setdefault(src, {"sequences": 0, "generated_tokens": 0})
        d["sequences"] += x["num_seqs"]
        d["generated_tokens"] += x["num_loss_tokens"]
    if selected:
        s["data"]["selected"] = list(selected)
    s.update(run)
    return s


TRAINING_JSON = "training.json"


def training_record(s: dict, stage: Optional[str] = None) -> dict:
    """What ``training.json`` (beside a drafter's config.json) records, from ``summarize``:
    the data (sequences, generated tokens, prompt sources) and the run (steps, wall time, held-out
    tau with its 95 % CI) up to ``stage`` (default: the last finished one)."""
    d = s.get("data", {})
    rec = d.get("recipe", {})
    stages = s.get("stages", {})
    names = list(stages)
    if stage is not None and stage in names:
        names = names[: names.index(stage) + 1]
    last = names[-1] if names else None
    ev = s.get("final_eval", {}).get(last, {}) if last else {}
    info = s.get("train_info", {})
    opts = info.get("options", {})
    return {
        "format": 1,
        "data": {
            "sequences": d.get("sequences"), "tokens": d.get("tokens"), "generated_tokens": d.get("generated_tokens"),
            "shards": d.get("shards"), "prompt_sources": rec.get("prompts", []), "by_source": d.get("by_source", {}),
            "engine": rec.get("engine"), "decoding": rec.get("decoding"), "max_len": rec.get("max_len"),
            "max_new_tokens_per_turn": rec.get("max_new_tokens_per_turn"), "feature_layers": rec.get("feature_layers"),
            **({"selected": d["selected"]} if d.get("selected") else {}),
        },
        "run": {
            "stages": {n: {"steps": stages[n].get("steps"), "wall_s": stages[n].get("wall_s")} for n in names},
            "steps": sum(int(stages[n].get("steps") or 0) for n in names),
            "wall_s": round(sum(float(stages[n].get("wall_s") or 0.0) for n in names), 3),
            "final_stage": last,
            "epochs": ev.get("epochs"),
            "heldout_tau": {"mean": ev.get("tau_proxy"), "ci95": ev.get("tau_ci95"), "anchors": ev.get("eval_anchors"),
                            "acc_per_pos": ev.get("acc_per_pos")},
            "options": {k: opts.get(k) for k in ("lr", "batch_size", "seqs_per_batch", "anchor_tokens", "vocab_subset",
                                                 "stream_window", "bf16", "gamma", "init_layers", "init_drafter", "kl_weight", "ema_decay",
                                                 "config_overrides") if k in opts},
            "processes": info.get("processes", 1),
            # every command that wrote the run folder (a run resumed across working periods has several)
            "commands": [x.get("command") for x in info.get("invocations", [])],
        },
    }


def write_training_json(model_dir: str, record: dict) -> str:
    path = os.path.join(model_dir, TRAINING_JSON)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def read_training_json(model_dir: str) -> Optional[dict]:
    return read_json(os.path.join(model_dir, TRAINING_JSON))
