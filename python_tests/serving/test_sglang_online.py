"""Online learning in the sglang DLITE worker (issue 47; ``serving/online_serving.py``, the
setting ``online``): the serving learner on a tiny random-weight drafter fed synthetic verify rounds
(it learns a planted stream, the time budget caps every update, errors disable it instead of
raising, opted-out rows are skipped, a bf16 drafter trains float32 masters and its prepacked CPU
weights follow), the setting's checks, and one real sglang engine on the CPU whose greedy output
with learning on is the target's own."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

from conftest import tiny_dlite_config
from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.online import OnlineConfig
from sglang_dlite.ops import cpu_linear
from sglang_dlite.serving.info import pack_context, unpack_context
from sglang_dlite.serving.online_serving import OnlineServing, _as_probs
from sglang_dlite.settings import ServingOptions

NEXT = {5: 9, 9: 13, 13: 5}  # the planted stream: the target continues 5 -> 9 -> 13 -> 5 ...


def drafter(target, seed=0):
    torch.manual_seed(seed)
    return DLiteDrafter(tiny_dlite_config(target, head_input="token")).bind_hf_target(target).eval()


def serving(model, drafts_are_model=True, **opts):
    opts.setdefault("min_pairs", 1)  # every round may update
    return OnlineServing(model, OnlineConfig(scope="server", **opts), drafts_are_model=drafts_are_model)


def planted_round(srv, B=2, gen=None, V=None):
    """One synthetic verify round on the planted stream: the working copy drafts, the "target" puts
    its mass on the stream's next token at every verified row. Returns the observe arguments."""
    m = srv.model
    cfg = m.config
    gen = gen or torch.Generator().manual_seed(0)
    V = V or cfg.vocab_size
    rows = torch.randn(B, cfg.num_context_positions, cfg.num_capture_layers * cfg.target_hidden_size, generator=gen)
    state = pack_context(rows, torch.ones(B, cfg.num_context_positions, dtype=torch.bool))
    anchors = torch.tensor([list(NEXT)[int(i)] for i in torch.randint(0, 3, (B,), generator=gen)])
    ctx = rows.view(B, cfg.num_context_positions, cfg.num_capture_layers, -1).permute(0, 2, 1, 3)
    with torch.no_grad():
        drafts = m.propose(ctx.contiguous(), torch.ones(B, cfg.num_context_positions, dtype=torch.bool),
                           anchors).tokens
    block = torch.cat([anchors[:, None], drafts], 1)
    target = torch.tensor([[NEXT.get(int(t), 5) for t in r] for r in block])  # row j: the token after block[:, j]
    logits = torch.randn(B, block.shape[1], V, generator=gen)
    logits.scatter_(-1, target[..., None], 12.0)
    ok = (drafts == target[:, :-1]).int().cumprod(1)
    return state, anchors, block, logits, ok.sum(1)


def learn_planted_stream(srv, rounds) -> list:
    """``rounds`` planted rounds observed by ``srv``: each round's mean accepted drafts."""
    gen = torch.Generator().manual_seed(1)
    acc = []
    for _ in range(rounds):
        args = planted_round(srv, gen=gen)
        acc.append(float(args[-1].float().mean()))
        srv.observe(*args)
    return acc


def test_update_moves_the_drafter_towards_a_planted_stream(tiny_target):
    shipped = drafter(tiny_target)
    before = {k: v.clone() for k, v in shipped.state_dict().items()}
    srv = serving(shipped, params="last", update_every=1, watchdog_window=0)
    assert srv.model is not shipped and srv.model.embed_weight is shipped.embed_weight
    acc = learn_planted_stream(srv, 80)
    assert srv.enabled and srv.learner.stats["updates"] == 80
    assert sum(acc[:2]) / 2 < 0.5 and sum(acc[-10:]) / 10 > 2.0, acc  # K = 4 drafts; random weights: ~0
    assert all(torch.equal(v, shipped.state_dict()[k]) for k, v in before.items())  # the shipped drafter: never written
    # decayed towards the shipped weights after every update: with decay 1 - 1e-9 nothing is kept
    srv2 = serving(drafter(tiny_target), params="head", update_every=1, decay=1 - 1e-9, watchdog_window=0)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        srv2.observe(*planted_round(srv2, gen=gen))
    w = srv2.model.head.out_proj.weight
    assert torch.allclose(w, srv2.learner.shipped.head.out_proj.weight, atol=1e-6)


