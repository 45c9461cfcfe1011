"""Shared fixtures: tiny random-weight targets for most tests, the real SmolLM2 for a few."""

from __future__ import annotations

import pytest
import torch

# Tiny models run fastest on one thread (and a loaded machine hurts 2-thread runs ~40x).
torch.set_num_threads(1)

TINY_VOCAB = 96


def make_tiny_llama(seed: int = 0, vocab: int = TINY_VOCAB, hidden: int = 64, layers: int = 6):
    """A random-weight Llama small enough to decode in milliseconds (fp32, CPU, tied embeddings)."""
    from dlite_lab.benchmarking.random_models import tiny_llama

    model = tiny_llama(seed, vocab, hidden, layers, tied=True, max_positions=512)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def write_greedy_feature_shards(target, out_dir, layers, *, shards: int, seqs_per_shard: int, new_tokens: int,
                                prompt_len: int = 6) -> list[dict]:
    """A training data folder from a tiny target: ``shards`` shards of ``seqs_per_shard`` random
    prompts + ``new_tokens`` greedy tokens each (loss mask on the generated ones), their features
    at ``layers``, and the manifest. Returns the shard infos."""
    import numpy as np

    from dlite_lab.training.data import save_shard, write_manifest
    from dlite_lab.training.features import compute_features, save_features

    infos = []
    for k in range(shards):
        seqs, masks = [], []
        for _ in range(seqs_per_shard):
            prompt = torch.randint(3, target.config.vocab_size, (1, prompt_len))
            with torch.no_grad():
                out = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0)
            seqs.append(out[0].tolist())
            masks.append([0] * prompt_len + [1] * new_tokens)
        f = str(out_dir / f"tiny_{k:05d}.npz")
        infos.append(save_shard(f, seqs, masks))
        off = np.cumsum([0] + [len(s) for s in seqs])
        save_features(f, compute_features(target, seqs, layers), off, layers, target.config.hidden_size)
    write_manifest(str(out_dir), {"recipe": {"target": "tiny"}, "shards": infos})
    return infos


def tiny_dlite_config(target, **overrides):
    from sglang_dlite.model.config import DLiteConfig

    c = target.config
    kw = dict(
        target_hidden_size=c.hidden_size, vocab_size=c.vocab_size, target_num_layers=c.num_hidden_layers,
        num_context_positions=3, block_size=4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, rnn_rank=8,
    )
    kw.update(overrides)
    return DLiteConfig(**kw)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models: one torch thread is much faster than two on a loaded CPU; restored after each
    test (benchmark mains called by tests set their own)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def ops_auto():
    """Every test starts with the ops in ``auto`` mode and leaves them so (``ops.set_ops_mode``)."""
    from sglang_dlite import ops

    ops.set_ops_mode("auto")
    yield
    ops.set_ops_mode("auto")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A random-weight Llama with SmolLM2's vocabulary and chat template, saved as a HF folder."""
    from transformers import AutoTokenizer

    from sglang_dlite.model.bundled_target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("default"))
    model = make_tiny_llama(seed=3, vocab=len(tok), hidden=64, layers=6)
    model.config.eos_token_id = tok.eos_token_id
    d = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_target():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def sticky_llama_and_copy_dlite(tmp_path_factory):
    """(tiny "sticky" Llama target folder, a copy-trained DLite folder for it): the sglang engine
    tests' pair (test_sglang_lossless, test_sglang_parallel), saved and trained once per session."""
    import sglang_fixtures as F

    d = tmp_path_factory.mktemp("sticky_llama")
    target = F.save_tiny_llama(d / "target")
    return target, F.train_copy_dlite(d / "drafter", target)


@pytest.fixture(scope="module")
def dlite_http_server(tmp_path_factory):
    """One real DLITE HTTP server (SmolLM2, CPU, metrics on, sleep on idle) per test module that
    asks for it (test_sglang_guards, test_sglang_server: one fixture, one way to start it).

    Module, not session scope: sglang's ``Engine.shutdown`` kills every child process of the
    pytest process (``kill_process_tree(os.getpid(), include_parent=False)``), so a server
    started before an in-process engine test module is gone after it."""
    pytest.importorskip("requests")
    import sglang_fixtures as F

    srv = F.start_dlite_http_server(str(tmp_path_factory.mktemp("dlite_http_server")),
                                    extra_args=("--sleep-on-idle", "--enable-metrics"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def real_target():
    """The bundled SmolLM2-135M-Instruct (prepared once into the cache)."""
    from sglang_dlite.model.bundled_target import load_target

    return load_target("default")
