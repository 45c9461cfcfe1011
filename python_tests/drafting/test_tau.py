"""τ, the acceptance length (sglang_dlite/drafting/tau.py): the formula on hand values, one function for
the whole project (a source scan of sglang_dlite/ and bench/), and bench/e2e.py's two engines
reporting the same τ for the same run."""

from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dlite_lab.reference.drafters import OracleDrafter
from dlite_lab.reference.engine import GenerationResult, ReferenceEngine, RoundRecord
from sglang_dlite.drafting import tau as T

ROOT = Path(__file__).resolve().parents[2]


def _round(a: int) -> RoundRecord:
    return RoundRecord(draft_tokens=[0] * 7, accepted=a, context_len=10, draft_ms=0.0, verify_ms=0.0)


# ---------------------------------------------------------------------------- the formula
def test_tau_formula_on_hand_values():
    assert T.tau(10, 4) == 2.5 and T.tau(0, 3) == 0.0
    assert T.tau(10, 0) is None  # no verify round: undefined, not 0 and not the output length
    # 4 rounds accepting 0, 3, 1, 7 drafts commit 1 + 4 + 2 + 8 = 15 tokens: τ = 15 / 4
    assert T.committed_per_round([0, 3, 1, 7]) == [1, 4, 2, 8]
    assert T.tau_of_rounds([0, 3, 1, 7]) == 3.75
    assert T.tau_of_rounds([0, 0, 0]) == 1.0  # speculation did nothing: τ = 1
    assert T.tau_of_rounds([]) is None
    # the same request from its totals: 16 output tokens (the prefill's + 15) in 4 rounds
    assert T.tau_of_requests([(16, 4)]) == 3.75
    # the prefill's token is not counted: a request that stopped at its first token has no round
    assert T.tau_of_requests([(1, 0)]) is None and T.tau_of_requests([(1, 0), (9, 4)]) == 2.0
    # a round past the stop: accepted 7 in the last round, but only 3 of its 8 tokens were returned
    # (EOS / token limit): 1 + 2 + 3 = 6 committed after the prefill's token, output 7 tokens
    assert T.committed_per_round([0, 1, 7], output_tokens=7) == [1, 2, 3]
    assert T.tau_of_rounds([0, 1, 7], output_tokens=7) == 2.0 == T.tau_of_requests([(7, 3)])
    # rounds entirely past the stop commit nothing but still count
    assert T.committed_per_round([3, 3, 3], output_tokens=5) == [4, 0, 0]
    # held-out anchors: committed counts (1 + leading accepted drafts), a list, a tensor or an array
    assert T.tau_of_committed([1, 3, 2]) == 2.0
    assert T.tau_of_committed(torch.tensor([1.0, 3.0, 2.0, 2.0])) == 2.0
    assert T.tau_of_committed(np.array([4.0, 1.0])) == 2.5 and T.tau_of_committed([]) is None
    # pooled measurements: their committed tokens over their rounds (rounds-weighted), not a mean of τs
    assert T.pool_tau([(2.0, 10), (4.0, 30), (None, 5), (9.0, 0)]) == 3.5
    assert T.pool_tau([]) is None


def test_tau_of_sglang_meta_info_excludes_the_prefill_token():
    # sglang: completion_tokens includes the prefill's token; spec_verify_ct counts verify rounds only
    metas = [{"completion_tokens": 33, "spec_verify_ct": 8, "spec_accept_length": 33 / 8},
             {"completion_tokens": 17, "spec_verify_ct": 4, "spec_accept_length": 17 / 4}]
    assert T.tau_of_sglang(metas) == (32 + 16) / 12 == 4.0
    assert T.tau_of_sglang(metas[:1]) == 4.0 != metas[0]["spec_accept_length"]  # sglang's own: 4.125
    assert T.tau_of_sglang([{"completion_tokens": 64}]) is None  # no speculation: no verify round