def test_attach_off_keeps_the_shipped_drafter_on_hands_over_the_working_copy(tiny_target):
    d = drafter(tiny_target)
    assert OnlineServing.attach(ServingOptions(), d) == (None, d)
    on = ServingOptions(online=OnlineConfig.parse("params=head,scope=server"))
    srv, drafts_with = OnlineServing.attach(on, d, lookup=None)
    assert drafts_with is srv.model and drafts_with is not d and srv.learner.drafts_are_model
    srv, _ = OnlineServing.attach(ServingOptions(online=OnlineConfig.parse("scope=server")), d, lookup=object())
    assert not srv.learner.drafts_are_model and srv.learner.cfg.params == "last"


def test_the_budget_never_blocks(tiny_target):
    """max_update_ms: every update stops stepping once past it (0 ms: one step each, of 50 asked)."""
    srv = serving(drafter(tiny_target), params="last", update_every=1, steps=50, max_update_ms=0.0)
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):
        srv.observe(*planted_round(srv, gen=gen))
    s = srv.summary()
    assert s["updates"] == 6 and s["steps"] == 6 and s["budget_cut"] == 6
    defaults = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"online": true}'}).online
    assert defaults == OnlineConfig(scope="server", lr=1e-3, update_every=16, watchdog_every=32, max_update_ms=50.0,
                                    backoff=8)
    assert defaults.to_spec() == "scope=server,lr=0.001,update_every=16,watchdog_every=32,max_update_ms=50.0,backoff=8"


def test_updates_are_paced_to_their_budget(tiny_target):
    """A positive max_update_ms at server scope: an update past its budget delays the next one so
    that updates average at most the budget per update_every rounds (0 ms: no pacing, above)."""
    srv = serving(drafter(tiny_target), params="head", update_every=2, watchdog_window=0, max_update_ms=1e-3)
    gen = torch.Generator().manual_seed(5)
    srv.observe(*planted_round(srv, gen=gen))
    srv.observe(*planted_round(srv, gen=gen))
    s = srv.summary()
    assert s["updates"] == 1
    assert srv.state.update_period == math.ceil(2 * s["update_ms"] / 1e-3) > 100
    for _ in range(20):
        srv.observe(*planted_round(srv, gen=gen))
    assert srv.learner.stats["updates"] == 1 and srv.enabled
    fast = serving(drafter(tiny_target), params="head", update_every=2, watchdog_window=0, max_update_ms=1e6)
    for _ in range(6):
        fast.observe(*planted_round(fast, gen=gen))
    assert fast.learner.stats["updates"] == 3 and fast.state.update_period == 2  # within budget: every 2


