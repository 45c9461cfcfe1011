"""`sglang-dlite serve`: a thin wrapper around ``python -m sglang.launch_server`` that fills in the
default target (the bundled SmolLM2-135M-Instruct), the default DLite drafter (the shipped
checkpoint) and ``--speculative-algorithm DLITE``. Every other argument goes to sglang unchanged::

    sglang-dlite serve                                   # defaults, CUDA server on :30000
    sglang-dlite serve --model-path T --draft D -- --port 8000 --mem-fraction-static 0.8
    sglang-dlite serve --cpu -- --port 8000              # this project's CPU test stack

Agent-ready defaults: ``/metrics`` on (``--enable-metrics``; ``--no-metrics`` turns it off) and,
for the bundled target, OpenAI ``tool_calls``: ``--tool-call-parser smollm2`` (``tool_calls.py``:
hermes parsing, schema-constrained calls) with the shipped chat template
``chat_templates/smollm2_tools.jinja`` (SmolLM2's own template ignores ``tools``). A target of your
own gets no parser: pass the one that fits its chat template after ``--`` (``-- --tool-call-parser
qwen25``, or ``auto`` to let sglang detect it); without one, ``tools`` under ``tool_choice`` "auto"
are refused with a message that says so (the request guards).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoConfig

from sglang_dlite.serving.cpu_launch import ENV_THREADS_BIND, SERVER_CPU_ARGS, cpu_environ, omp_threads_bind
from sglang_dlite.model.dlite import shipped_drafter_path
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.model.bundled_target import default_target_dir, resolve_target

CPU_MALLOC_MMAP_THRESHOLD = 128 * 1024  # bytes: glibc's default start value, kept fixed
# The bundled target's tool calls: SmolLM2's <tool_call>{"name": ..., "arguments": ...}</tool_call>,
# parsed as sglang's hermes format by the plugin's `smollm2` parser (sglang's own `hermes` where the
# plugin is not loaded); the template lists the tools in the system turn in that format.
BUNDLED_TOOL_CALL_PARSER = "smollm2"
BUNDLED_TOOLS_TEMPLATE = Path(__file__).resolve().parent / "chat_templates" / "smollm2_tools.jinja"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default="default", help="target HF checkpoint folder ('default': bundled SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="DLite checkpoint folder (default: the shipped drafter)")
    p.add_argument("--no-spec", action="store_true", help="serve the target without speculation (baseline)")
    p.add_argument("--cpu", action="store_true",
                   help="run on this project's CPU stack (torch_native attention, fp32, test-only stand-ins)")
    p.add_argument("--no-metrics", action="store_true",
                   help="do not pass --enable-metrics (on by default: Prometheus text at GET /metrics)")
    p.add_argument("--dry-run", action="store_true", help="print the sglang command and exit")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="arguments passed to sglang.launch_server (after --)")


def check_plugin_enabled(environ=None) -> None:
    """sglang loads only the plugins named in SGLANG_PLUGINS (when set): DLITE needs 'dlite'."""
    environ = environ if environ is not None else os.environ
    if not _plugin_loaded(environ):
        raise DLiteConfigError(
            f"SGLANG_PLUGINS={environ.get('SGLANG_PLUGINS')!r} does not enable the 'dlite' plugin, so sglang "
            "would not know --speculative-algorithm DLITE (nor the DLite checkpoint format). Unset "
            "SGLANG_PLUGINS or add 'dlite' to it."
        )


def build_command(args) -> tuple[list, dict]:
    target = resolve_target(args.model_path)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", target]
    env = dict(os.environ)
    if not args.no_spec:
        draft = args.draft or shipped_drafter_path()
        if draft is None:
            raise DLiteInputError(
                "no DLite drafter: the shipped checkpoint (sglang_dlite/checkpoints/dlite-smollm2-135m/"
                "model.safetensors) is missing from this install. Pass --draft PATH (a DLite checkpoint "
                "folder), reinstall the package, or use --no-spec."
            )
        check_plugin_enabled()
        cmd += ["--speculative-algorithm", "DLITE", "--speculative-draft-model-path", draft]
    extra = list(args.sglang_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    cmd += agent_defaults(extra, env, bundled=_is_bundled(args.model_path, target),
                          metrics=not getattr(args, "no_metrics", False))
    if args.cpu:
        env.update(cpu_environ())
        # glibc's dynamic mmap threshold keeps freed large tensor buffers on the heap: the CPU
        # scheduler's RSS then climbs ~200 MB under varied batches and never comes back
        # (bench/soak.py). A fixed threshold returns them to the OS (RSS flat); a value the
        # caller set wins.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(CPU_MALLOC_MMAP_THRESHOLD))
        defaults, note = cpu_serving_defaults(target, extra)
        ranks = _int_flag(extra, "--tp-size", "--tensor-parallel-size") * _int_flag(extra, "--dp-size", "--data-parallel-size")
        if ranks > 1 and ENV_THREADS_BIND not in env:  # sglang asserts a core list per rank
            env[ENV_THREADS_BIND] = omp_threads_bind(ranks)
            note = (note + "; " if note else "sglang-dlite serve --cpu: ") + \
                f"{ranks} ranks on cores {env[ENV_THREADS_BIND]} (set {ENV_THREADS_BIND} to choose)"
        if note:
            print(note, file=sys.stderr, flush=True)
        cmd += defaults + SERVER_CPU_ARGS
    return cmd + extra, env


def _has_flag(args: list, name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _is_bundled(model_path, target: str) -> bool:
    if model_path in (None, "", "default"):
        return True
    return os.path.realpath(target) == os.path.realpath(default_target_dir())


def _plugin_loaded(environ) -> bool:
    """Whether sglang will load this plugin (``SGLANG_PLUGINS`` unset, or naming ``dlite``)."""
    allowed = environ.get("SGLANG_PLUGINS")
    return not allowed or "dlite" in {x.strip() for x in allowed.split(",")}


def agent_defaults(extra: list, env: dict, bundled: bool, metrics: bool = True) -> list:
    """What an agent needs from the server, unless the user's own flags after ``--`` say
    otherwise: ``--enable-metrics`` and, for the bundled target, the tool-call parser and the
    template that renders the tools."""
    out = []
    if metrics and not _has_flag(extra, "--enable-metrics"):
        out.append("--enable-metrics")
    if bundled:
        if not _has_flag(extra, "--tool-call-parser"):
            out += ["--tool-call-parser", BUNDLED_TOOL_CALL_PARSER if _plugin_loaded(env) else "hermes"]
        if not _has_flag(extra, "--chat-template"):
            out += ["--chat-template", str(BUNDLED_TOOLS_TEMPLATE)]
    return out


def _int_flag(args: list, *names: str) -> int:
    """The value of ``--name N`` / ``--name=N`` in sglang's arguments (1 when absent)."""
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                raise DLiteInputError(f"{n} {value!r}: give a whole number of ranks, e.g. {n} 2.") from None
    return 1


