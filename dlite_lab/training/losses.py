"""The training losses (CE, TV, KL over the K draft positions) live in ``sglang_dlite/model/losses.py``,
product-side, so the online learner (``sglang_dlite/drafting/online.py``) uses the very same stabilize-stage
loss; this name stays for the trainer and the baselines."""

from sglang_dlite.model.losses import _weighted_mean, forward_kl, kl_to_target, position_weights, tv_distance, weighted_ce  # noqa: F401