def test_generation_result_tau_counts_returned_tokens_only():
    # prefill's token + rounds committing 3, 1, 5 (the last one cut at the limit to 2): 7 tokens
    g = GenerationResult(prompt_len=4, output_ids=list(range(7)), rounds=[_round(2), _round(0), _round(4)])
    assert g.tau == 2.0 == T.tau_of_rounds([r.accepted for r in g.rounds], len(g.output_ids))
    assert math.isnan(GenerationResult(prompt_len=4, output_ids=[5]).tau)  # no verify round


# ---------------------------------------------------------------------------- one function
_TAU_WORD = re.compile(r"(?:^|_)taus?(?:$|_)", re.I)
_NOT_A_TAU = ("len", "std", "var")  # a count of τ values, a spread: not a τ


def _tau_word(s) -> bool:
    return isinstance(s, str) and bool(_TAU_WORD.search(s))


def _is_mean_call(n) -> bool:
    return isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr in ("mean", "fmean", "average", "nanmean"))
        or (isinstance(n.func, ast.Name) and n.func.id in ("mean", "fmean")))


def _divides_or_averages(node) -> bool:
    return any((isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.FloorDiv))) or _is_mean_call(n)
               for n in ast.walk(node))


def _names(node, pred) -> bool:
    for n in ast.walk(node):
        for s in (getattr(n, "id", None), getattr(n, "attr", None),
                  n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None):
            if isinstance(s, str) and pred(s):
                return True
    return False


def tau_computations(source: str, filename: str = "<src>") -> list:
    """(line, why) of every place in ``source`` that computes a τ by itself:

    A  a value named tau (variable, attribute, dict key, keyword, ``def *tau*`` return) computed
       with a division or a mean;
    B  a division of committed / completion tokens (``committed``, ``completion_tokens``, a
       ``sum(a + 1 for ...)``), or one by sglang's ``spec_verify_ct``;
    C  a mean of τ values;
    D  τ values multiplied or divided by something that is not a plain number (re-weighting τs by
       rounds to pool them): τ values are names / keys with the word tau, and the loop variables
       over them (``for b, t in r["tau_by_context"].items()``).
    """
    tree = ast.parse(source, filename)
    tainted = set()

    def is_ref(x):
        return ((isinstance(x, ast.Name) and (_tau_word(x.id) or x.id in tainted))
                or (isinstance(x, ast.Attribute) and _tau_word(x.attr))
                or (isinstance(x, ast.Subscript) and isinstance(x.slice, ast.Constant) and _tau_word(x.slice.value))
                or (isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute) and x.func.attr == "get"
                    and x.args and isinstance(x.args[0], ast.Constant) and _tau_word(x.args[0].value)))

    def has_ref(node):
        stack = [node]
        while stack:
            x = stack.pop()
            if is_ref(x):
                return True
            if isinstance(x, (ast.Dict, ast.List, ast.Tuple, ast.Set, ast.JoinedStr)):
                continue  # building a record / a message that holds a τ is not computing one
            if isinstance(x, ast.Call) and getattr(x.func, "id", getattr(x.func, "attr", None)) in _NOT_A_TAU:
                continue
            stack.extend(ast.iter_child_nodes(x))
        return False

    def direct(v):
        while True:
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("float", "round", "int") and v.args:
                v = v.args[0]
            elif isinstance(v, ast.BoolOp):
                v = v.values[0]
            elif isinstance(v, ast.IfExp):
                v = v.body
            else:
                return v

    for _ in range(2):
        for n in ast.walk(tree):
            if (isinstance(n, (ast.For, ast.comprehension)) and has_ref(n.iter)) or (
                    isinstance(n, ast.Assign) and is_ref(direct(n.value))):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    tainted.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))

    hits = []
    for n in ast.walk(tree):
        sinks = []
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value is not None:
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                name = (t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else
                        t.slice.value if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) else None)
                if _tau_word(name):
                    sinks.append(n.value)
        elif isinstance(n, ast.keyword) and _tau_word(n.arg):
            sinks.append(n.value)
        elif isinstance(n, ast.Dict):
            sinks += [v for k, v in zip(n.keys, n.values) if isinstance(k, ast.Constant) and _tau_word(k.value)]
        elif isinstance(n, ast.FunctionDef) and _tau_word(n.name):
            sinks += [r.value for r in ast.walk(n) if isinstance(r, ast.Return) and r.value is not None]
        if any(_divides_or_averages(v) for v in sinks):
            hits.append((n.lineno, "A: a tau value divided or averaged"))
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            plus_one = any(isinstance(g, (ast.GeneratorExp, ast.ListComp)) and isinstance(g.elt, ast.BinOp)
                           and isinstance(g.elt.op, ast.Add) and isinstance(g.elt.right, ast.Constant)
                           and g.elt.right.value == 1 for g in ast.walk(n.left))
            if plus_one or _names(n.left, lambda s: "committed" in s.lower() or "completion_tokens" in s) \
                    or _names(n, lambda s: "verify_ct" in s):
                hits.append((n.lineno, "B: committed tokens / rounds"))
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div, ast.FloorDiv)):
            plain = [isinstance(o, ast.Constant) and isinstance(o.value, (int, float)) for o in (n.left, n.right)]
            if not any(plain) and (has_ref(n.left) or has_ref(n.right)):
                hits.append((n.lineno, "D: tau values re-weighted"))
        if _is_mean_call(n) and isinstance(n.func, ast.Attribute) and has_ref(n.func.value):
            hits.append((n.lineno, "C: a mean of tau values"))
    return sorted(set(hits))