KV_RAM_FRACTION = 0.10  # of the machine's RAM, for the float32 KV pool of `serve --cpu`


def _machine_ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def kv_bytes_per_token(model_path: str, dtype_bytes: int = 4) -> int:
    """K and V of every layer for one token (float32 on the CPU stack)."""
    cfg = AutoConfig.from_pretrained(model_path)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def cpu_serving_defaults(target: str, extra: list, ram_bytes: "int | None" = None) -> tuple[list, str]:
    """CPU defaults a new user should not have to know: a KV pool sized to this machine (sglang's
    own CPU default takes most of free RAM: 346 k tokens / 15 GB for the bundled target on a 24 GB
    machine) and an idle scheduler that sleeps instead of polling a core. Anything the user
    passes after ``--`` wins. Returns (arguments, note to print)."""
    out, notes = [], []
    if "--max-total-tokens" not in extra and not any(a.startswith("--max-total-tokens=") for a in extra):
        ram = ram_bytes or _machine_ram_bytes()
        try:
            per_token = kv_bytes_per_token(target)
        except Exception:  # no readable config: a small, safe pool
            per_token = None
        if per_token:
            tokens = int(KV_RAM_FRACTION * ram // per_token) // 1024 * 1024
            tokens = max(4096, min(tokens, 262144))
            size = f"{tokens * per_token / 2**30:.1f} GiB float32, {per_token // 1024} KiB/token"
        else:
            tokens, size = 32768, "size unknown"
        out += ["--max-total-tokens", str(tokens)]
        notes.append(f"KV pool: {tokens} tokens ({size}; {KV_RAM_FRACTION:.0%} of this machine's "
                     f"{ram / 2**30:.0f} GiB RAM). Change it with: sglang-dlite serve --cpu -- --max-total-tokens N")
    if "--sleep-on-idle" not in extra:
        out.append("--sleep-on-idle")
        notes.append("the idle scheduler sleeps (--sleep-on-idle) instead of polling a core")
    return out, ("sglang-dlite serve --cpu: " + "; ".join(notes)) if notes else ""


def run(args) -> int:
    cmd, env = build_command(args)
    print(" ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env=env)
