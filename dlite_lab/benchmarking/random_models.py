"""Random-weight models, saved as HF checkpoints: tiny Llama / Qwen3 targets and a DLite drafter
for any target. ``bench/e2e.py`` and ``bench/gpu_check_sglang.py`` use a random drafter where no
trained one is shipped (speed only: tau ~1); the sglang tests use all three.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from sglang_dlite.model.config import DLiteConfig
from dlite_lab.ablations import build_drafter


def tiny_llama(seed: int = 0, vocab: int = 96, hidden: int = 64, layers: int = 6, *, tied: bool = False,
               max_positions: int = 2048, sticky=None, arch: str = "llama"):
    """A random-weight Llama (``arch="qwen3"``: a Qwen3, head_dim 16) (fp32, eval) with sharp logits
    (embedding ~ N(0, 1)), so that greedy outputs vary instead of looping at once. ``sticky``: an
    untied LM head = sticky * embedding + noise, whose greedy output mixes runs of repeated tokens
    with jumps."""
    torch.manual_seed(seed)
    qwen3 = arch == "qwen3"
    cfg = (Qwen3Config if qwen3 else LlamaConfig)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **({"head_dim": 16} if qwen3 else {}),
    )
    m = (Qwen3ForCausalLM if qwen3 else LlamaForCausalLM)(cfg).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight.normal_(0, 1.0)
        if sticky is not None:
            m.lm_head.weight.copy_(sticky * m.model.embed_tokens.weight + torch.randn_like(m.lm_head.weight))
    return m


def save_tiny_llama(path, seed: int = 0, vocab: int = 96, hidden: int = 64, layers: int = 6,
                    sticky: float = 0.3) -> str:
    """A "sticky" tiny Llama saved at ``path``: a copy-trained drafter is then accepted partially,
    which exercises every accept length in the sglang worker."""
    tiny_llama(seed, vocab, hidden, layers, sticky=sticky).save_pretrained(path)
    return str(path)


def save_tiny_qwen3(path, seed: int = 0, vocab: int = 96, hidden: int = 64, layers: int = 6) -> str:
    tiny_llama(seed, vocab, hidden, layers, sticky=1.0, arch="qwen3").save_pretrained(path)
    return str(path)


def save_random_dlite(path, target_path, seed: int = 0, **overrides) -> str:
    """A random-weight DLite drafter for the target at target_path (config from its config.json)."""
    tc = AutoConfig.from_pretrained(target_path)
    kw = dict(target_hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
              target_num_layers=tc.num_hidden_layers)
    if tc.hidden_size < 256:  # tiny test target: a tiny drafter
        kw.update(num_context_positions=3, block_size=4, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, rnn_rank=8)
    kw.update(overrides)
    torch.manual_seed(seed)
    build_drafter(DLiteConfig(**kw)).save_pretrained(str(path))
    return str(path)