def test_tree_round_pairs_are_the_accepted_paths(tiny_target):
    """observe_tree: a tree round's pair is the chain round's over its accepted root path -- the
    path's drafts as the head's feedback, the target's argmax at the path's nodes as the labels up
    to the first rejection (-1 after) -- and the sampled watchdog scores chains on the path only."""
    srv = serving(drafter(tiny_target), drafts_are_model=True, params="norm", update_every=10**6,
                  watchdog_window=64, watchdog_every=1, tree_gate=0)  # tree_gate=0: the chain watchdog judges trees
    cfg = srv.model.config
    K, V, N, B = cfg.block_size, cfg.vocab_size, 6, 2
    gen = torch.Generator().manual_seed(6)
    state, anchors, _, _, _ = planted_round(srv, B=B, gen=gen)
    # request 0: path = nodes 0 -> 2 -> 5 (two drafts accepted); request 1: nothing accepted
    nodes = torch.randint(3, V, (B, N), generator=gen)
    path_idx = torch.tensor([[0, 2, 5, -1, -1, -1], [0, -1, -1, -1, -1, -1]])
    a = torch.tensor([2, 0])
    logits = torch.randn(B, N, V + 64, generator=gen)  # sglang pads the vocabulary
    bonus = logits[:, :, :V].argmax(-1)
    out = torch.zeros(B, N, dtype=torch.int64)
    out[0, :3] = torch.stack([nodes[0, 2], nodes[0, 5], bonus[0, 5]])
    out[1, 0] = bonus[1, 0]
    for b, node in ((0, 0), (0, 2)):  # the path's drafts are what the target predicted at their parents
        logits[b, node, nodes[b, {0: 2, 2: 5}[node]]] = 50.0
    out[0, :2] = torch.stack([nodes[0, 2], nodes[0, 5]])
    srv.state.adapted = True  # the watchdog compares from the first round
    srv.observe_tree(state, anchors, out, path_idx, a, logits)
    assert srv.enabled and srv.learner.stats["rounds"] == 1 and srv.learner.stats["watched"] == 1
    p0, p1 = list(srv.state.buffer)
    assert p0.anchor == int(anchors[0]) and p1.anchor == int(anchors[1])
    assert p0.feedback[:2].tolist() == [int(nodes[0, 2]), int(nodes[0, 5])]
    target0 = logits[0, [0, 2, 5], :V].argmax(-1)
    assert p0.labels[:3].tolist() == target0.tolist() and (p0.labels[3:] == -1).all()
    assert p1.labels[0] == logits[1, 0, :V].argmax() and (p1.labels[1:] == -1).all()
    assert torch.allclose(p0.top_p[2], torch.softmax(logits[0, 5, :V], -1).topk(p0.top_p.shape[-1]).values)
    assert len(p0.labels) == K
    # the watchdog's scores: chains judged on the path's drafts and the path's target rows only
    from sglang_dlite.drafting.online import chain_accepted
    ctx, valid = unpack_context(state, cfg.num_capture_layers, cfg.target_hidden_size)
    with torch.no_grad():
        chains = srv.learner.shipped.propose(ctx.contiguous(), valid, anchors).tokens.tolist()
    path_d, path_t = [[int(nodes[0, 2]), int(nodes[0, 5])], []], [target0.tolist(), [int(p1.labels[0])]]
    assert list(srv.state.window) == [(chain_accepted(c, d, t),) * 2 for c, d, t in zip(chains, path_d, path_t)]