def _project_files():
    for top in ("sglang_dlite", "dlite_lab", "bench"):
        for p in sorted((ROOT / top).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), p


def test_no_module_computes_tau_by_itself():
    """Every τ of sglang_dlite/, dlite_lab/ and bench/ comes from drafting/tau.py: no other module divides,
    averages or re-weights one."""
    found = {rel: hits for rel, p in _project_files() if rel != "sglang_dlite/drafting/tau.py"
             for hits in [tau_computations(p.read_text(encoding="utf-8"), rel)] if hits}
    assert found == {}, f"tau computed outside sglang_dlite/drafting/tau.py (use its functions): {found}"


def test_spec_tau_has_one_formula():
    """In drafting/tau.py itself the scan finds a τ division in one function only: ``tau``."""
    src = (ROOT / "sglang_dlite" / "drafting" / "tau.py").read_text(encoding="utf-8")
    tree = ast.parse(src)
    spans = {n.name: (n.lineno, n.end_lineno) for n in tree.body if isinstance(n, ast.FunctionDef)}
    hits = tau_computations(src)
    assert hits and {name for line, _ in hits for name, (a, b) in spans.items() if a <= line <= b} == {"tau"}


@pytest.mark.parametrize("code", [
    # how τ was computed before drafting/tau.py was the only place (each one a different convention)
    "row = {'tau': round(toks / verify, 3) if verify else None}",
    "row = {'tau': round((toks - len(reqs)) / rounds, 3) if rounds else None}",
    "def tau(self):\n    return sum(r.committed for r in self.rounds) / max(len(self.rounds), 1)",
    "def _tau(metas):\n    v = sum(m['spec_verify_ct'] for m in metas)\n    t = sum(m['completion_tokens'] for m in metas)\n"
    "    return t / v",
    "result['tau_batch'] = sum(m['completion_tokens'] for m in metas) / max(1, sum(m['spec_verify_ct'] for m in metas))",
    "by_ctx[name] = (sum(a + 1 for a in rs) / len(rs)) if rs else None",
    "d['tau'] = d['committed'] / d['rounds']",
    "out = {'tau': committed / n if n else None}",
    "check = {'tau': sum(len(g) for g in got) / max(rounds, 1)}",
    "m = float(tau.mean())",
    "x = torch.cat(taus).mean().item()",
    "num += r['tau'] * r.get('rounds', 0)",
    "for b, t in (r.get('tau_by_context') or {}).items():\n    tot[b] = tot.get(b, 0.0) + t * k",
    "s = {'tau': round(float(tau[src == s].mean()), 4)}",
    "speed[c] = {'tokens_per_s': toks / wall, 'tau': (toks / ver) if ver else None}",
])
def test_the_scan_finds_tau_computed_elsewhere(code):
    assert tau_computations(code), code


