"""What every drafter here shares about its target: the frozen token embedding and LM head are the
target's own, bound at load time and never saved with the drafter; checkpoints are
config.json + model.safetensors.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sglang_dlite.errors import DLiteConfigError

WEIGHTS_NAME = "model.safetensors"


class TargetBoundMixin:
    """The one target binding of every drafter here (DLite and the baselines): for an ``nn.Module``
    with ``self.config`` (vocab_size, target_hidden_size, check_target) and a ``config_class``."""

    config_class = None  # the drafter's config class (its model_type names its checkpoints)

    def _init_target_buffers(self) -> None:
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)

    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        """Attach the target's (frozen) token embedding and LM head. Validates the shapes."""
        V, H = self.config.vocab_size, self.config.target_hidden_size
        for name, w in (("token embedding", embed_weight), ("LM head", lm_head_weight)):
            if tuple(w.shape) != (V, H):
                raise DLiteConfigError(
                    f"the target's {name} has shape {tuple(w.shape)} but this {self.config.model_type} "
                    f"drafter expects ({V}, {H}) (vocab_size, target_hidden_size): it was built for another target."
                )
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
        return self

    def bind_hf_target(self, target):
        """Validate against a transformers causal LM and bind its embedding and LM head."""
        tc = target.config
        self.config.check_target(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                                 num_layers=tc.num_hidden_layers)
        return self.bind_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)

    def _check_bound(self) -> None:
        if self.embed_weight.numel() == 0:
            raise DLiteConfigError(
                f"the {self.config.model_type} drafter has no target embedding/LM head bound; call "
                "bind_target() or bind_hf_target() first (they are the target's own, frozen, and not "
                "stored in the drafter checkpoint)."
            )

    @classmethod
    def from_config_and_state(cls, config, state, dtype=torch.float32, device="cpu", source: Optional[str] = None):
        """A model of this class built from (config, state dict), checked to fit exactly."""
        model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            where = f"at {source!r} " if source else ""
            raise DLiteConfigError(
                f"the checkpoint {where}does not fit a {config.model_type} drafter with its own config "
                f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})."
            )
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device="cpu"):
        """A drafter of this class from a checkpoint folder (config.json + model.safetensors)."""
        config, state = load_checkpoint(path, cls.config_class)
        return cls.from_config_and_state(config, state, dtype=dtype, device=device, source=path)

    def save_pretrained(self, path: str, dtype: Optional[torch.dtype] = None) -> None:
        os.makedirs(path, exist_ok=True)
        self.config.save_pretrained(path)
        # only floating tensors take ``dtype``: integer buffers (token ids) stay exact
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, WEIGHTS_NAME),
                  metadata={"format": "pt", "model_type": self.config.model_type})


def read_checkpoint_config(path: str) -> dict:
    """A checkpoint folder's config.json as a dict (the one reader of it: loading, the serving
    launcher's checks, the lab's drafter registry), with errors that name what is wrong."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise DLiteConfigError(f"{path!r} is not a drafter checkpoint folder (no config.json).")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise DLiteConfigError(f"{cfg_file!r} is not valid JSON ({exc}).") from exc
    if not isinstance(raw, dict):
        raise DLiteConfigError(f"{cfg_file!r} holds {type(raw).__name__}, not a JSON object of settings.")
    return raw


def load_checkpoint(path: str, config_class):
    """Read and validate (config, state dict) from a drafter checkpoint folder of
    ``config_class.model_type``, with errors that name what is wrong."""
    want = config_class.model_type
    name = "DLite" if want == "dlite" else repr(want)
    if not os.path.isdir(path):
        raise DLiteConfigError(f"no {name} checkpoint folder at {path!r}.")
    w_file = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(os.path.join(path, "config.json")) or not os.path.isfile(w_file):
        raise DLiteConfigError(f"{path!r} is not a {name} checkpoint: it needs config.json and {WEIGHTS_NAME}.")
    raw = read_checkpoint_config(path)
    if raw.get("model_type") != want:
        raise DLiteConfigError(
            f"{path!r} holds a {raw.get('model_type')!r} model, not a {name} drafter (model_type {want!r})."
        )
    raw.pop("model_type", None)
    config = config_class(**raw)
    try:
        state = load_file(w_file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise DLiteConfigError(f"{w_file!r} is not a readable safetensors file ({exc}).") from exc
    return config, state