def test_tree_gate_drafts_the_winning_model_and_judges_the_other(tiny_target):
    """The worker's tree rounds under the tree gate (``OnlineServing.tree_gate``): before the first
    update the working copy drafts and nothing is judged; once adapted, the adapted copy's trees while
    the gate's record is positive, else the shipped drafter's; one round in ``watch_every`` also grows
    the other model's trees, and ``judge_trees`` scores them against what the round committed."""
    from types import SimpleNamespace

    from sglang_dlite.serving.rounds import TreeRounds
    from sglang_dlite.drafting.tree import DraftTree

    srv = serving(drafter(tiny_target), drafts_are_model=False, params="last", tree_gate=8, watchdog_every=2)
    assert not srv.learner.watch_paths  # tree rounds: the gate judges them, not the chain watchdog
    with torch.no_grad():  # an adapted copy that drafts differently from the shipped drafter
        for name, p in srv.model.named_parameters():
            if name.startswith("head."):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    cfg = srv.model.config
    w = SimpleNamespace(lookup=None, drafter=srv.model, L=cfg.num_capture_layers, H=cfg.target_hidden_size,
                        dlite_drafts=cfg.block_size, width_policy=None, online=srv, W=cfg.block_size + 1)
    rounds = TreeRounds(w, max_batch_size=4)
    state, anchors, _, _, _ = planted_round(srv, B=2)
    ctx, valid = unpack_context(state, cfg.num_capture_layers, cfg.target_hidden_size)
    with torch.no_grad():
        grow = lambda m: [t.tokens for t in rounds._grow(m, [None, None], ctx.contiguous(), valid, anchors,  # noqa: E731
                                                         anchors.tolist())[0]]
        adapted, shipped_trees = grow(srv.model), grow(srv.shipped)
        assert adapted != shipped_trees
        rd = rounds.grow(None, state, anchors)
        assert [t.tokens for t in rd.trees] == adapted and rd.judge is None
        srv.state.adapted = True
        judged = 0
        for record, use in (([1, 1, -1], True), ([1, -1], False), ([], False)):
            srv.state.gate.clear()
            srv.state.gate.extend(record)
            for _ in range(2):  # watch_every 2: one of the two rounds is judged
                rd = rounds.grow(None, state, anchors)
                assert [t.tokens for t in rd.trees] == (adapted if use else shipped_trees)
                if rd.judge is not None:
                    judged += 1
                    others, verified_adapted = rd.judge
                    assert verified_adapted is use and [t.tokens for t in others] == (shipped_trees if use else adapted)
        assert judged == 3
        s = srv.learner.stats
        assert s["gate_adapted"] == 4 and s["gate_shipped"] == 8
    # verdicts: request 0's other tree held every committed token (better), request 1's as many (tied)
    srv.state.gate.clear()
    srv.judge_trees([DraftTree.chain(9, [4, 5, 6]), DraftTree.chain(9, [4, 7])], False,
                    torch.tensor([[4, 5, 6, 0], [4, 8, 0, 0]]), torch.tensor([2, 1]))
    assert list(srv.state.gate) == [1, 0]
    srv.judge_trees([DraftTree.chain(9, [4, 5])], True, torch.tensor([[4, 5, 6, 0]]), torch.tensor([3]))
    assert list(srv.state.gate) == [1, 0, 1]  # the shipped tree accepted one fewer: the adapted one was better
    assert srv.enabled and "tree gate: 4 adapted / 8 shipped" in srv.describe_stats()


def test_backoff_skips_tree_rounds_while_the_gate_drafts_the_shipped_tree(tiny_target):
    """``backoff``: once adapted, while the gate's record is not in favour of the adapted copy, a tree
    round is learned from one in ``backoff`` (no pairs, no update count, no learning time in the others);
    the round the record turns in favour every round is learned again; chain rounds are never skipped.
    The round log's fields (``take_round``) carry the learner's time and counts per round."""
    srv = serving(drafter(tiny_target), drafts_are_model=False, params="norm", update_every=10**6,
                  watchdog_window=0, tree_gate=8, backoff=3)
    gen = torch.Generator().manual_seed(7)
    state, anchors, _, _, _ = planted_round(srv, B=2, gen=gen)
    N = 4
    out = torch.randint(3, srv.V, (2, N), generator=gen)
    path_idx, a = torch.tensor([[0, 1, -1, -1], [0, -1, -1, -1]]), torch.tensor([1, 0])
    logits = torch.randn(2, N, srv.V, generator=gen)
    buffered = []

    def tree_round():
        srv.observe_tree(state, anchors, out, path_idx, a, logits)
        buffered.append(len(srv.state.buffer))
        return srv.take_round()

    first = tree_round()  # not adapted yet: learned
    assert buffered == [2] and first["learn_ms"] > 0 and first["online"] == {}
    srv.state.adapted = True
    recs = [tree_round() for _ in range(7)]  # empty record: the shipped tree; one round in 3 learned
    assert buffered == [2, 4, 4, 4, 6, 6, 6, 8]
    assert [r["online"].get("backed_off", 0) for r in recs] == [0, 1, 1, 0, 1, 1, 0]
    assert all(r["learn_ms"] == 0 for r in recs if r["online"].get("backed_off"))
    srv.state.gate.extend([1])  # the record in favour of the adapted copy: every round again
    for _ in range(3):
        tree_round()
    assert buffered[-3:] == [10, 12, 14]
    srv.state.gate.extend([-1, -1])  # against again: the count starts over (its first round learned)
    for _ in range(3):
        tree_round()
    assert buffered[-3:] == [16, 16, 16] and srv.learner.stats["backed_off"] == 6
    srv.observe(*planted_round(srv, B=2, gen=gen))  # a chain round: never backed off
    assert len(srv.state.buffer) == 18
    assert "6 tree rounds skipped by the back-off" in srv.describe_stats()
    assert "tree gate 8, back-off 1/3 while the gate holds the shipped tree" in srv.learner.describe()
    for opts in ({"backoff": 1}, {"backoff": 3, "tree_gate": 0}):  # off: every tree round learned
        full = serving(drafter(tiny_target), drafts_are_model=False, params="norm", update_every=10**6,
                       watchdog_window=0, **opts)
        full.state.adapted = True
        for _ in range(4):
            full.observe_tree(state, anchors, out, path_idx, a, logits)
        assert len(full.state.buffer) == 8 and full.learner.stats["backed_off"] == 0
    with pytest.raises(DLiteConfigError, match="backoff"):
        OnlineConfig(backoff=0)