@pytest.mark.parametrize("code", [
    # divisions that are not a τ
    "d['share'] = d['rounds'] / n if n else None",
    "d['mean_actual_accepted'] = d['actual_accepted'] / d['rounds']",
    "row = {'tokens_per_s': round(toks / wall, 2), 'tau': None if t is None else round(t, 3)}",
    "half = 1.96 * float(tau.std()) / math.sqrt(len(tau)) if len(tau) > 1 else 0.0",
    "ok = res['tau'] >= tuned['tau'] * 0.995",
    "per_round = draft_ms / n_rounds",
    "pos1 = round(float((committed[src == s] >= 2).mean()), 4)",
    "row = dict(tau=round(median([r['tau'] for r in rows]), 3))",
])
def test_the_scan_leaves_other_divisions_alone(code):
    assert tau_computations(code) == [], code


# ------------------------------------------------- bench/e2e.py (benchmarking/sglang_runs.py)
def test_e2e_rows_of_both_engines_come_from_level_row():
    for path, name in ((ROOT / "dlite_lab" / "benchmarking" / "sglang_runs.py", "run_sglang"),
                       (ROOT / "bench" / "e2e.py", "run_reference")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        calls = {c.func.id for c in ast.walk(fns[name]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert "level_row" in calls, name


class _RecordedSglang:
    """A stand-in for sglang's Engine that answers each request with a recorded output and the
    ``meta_info`` counts sglang reports for it (completion_tokens incl. the prefill's token,
    spec_verify_ct = verify rounds, sglang's own spec_accept_length)."""

    def __init__(self, recorded):
        self.recorded = recorded
        self.loop = asyncio.new_event_loop()

    def generate(self, input_ids, sampling_params):
        return {"output_ids": [0], "meta_info": {"completion_tokens": 1}}

    async def async_generate(self, input_ids, sampling_params, stream=False):
        g = self.recorded[tuple(input_ids)]
        n, r = len(g.output_ids), len(g.rounds)
        final = {"output_ids": list(g.output_ids),
                 "meta_info": {"completion_tokens": n, "spec_verify_ct": r, "spec_accept_length": n / r}}
        if not stream:
            return final

        async def chunks():  # as sglang streams: the prefill's token, then each round's committed tokens
            done = 1
            yield {"output_ids": list(g.output_ids[:1]), "meta_info": {"completion_tokens": 1}}
            for rnd in g.rounds[:-1]:
                done += rnd.committed
                yield {"output_ids": list(g.output_ids[:done]), "meta_info": {"completion_tokens": done}}
            yield final

        return chunks()

    def flush_cache(self):
        pass

    def shutdown(self):
        self.loop.close()


def test_e2e_both_engines_report_the_same_tau_for_the_same_run(monkeypatch):
    """One reference-engine run (full and partial acceptance, rounds cut at the token limit and at
    an EOS), reported once as the reference engine's row and once through run_sglang as sglang's
    meta_info would report the same requests: the same τ, which is each request's
    GenerationResult.tau pooled and the rounds' committed tokens over the rounds."""
    from dlite_lab.benchmarking.random_models import tiny_llama

    target = tiny_llama(0, 96, 64, 6, tied=False, max_positions=512, sticky=0.3)  # runs of tokens and jumps
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 8, 11, 6)]
    plain = ReferenceEngine(target, None, eos_token_ids=[])
    refs = [plain.generate(p, 30, speculative=False).output_ids for p in prompts]
    # an EOS: a token one request reaches after its first two, which no other request outputs
    i_eos, eos = next((i, r[j]) for i, r in enumerate(refs) for j in range(2, len(r))
                      if r[j] not in r[:j] and all(r[j] not in o for k, o in enumerate(refs) if k != i))
    # the drafter knows the whole output of two requests, the first 12 tokens of the others
    known = [30 if i in (0, i_eos) else 12 for i in range(len(prompts))]
    oracle = OracleDrafter({tuple(p + r[:k]): None for p, r, k in zip(prompts, refs, known)}, num_drafts=5)
    eng = ReferenceEngine(target, oracle, eos_token_ids=[eos])
    results = [eng.generate(p, 30) for p in prompts]
    accepted = [[r.accepted for r in x.rounds] for x in results]
    assert all(accepted) and any(5 in a for a in accepted) and any(0 in a for a in accepted)
    cut = [sum(a + 1 for a in acc) - (len(x.output_ids) - 1) for acc, x in zip(accepted, results)]
    assert results[i_eos].output_ids[-1] == eos and cut[i_eos] > 0  # the round past the EOS
    assert any(c > 0 for i, c in enumerate(cut) if i != i_eos)  # a round past the token limit
    from dlite_lab.benchmarking import sglang_runs as R

    ref_row = R.level_row("dlite", 1, [R.reference_meta(x) for x in results], 1.0, [0.25] * 4)

    import sglang_dlite.serving.cpu_launch as cpu_launch

    fake = _RecordedSglang({tuple(p): x for p, x in zip(prompts, results)})
    monkeypatch.setattr(cpu_launch, "start_engine", lambda *a, **k: fake)
    rows, outs = R.run_sglang("dlite", "target", "drafter", prompts, [1], 30, "cpu", "float32")
    (sgl_row,) = rows
    assert outs[1] == [x.output_ids for x in results]
    committed = sum(sum(T.committed_per_round(acc, len(x.output_ids))) for acc, x in zip(accepted, results))
    rounds = sum(len(acc) for acc in accepted)
    want = round(committed / rounds, 3)
    assert sgl_row["tau"] == ref_row["tau"] == want
    assert want == round(T.tau_of_requests((len(x.output_ids), len(x.rounds)) for x in results), 3)
    assert sgl_row["verify_rounds"] == ref_row["verify_rounds"] == rounds
    assert sgl_row["output_tokens"] == ref_row["output_tokens"] == sum(len(x.output_ids) for x in results)
    # what the sglang rows reported before (completion tokens / verify rounds) was another number
    assert round(sgl_row["output_tokens"] / rounds, 3) != sgl_row["tau"]


@pytest.mark.parametrize("mode, attention, seen", [("nospec", "same", "same"), ("dlite", "same", "same"),
                                                    ("nospec", "sglang", "sglang"), ("eagle3", "same", "sglang")])
def test_e2e_baseline_attention_reaches_the_engine_and_is_restored(monkeypatch, mode, attention, seen):
    """run_sglang's ``attention``: the engine's processes start with the setting cpu_attention
    ("same": no speculation's decode forwards read the KV cache with the verify's attention; sglang's
    EAGLE3 keeps sglang's own), and the caller's environment is back afterwards, even when the
    engine fails to start."""
    import sglang_dlite.serving.cpu_launch as cpu_launch
    from dlite_lab.benchmarking import sglang_runs as R
    from sglang_dlite.settings import ENV_CONFIG

    class Started(Exception):
        pass

    env = {}

    def start_engine(*a, **k):
        env["attn"] = json.loads(os.environ[ENV_CONFIG])["cpu_attention"]
        raise Started

    monkeypatch.setattr(cpu_launch, "start_engine", start_engine)
    monkeypatch.setattr(R, "eagle3_kwargs", lambda *a: {})
    caller = json.dumps({"corpus_tokens": 0})
    monkeypatch.setenv(ENV_CONFIG, caller)
    with pytest.raises(Started):
        R.run_sglang(mode, "target", "drafter", [[1, 2, 3]], [1], 4, "cpu", "float32", attention=attention)
    assert env["attn"] == seen and os.environ[ENV_CONFIG] == caller
    with pytest.raises(SystemExit, match="one of same, sglang"):
        R.run_sglang(mode, "target", "drafter", [[1, 2, 3]], [1], 4, "cpu", "float32", attention="fast")


def test_e2e_percentile_is_nearest_rank():
    from dlite_lab.benchmarking.sglang_runs import percentile as pct
    xs = list(range(1, 101))  # 1..100
    assert pct(xs, 50) == 50 and pct(xs, 99) == 99 and pct(xs, 100) == 100 and pct(xs, 0) == 1
    assert pct([7.0], 99) == 7.0 and pct([], 50) is None


def test_e2e_paired_ratios_cancel_the_machines_drift():
    """``paired``: each mode against the first, repeat by repeat: a machine that slows by 30 % over the
    benchmark moves both modes' medians, not the same-repeat ratio."""
    from dlite_lab.benchmarking.sglang_runs import paired

    def row(tps, **k):
        return {"concurrency": 1, "tokens_per_s": tps, "draft_ms_per_round": 10.0, "verify_ms_per_round": 100.0, **k}

    slow = [1.0, 0.85, 0.7]  # the machine's speed in repeats 1..3
    runs = {"dlite": [[row(50 * f)] for f in slow],
            "dlite-online": [[row(49 * f, learn_ms_per_round=1.0)] for f in slow]}
    (p,) = paired(runs, "dlite")
    assert p["mode"] == "dlite-online" and p["vs"] == "dlite" and p["repeats"] == 3
    assert p["paired_ratio"] == p["paired_min"] == p["paired_max"] == 0.98
    assert p["learn_ms_per_round_median"] == 1.0 and p["verify_ms_per_round_median"] == 100.0
    assert "learn_ms_per_round_median" not in paired({"a": runs["dlite"], "b": runs["dlite"]}, "a")[0]


def test_e2e_online_round_log_fields_and_fresh_engines():
    """The round log's online fields sum per level (``online_stats``); modes that remember the requests
    they served (NGRAM, online learning) get a fresh engine per level (``remembers_requests``)."""
    from dlite_lab.benchmarking.sglang_runs import online_stats, remembers_requests, round_stats

    assert online_stats([{"draft_ms": 1}]) == {}
    recs = [{"learn_ms": 2.0, "online": {"updates": 1, "backed_off": 0}}, {"learn_ms": 0.0, "online": {"backed_off": 1}},
            {"learn_ms": 1.0, "online": {}}, {"draft_ms": 1}]
    assert online_stats(recs) == {"learn_ms_per_round": 0.75, "online": {"updates": 1, "backed_off": 1}}
    import json as _json
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for r in recs[:3]:
            f.write(_json.dumps({"bs": 1, "width": 4, "draft_ms": 1.0, "verify_ms": 2.0, **r}) + "\n")
    st = round_stats(f.name, 0)
    assert st["learn_ms_per_round"] == 1.0 and st["online"] == {"updates": 1, "backed_off": 1}
    os.unlink(f.name)
    assert [remembers_requests(m) for m in ("ngram", "ngram:8", "dlite-online", "dlite+online=backoff=1",
                                            "dlite-online@tp2")] == [True] * 5
    assert [remembers_requests(m) for m in ("dlite", "nospec", "eagle3", "dlite+online=null",
                                            "dlite-online+online=false", "dlite+tree_max_batch_size=0")] == [False] * 6


def test_e2e_rows_count_what_the_radix_cache_served():
    """A row reports how much of its prompts the radix cache served (sglang's ``prompt_tokens`` /
    ``cached_tokens``): the prefill's work is the difference; the reference engine has no such counts."""
    from dlite_lab.benchmarking import sglang_runs as R

    metas = [{"completion_tokens": 5, "spec_verify_ct": 2, "prompt_tokens": 100, "cached_tokens": 60},
             {"completion_tokens": 5, "spec_verify_ct": 2, "prompt_tokens": 50, "cached_tokens": 0}]
    row = R.level_row("dlite", 2, metas, 1.0, [0.5, 0.5])
    assert (row["prompt_tokens"], row["cached_prompt_tokens"], row["prefilled_tokens"]) == (150, 60, 90)
    ref = R.level_row("dlite", 1, [R.reference_meta(GenerationResult(prompt_len=3, output_ids=[1, 2]))], 1.0, [1.0])
    assert "prefilled_tokens" not in ref and ref["output_tokens"] == 2
