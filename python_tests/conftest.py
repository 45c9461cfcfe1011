"""Shared fixtures: tiny random-weight targets for most tests, the real SmolLM2 for a few."""

from __future__ import annotations

import os

import pytest
import torch

# Tiny models run fastest on one thread (and a loaded machine hurts 2-thread runs ~40x).
torch.set_num_threads(1)

TINY_VOCAB = 96


def make_tiny_llama(seed: int = 0, vocab: int = TINY_VOCAB, hidden: int = 64, layers: int = 6):
    """A random-weight Llama small enough to decode in milliseconds (fp32, CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Sharper logits than the default init, so greedy outputs vary instead of looping at once.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def tiny_dlite_config(target, **overrides):
    from sglang_dlite.config import DLiteConfig

    c = target.config
    kw = dict(
        target_hidden_size=c.hidden_size, vocab_size=c.vocab_size, target_num_layers=c.num_hidden_layers,
        num_context_positions=3, block_size=4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, rnn_rank=8,
    )
    kw.update(overrides)
    return DLiteConfig(**kw)


@pytest.fixture(scope="session")
def tiny_target():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def real_target():
    """The bundled SmolLM2-135M-Instruct (prepared once into the cache)."""
    from sglang_dlite.target import load_target

    return load_target("default")
