"""Shared helpers for the sglang tests (test_sglang_*.py): a copy-trained tiny drafter, the
reference-engine oracle. The CPU launch environment (``cpu_environ``, ``start_engine``, ...) is the
package's public ``sglang_dlite.serving.cpu_launch`` and the random-weight models are
``dlite_lab.benchmarking.random_models``, both re-exported here for the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dlite_lab.benchmarking.agent_client import free_port, stop_process_group  # noqa: F401  (tests use free_port)
from sglang_dlite.serving.cpu_launch import (  # noqa: F401  (the CPU launch environment lives in the package)
    CPU_STANDINS, activate_cpu_standins, cpu_environ, engine_kwargs, start_engine,
)
from sglang_dlite.serving.cpu_launch import cpu_engine as engine  # noqa: F401

REPO = Path(__file__).resolve().parents[1]  # the checkout (tests run from it)
from dlite_lab.benchmarking.random_models import (  # noqa: F401  (tiny random-weight targets and drafters)
    save_random_dlite, save_tiny_llama, save_tiny_qwen3,
)


def train_copy_dlite(path, target_path, steps: int = 40, seed: int = 0) -> str:
    """A tiny DLite drafter trained (seconds) to propose the anchor token at every position:
    against a "sticky" target it is accepted for runs of repeats and rejected at jumps."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_dlite.model.dlite import DLiteDrafter

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
        logits = d(ctx, valid, anchors, feedback_tokens=anchors[:, None].expand(-1, cfg.block_size))
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


def reference_results(target_path, drafter_path, prompts, max_new_tokens, eos=(), tree_nodes=None):
    """The reference engine's GenerationResults (outputs and per-round records), greedy.
    ``tree_nodes``: DLite drafts a token tree of that many nodes per round, branching along its
    greedy chain (what the sglang worker's tree rounds draft with the lookup off)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dlite_lab.reference.drafters import DLiteEngineDrafter
    from dlite_lab.reference.engine import ReferenceEngine
    from dlite_lab.reference.drafters import TreeEngineDrafter
    from sglang_dlite.model.dlite import DLiteDrafter

    key = (str(target_path), str(drafter_path), tuple(eos), tree_nodes)
    eng = _REF_ENGINES.get(key)
    if eng is None:
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
        d = DLiteDrafter.from_pretrained(drafter_path).bind_hf_target(target)
        drafter = DLiteEngineDrafter(d)
        if tree_nodes is not None:
            drafter = TreeEngineDrafter(drafter, lookup=False, num_drafts=tree_nodes, branching="chain")
        eng = _REF_ENGINES[key] = ReferenceEngine(target, drafter, eos_token_ids=eos)
    return [eng.generate(list(p), max_new_tokens) for p in prompts]


def default_target_chat_prompts(messages: list) -> tuple:
    """(bundled SmolLM2 target folder, [token ids of each user message in its chat template])."""
    from transformers import AutoTokenizer

    from sglang_dlite.model.bundled_target import prepare_default_target

    target = str(prepare_default_target(verbose=False))
    tok = AutoTokenizer.from_pretrained(target)
    return target, [list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]) for m in messages]


# ----------------------------------------------------------------------------- one real HTTP server
@dataclass
class HttpServer:
    """One ``python -m sglang.launch_server`` on 127.0.0.1 in its own process group."""

    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: object  # the server's log file (open, w+)

    @classmethod
    def launch(cls, args, log_path, env=None) -> "HttpServer":
        """Start the server with ``args`` (no --host/--port: a free port is chosen); returns at once."""
        port = free_port()
        log = open(log_path, "w+")
        cmd = [sys.executable, "-m", "sglang.launch_server", *args, "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(cmd, env=env or dict(os.environ, **cpu_environ()), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # stop() ends the group
        return cls(f"http://127.0.0.1:{port}", proc, log)

    def wait_ready(self, deadline: float) -> "HttpServer":
        """Until ``/health`` answers; fails the test (server stopped, log tail) if it exits or by ``deadline``."""
        import pytest
        import requests

        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail("server exited:\n" + self.log_tail())
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail("server did not come up in time:\n" + self.log_tail())

    def stop(self) -> None:
        stop_process_group(self.proc)

    def log_tail(self, n: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:]


def start_dlite_http_server(workdir, extra_args=(), timeout: float = 600) -> HttpServer:
    """The DLITE server on the real default target (SmolLM2-135M-Instruct, fp32, CPU) with the
    shipped drafter (a random one where none is shipped); returns once ``/health`` answers
    (start-up is ~30 s alone, minutes on a shared 2-core machine)."""
    from sglang_dlite.model.dlite import shipped_drafter_path
    from sglang_dlite.model.bundled_target import prepare_default_target

    target = str(prepare_default_target(verbose=False))
    draft = shipped_drafter_path() or save_random_dlite(os.path.join(workdir, "d"), target)
    args = ["--model-path", target, "--speculative-algorithm", "DLITE", "--speculative-draft-model-path", draft,
            "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--dtype", "float32", "--disable-cuda-graph", "--max-total-tokens", "8192",
            "--max-running-requests", "8", "--skip-server-warmup", "--log-level", "warning", *extra_args]
    srv = HttpServer.launch(args, os.path.join(workdir, "server.log"))
    return srv.wait_ready(time.time() + timeout)