def test_errors_disable_learning_instead_of_raising(tiny_target, monkeypatch, caplog):
    shipped = drafter(tiny_target)
    srv = serving(shipped, params="head", update_every=1, watchdog_window=0)
    gen = torch.Generator().manual_seed(3)
    srv.observe(*planted_round(srv, gen=gen))
    assert srv.learner.stats["updates"] == 1
    assert not torch.equal(srv.model.head.out_proj.weight, shipped.head.out_proj.weight)

    def boom(*a, **k):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(srv.learner, "loss", boom)
    srv.observe(*planted_round(srv, gen=gen))  # must not raise
    assert not srv.enabled and "planted failure" in srv.error
    assert "online learning failed" in caplog.text
    assert torch.equal(srv.model.head.out_proj.weight, shipped.head.out_proj.weight)  # back to shipped
    rounds = srv.learner.stats["rounds"]
    srv.observe(*planted_round(srv, gen=gen))  # off: a no-op
    assert srv.learner.stats["rounds"] == rounds
    # a malformed round (a state of the wrong width) disables too
    srv = serving(drafter(tiny_target), params="norm")
    state, anchors, block, logits, a = planted_round(srv, gen=gen)
    srv.observe(state[..., 1:], anchors, block, logits, a)
    assert not srv.enabled


def test_opted_out_rows_are_skipped_and_padded_vocab_rows_cut(tiny_target):
    srv = serving(drafter(tiny_target), params="norm", update_every=10**6)
    V = srv.model.config.vocab_size
    state, anchors, block, logits, a = planted_round(srv, B=3, V=V + 64)  # sglang pads the vocabulary
    srv.observe(state, anchors, block, logits, a, torch.tensor([False, True, False]))
    buf = list(srv.state.buffer)
    assert srv.enabled and [p.anchor for p in buf] == [int(anchors[0]), int(anchors[2])]
    srv.observe(state, anchors, block, logits, a, torch.ones(3, dtype=torch.bool))
    assert len(srv.state.buffer) == 2 and srv.learner.stats["rounds"] == 1


def test_sampled_rows_are_kept_as_probabilities():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.7, 0.2, 0.1]])  # row 1: a distribution already
    p = _as_probs(logits)
    assert torch.allclose(p[0], torch.softmax(logits[0], -1)) and torch.equal(p[1], logits[1])


