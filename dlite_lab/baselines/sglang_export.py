"""Export the EAGLE-3 baseline to the checkpoint format sglang's EAGLE3 worker reads.

    python -m dlite_lab.baselines.sglang_export [--src CKPT] --dst DIR [--target TARGET]
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path DIR --speculative-eagle-topk 1 \\
        --speculative-num-steps 6 --speculative-num-draft-tokens 7

The baseline (``eagle3.py``) is EAGLE-3's draft layer, so the export only renames weights into the
layout of the EAGLE-3 reference checkpoints (``fc``, ``midlayer.*``, ``norm``; sglang's
``LlamaForCausalLMEagle3.load_weights`` reads it) and writes a ``LlamaForCausalLMEagle3`` config:

    ours                       sglang / EAGLE-3
    fc                         fc                         Linear(3H -> H) over the captured layers
    embed_norm                 midlayer.input_layernorm   norm of the token embedding
    feat_norm                  midlayer.hidden_norm       norm of the fused feature
    attn.{q,k,v,o}_proj        midlayer.self_attn.*       q/k/v read [embed ; feature] (2H)
    post_norm                  midlayer.post_attention_layernorm
    mlp.{gate,up,down}_proj    midlayer.mlp.*
    final_norm                 norm                       before the LM head

The token embedding and the LM head are the target's (``tie_word_embeddings: false`` with no
``draft_vocab_size``: sglang binds both from the target, as the baseline does), so the export holds
the draft layer only. The capture layers go to ``eagle_config.eagle_aux_hidden_state_layer_ids``
(sglang captures the output of layer l, the baseline's ``hidden_states[l + 1]``), and the drafter's
own RoPE base (not the target's) to ``rope_theta``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.bundled_target import resolve_target
from dlite_lab.baselines.eagle3 import Eagle3Drafter
from dlite_lab.baselines.export import staged_folder
from dlite_lab.baselines.registry import shipped_checkpoint

KEY_MAP = {
    "fc.weight": "fc.weight",
    "embed_norm.weight": "midlayer.input_layernorm.weight",
    "feat_norm.weight": "midlayer.hidden_norm.weight",
    "attn.q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "attn.k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "attn.v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "attn.o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_norm.weight": "midlayer.post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "mlp.up_proj.weight": "midlayer.mlp.up_proj.weight",
    "mlp.down_proj.weight": "midlayer.mlp.down_proj.weight",
    "final_norm.weight": "norm.weight",
}


def sglang_eagle3_config(cfg, target_config: dict) -> dict:
    """The ``config.json`` of the exported draft model (a Llama config sglang's EAGLE3 class reads)."""
    ids = list(cfg.target_layer_ids)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.target_hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": target_config.get("max_position_embeddings", 8192),
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "draft_vocab_size": None,  # the target's LM head, whole vocabulary (sglang reads the key: it must exist)
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }


def export_sglang_eagle3(src: Optional[str], dst: str, target: Optional[str] = None,
                         dtype: torch.dtype = torch.bfloat16) -> str:
    """Write ``dst/config.json`` + ``dst/model.safetensors`` from an EAGLE-3 baseline checkpoint
    (``src``; None = the shipped one) for the target folder ``target`` (None = the bundled one)."""
    src = src or shipped_checkpoint("eagle3")
    cfg_path = os.path.join(src, "config.json")
    try:
        with open(cfg_path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as exc:
        raise DLiteConfigError(f"{src!r} is not a drafter checkpoint ({cfg_path}: {exc}).") from None
    if model_type != "dlite-eagle3":
        raise DLiteConfigError(f"{src!r} holds a {model_type!r} drafter; the sglang EAGLE3 export takes the "
                               "EAGLE-3 baseline (model_type 'dlite-eagle3', `--drafter-type eagle3` in training).")
    model = Eagle3Drafter.from_pretrained(src)
    target_dir = resolve_target(target)
    with open(os.path.join(target_dir, "config.json")) as f:
        target_config = json.load(f)
    cfg = model.config
    cfg.check_target(hidden_size=target_config["hidden_size"], vocab_size=target_config["vocab_size"],
                     num_layers=target_config["num_hidden_layers"])
    state = {k: v for k, v in model.state_dict().items() if k in KEY_MAP}
    missing = sorted(set(KEY_MAP) - set(state))
    if missing:
        raise DLiteConfigError(f"{src!r} lacks EAGLE-3 weights {missing}: not a complete EAGLE-3 baseline.")
    with staged_folder(dst) as tmp:
        save_file({KEY_MAP[k]: v.to(dtype).contiguous() for k, v in state.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(sglang_eagle3_config(cfg, target_config), f, indent=2)
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=None, help="an EAGLE-3 baseline checkpoint folder (default: the shipped one)")
    ap.add_argument("--dst", required=True, help="the folder to write (config.json + model.safetensors)")
    ap.add_argument("--target", default=None, help="the target folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args(argv)
    out = export_sglang_eagle3(a.src, a.dst, a.target, getattr(torch, a.dtype))
    size = os.path.getsize(os.path.join(out, "model.safetensors")) / 2 ** 20
    print(f"wrote {out} ({size:.1f} MiB): --speculative-algorithm EAGLE3 --speculative-draft-model-path {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
