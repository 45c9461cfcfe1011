"""Shared helpers for the sglang tests (test_sglang_*.py): a copy-trained tiny drafter, the
reference-engine oracle. The CPU launch environment (``cpu_environ``, ``start_engine``, ...) is the
package's public ``sglang_dlite.cpu_launch`` and the random-weight models are
``sglang_dlite.benchmarking.random_models``, both re-exported here for the tests.
"""

from __future__ import annotations

from sglang_dlite.cpu_launch import (  # noqa: F401  (the CPU launch environment lives in the package)
    CPU_STANDINS, REPO, activate_cpu_standins, cpu_environ, engine_kwargs, start_engine,
)
from sglang_dlite.cpu_launch import cpu_engine as engine  # noqa: F401
from sglang_dlite.benchmarking.random_models import (  # noqa: F401  (tiny random-weight targets and drafters)
    save_random_dlite, save_tiny_llama, save_tiny_qwen3,
)


def train_copy_dlite(path, target_path, steps: int = 40, seed: int = 0) -> str:
    """A tiny DLite drafter trained (seconds) to propose the anchor token at every position:
    against a "sticky" target it is accepted for runs of repeats and rejected at jumps."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_dlite.model import DLiteDrafter

    save_random_dlite(path, target_path, seed=seed)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    d = DLiteDrafter.from_pretrained(path).bind_hf_target(target)
    cfg = d.config
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    d.train()
    for _ in range(steps):
        anchors = torch.randint(0, cfg.vocab_size, (32,), generator=g)
        ctx = torch.randn(32, cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size, generator=g)
        valid = torch.rand(32, cfg.num_context_positions, generator=g) > 0.2
        logits = d(ctx, valid, anchors)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), anchors[:, None].expand(-1, cfg.block_size).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.eval()
    d.save_pretrained(path)
    return str(path)


_REF_ENGINES: dict = {}


def reference_greedy(target_path, drafter_path, prompts, max_new_tokens, eos=()):
    """The HF reference engine's greedy outputs (the correctness oracle) for token-id prompts.
    One reference engine per (target, drafter) is kept for the process."""
    return [r.output_ids for r in reference_results(target_path, drafter_path, prompts, max_new_tokens, eos)]


def reference_results(target_path, drafter_path, prompts, max_new_tokens, eos=()):
    """The reference engine's GenerationResults (outputs and per-round records), greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_dlite.drafters import DLiteEngineDrafter
    from sglang_dlite.engine import ReferenceEngine
    from sglang_dlite.model import DLiteDrafter

    key = (str(target_path), str(drafter_path), tuple(eos))
    eng = _REF_ENGINES.get(key)
    if eng is None:
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
        d = DLiteDrafter.from_pretrained(drafter_path).bind_hf_target(target)
        eng = _REF_ENGINES[key] = ReferenceEngine(target, DLiteEngineDrafter(d), eos_token_ids=eos)
    return [eng.generate(list(p), max_new_tokens) for p in prompts]


def default_target_chat_prompts(messages: list) -> tuple:
    """(bundled SmolLM2 target folder, [token ids of each user message in its chat template])."""
    from transformers import AutoTokenizer

    from sglang_dlite.target import prepare_default_target

    target = str(prepare_default_target(verbose=False))
    tok = AutoTokenizer.from_pretrained(target)
    return target, [list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]) for m in messages]