def test_bf16_drafter_trains_float32_masters_and_refreshes_packed_weights(tiny_target):
    shipped = drafter(tiny_target).to(torch.bfloat16)
    packed = cpu_linear.pack_cpu_linears(shipped)
    ctx = torch.randn(2, 2, 3, tiny_target.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        shipped.propose(ctx, torch.ones(2, 3, dtype=torch.bool), torch.tensor([5, 9]))  # packs (if oneDNN bf16 runs)
    srv = serving(shipped, params="last", update_every=1, lr=1e-2, watchdog_window=0)  # the copy of a packed drafter
    assert all(m.dtype == torch.float32 for m in srv.learner.masters)
    assert all(p.dtype == torch.bfloat16 for p in srv.learner.trainable)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        srv.observe(*planted_round(srv, gen=gen))
    assert srv.enabled and srv.learner.stats["updates"] == 3
    for p, m in zip(srv.learner.trainable, srv.learner.masters):
        assert torch.equal(p, m.to(torch.bfloat16))
    if not packed:
        pytest.skip("oneDNN's packed bf16 linear does not run on this CPU")
    assert srv._packed, "the trained linears run on packed weights"
    for lin in srv._packed:
        x = torch.randn(4, lin.in_features, dtype=torch.bfloat16)
        with torch.no_grad():
            got = lin(x)
        ref = torch.nn.functional.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
        assert lin._dlite_packed_key == (lin.weight.data_ptr(), lin.weight._version)
        assert torch.allclose(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("value, msg", [
    ('"scope=session"', "online.*scope='session'; serving learns at server scope only"),
    ('"params=everything"', "online.*params='everything'"),
    ('{"lr": "fast"}', r"setting online.*lr='fast': 'fast' is not a float"),
    ('{"batch": 4}', "setting online.*batch=4: unknown; the keys are params, scope"),
    ('"steps"', "setting online.*expected key=value"),
    ("7", "setting online.*must be a spec string"),
])
def test_a_bad_online_setting_stops_the_launch_naming_it(value, msg):
    with pytest.raises(DLiteConfigError, match=msg):
        ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"online": %s}' % value})
    o = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"online": {"params": "head", "update-every": 2}}'})
    assert o.online == OnlineConfig(params="head", scope="server", update_every=2, watchdog_every=32,
                                    max_update_ms=50.0, lr=1e-3, backoff=8)
    assert ServingOptions.from_env({}).online is None and "online" not in json.loads(ServingOptions().describe())


# ---------------------------------------------------------------------------------- sglang
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
MAX_NEW = [40, 24, 40]


@pytest.mark.parametrize("trees", [False, True])
def test_sglang_greedy_output_with_online_learning_is_the_targets(tmp_path, monkeypatch, capfd, trees):
    """A real engine (CPU, tiny sticky Llama, a random token-fed DLite, DLite alone so the watchdog's
    drafts-are-the-model path runs): greedy output == the target's own greedy output, the learner
    updated (its first-update log line) and never failed. Chains (one request opted out) or token
    trees (every round a tree round: the learner learns from the accepted paths only)."""
    import sglang_fixtures as F
    from transformers import AutoModelForCausalLM

    target = F.save_tiny_llama(tmp_path / "target")
    draft = F.save_random_dlite(tmp_path / "drafter", target, head_input="token")
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                       attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
           for p, n in zip(PROMPTS, MAX_NEW)]
    settings = {"lookup": False, "tree_max_batch_size": 4 if trees else 0,
                "online": "params=last,update_every=1,min_pairs=1,steps=1,watchdog_window=4,watchdog_every=2"}
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps(settings))
    sps = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW]
    if not trees:  # an opted-out request: its batches are chain rounds
        sps[1]["custom_params"] = {"dlite_speculate": False}
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:  # log_level info (the learner's first-update line); sglang re-configures this process's root logger
        with F.engine(target, dlite=draft, skip_tokenizer_init=True, log_level="info") as e:
            outs = e.generate(input_ids=PROMPTS, sampling_params=sps)
            again = e.generate(input_ids=PROMPTS[0], sampling_params=sps[0])  # after the updates
    finally:  # its handler writes to this test's captured stderr: gone after the test
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    assert [o["output_ids"] for o in outs] == ref and again["output_ids"] == ref[0]
    log = "".join(capfd.readouterr())
    assert "online learning failed" not in log
    m = re.search(r"DLITE online: (\d+) rounds, (\d+) updates", log)
    assert m and int(m.group(2)) >= 1, log[-3000:]
