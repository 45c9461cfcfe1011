"""Per-response speculation metrics: the ``metrics`` object of an OpenAI response, in the shape vLLM
returns with ``--per-request-spec-decode-metrics`` (vLLM PR #48915), plus DLITE's fields.

Who gets them: a request that asks, ``custom_params: {"dlite_spec_metrics": true}`` (or ``"summary"``
/ ``"detailed"``; ``false`` / ``"off"``: none) in the body of ``/v1/chat/completions`` and
``/v1/completions`` (the OpenAI client's ``extra_body``) or in ``sampling_params`` of ``/generate``,
and every request when the setting ``spec_metrics`` is ``"summary"`` or ``"detailed"``. Responses of
other requests are unchanged, byte for byte. ``meta_info["dlite_spec_metrics"]`` (``/generate``,
``sgl.Engine``) holds the same object for one request; the OpenAI routes put it, summed over the
response's choices, at ``metrics.speculative_decoding`` of a non-streamed response and of the last
streamed chunk (the usage chunk with ``stream_options.include_usage``).

Fields (a step is one verify round of the request, as sglang's ``spec_verify_ct`` counts them; a
round the draft gate, the load policy or the request's opt-out ran without drafts is a step that
verified 0 drafts): ``mean_acceptance_length`` (1 + accepted / steps), ``draft_acceptance_rate``
(accepted / draft tokens), ``acceptance_histogram`` (index j: steps that accepted exactly j drafts,
j = 0 .. ``num_spec_tokens``), ``num_spec_steps``, ``num_accepted_draft_tokens``, ``num_draft_tokens``
(drafts verified: a chain's W - 1, a token tree's nodes), ``num_spec_tokens`` (drafts per step at
most: ``--speculative-num-draft-tokens`` - 1); DLITE's: ``accepted_per_position`` (index j: steps
whose draft j + 1 was accepted; a tree's along its accepted root path), ``tau`` (``drafting/tau.py``:
committed tokens per step, the prefill's token excluded), ``num_drafting_steps`` (steps that verified
a draft), ``num_tree_steps``, ``sources`` ({source: {num_spec_steps, num_accepted_draft_tokens,
num_committed_tokens}}: which drafter drafted the steps and committed how many returned tokens; the
names of ``sglang:dlite_source_rounds_total``: ``dlite``, ``suffix`` (the suffix lookup), ``mixed``
(DLite continued by the lookup, or a tree of several sources), ``corpus``; ``off``: a step with no
draft); with ``"detailed"`` also ``per_step_accepted``, ``per_step_draft_tokens``, ``per_step_source``.

How they travel: the worker hangs a ``RoundStats`` on each decode round's logits output (sglang's
auxiliary-output contract); where sglang takes the round's result it ``consume``s it: per request the
round's accepted / verified drafts and the tokens it committed (``commits``: None for a request the
round did not count, as ``spec_verify_ct``), into the request's ``SpecCounts`` (``Req`` attribute, gone
with the request) and the ``/metrics`` acceptance counters (``metrics.record_acceptance``: so they
reconcile to the token). A finished request's summary leaves the scheduler as customized info
(``Scheduler.get_output_streamer_class``: ``streamer_class``), lands in ``meta_info`` (AROUND hook on
``TokenizerManager.update_request_meta_info``) and in the OpenAI response (``spec_metrics_http.py``).
"""

from __future__ import annotations

from typing import List, Optional

from sglang_dlite.drafting.tau import pool_tau, tau_of_requests
from sglang_dlite.serving import metrics as dlite_metrics
from sglang_dlite.settings import SPEC_METRICS

REQUEST_KEY = "dlite_spec_metrics"  # custom_params key of the per-request opt-in
META_KEY = "dlite_spec_metrics"  # meta_info key (and the customized-info key scheduler -> tokenizer)
NO_DRAFT = "off"  # the source of a step that verified no draft
_ATTR = "_dlite_spec_counts"  # Req attribute: None unresolved, False off, a SpecCounts
_config = {"mode": "off", "num_spec_tokens": 0}  # this scheduler's: the setting, W - 1 (the worker's configure)


def configure(mode: str, num_spec_tokens: int) -> None:
    """The worker's settings (its scheduler process): ``spec_metrics`` and drafts per round at most."""
    _config.update(mode=mode, num_spec_tokens=int(num_spec_tokens))


def mode_of(value, default: str) -> str:
    """A request's ``custom_params["dlite_spec_metrics"]`` (None: not given) -> off | summary | detailed."""
    if value is None:
        return default
    if value is True:
        return "summary" if default == "off" else default
    if value is False:
        return "off"
    return value.lower() if isinstance(value, str) and value.lower() in SPEC_METRICS else default


def request_value(req):
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params.get(REQUEST_KEY) if isinstance(params, dict) else None


def request_error(req) -> Optional[str]:
    """Why the request's opt-in value is refused (None: fine). Checked when the request arrives."""
    v = request_value(req)
    if v is None or isinstance(v, bool) or (isinstance(v, str) and v.lower() in SPEC_METRICS):
        return None
    return (f"custom_params.{REQUEST_KEY} must be true, false or one of {', '.join(SPEC_METRICS)}; "
            f"got {v!r}.")


def counts_of(req) -> Optional["SpecCounts"]:
    """The request's counters (made at first sight), None where it gets no metrics."""
    c = getattr(req, _ATTR, None)
    if c is None:
        mode = mode_of(request_value(req), _config["mode"])
        c = SpecCounts(_config["num_spec_tokens"], detailed=mode == "detailed") if mode != "off" else False
        setattr(req, _ATTR, c)
    return c or None


class SpecCounts:
    """One request's speculation counters, one ``add`` per verify round sglang counts for it."""

    __slots__ = ("num_spec_tokens", "steps", "drafting_steps", "tree_steps", "draft_tokens", "accepted",
                 "histogram", "per_position", "sources", "per_step")

    def __init__(self, num_spec_tokens: int, detailed: bool = False):
        k = max(int(num_spec_tokens), 0)
        self.num_spec_tokens = k
        self.steps = self.drafting_steps = self.tree_steps = self.draft_tokens = self.accepted = 0
        self.histogram = [0] * (k + 1)
        self.per_position = [0] * k
        self.sources: dict = {}  # source -> [steps, accepted drafts, committed tokens]
        self.per_step: Optional[list] = [] if detailed else None  # (accepted, drafts, source) per step

    def add(self, accepted: int, drafts: int, source: str, committed: int, tree: bool = False) -> None:
        """One verify round: ``accepted`` of ``drafts`` verified drafts, ``committed`` tokens returned."""
        self.steps += 1
        self.drafting_steps += drafts > 0
        self.tree_steps += bool(tree)
        self.draft_tokens += drafts
        self.accepted += accepted
        if accepted >= len(self.histogram):  # never past W - 1; grown rather than lost
            self.histogram += [0] * (accepted + 1 - len(self.histogram))
            self.per_position += [0] * (accepted - len(self.per_position))
        self.histogram[accepted] += 1
        for j in range(accepted):
            self.per_position[j] += 1
        src = self.sources.setdefault(source if drafts > 0 else NO_DRAFT, [0, 0, 0])
        src[0] += 1
        src[1] += accepted
        src[2] += committed
        if self.per_step is not None:
            self.per_step.append((accepted, drafts, source if drafts > 0 else NO_DRAFT))

    def summary(self, completion_tokens: int) -> dict:
        """``metrics.speculative_decoding`` of this request (``completion_tokens``: its returned output,
        the prefill's token included, as sglang's ``completion_tokens``)."""
        raw = dict(num_spec_steps=self.steps, num_accepted_draft_tokens=self.accepted,
                   num_draft_tokens=self.draft_tokens, num_spec_tokens=self.num_spec_tokens,
                   acceptance_histogram=list(self.histogram), accepted_per_position=list(self.per_position),
                   tau=tau_of_requests([(completion_tokens, self.steps)]), num_drafting_steps=self.drafting_steps,
                   num_tree_steps=self.tree_steps,
                   sources={k: dict(num_spec_steps=v[0], num_accepted_draft_tokens=v[1], num_committed_tokens=v[2])
                            for k, v in self.sources.items()})
        if self.per_step is not None:
            raw.update(per_step_accepted=[s[0] for s in self.per_step],
                       per_step_draft_tokens=[s[1] for s in self.per_step],
                       per_step_source=[s[2] for s in self.per_step])
        return describe(raw)


_VLLM_FIELDS = ("mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
                "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens")
_COUNTS = ("num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens", "num_drafting_steps",
           "num_tree_steps")
_LISTS = ("acceptance_histogram", "accepted_per_position")
_STEP_LISTS = ("per_step_accepted", "per_step_draft_tokens", "per_step_source")


def describe(raw: dict) -> dict:
    """The counts -> the response object: vLLM's fields first (rates from the counts), then DLITE's."""
    steps, accepted, drafts = raw["num_spec_steps"], raw["num_accepted_draft_tokens"], raw["num_draft_tokens"]
    out = dict(mean_acceptance_length=1.0 + accepted / steps if steps else None,
               draft_acceptance_rate=accepted / drafts if drafts else None)
    out.update({k: raw[k] for k in _VLLM_FIELDS[2:]})
    out.update({k: raw[k] for k in ("accepted_per_position", "tau", "num_drafting_steps", "num_tree_steps", "sources")})
    out.update({k: raw[k] for k in _STEP_LISTS if k in raw})
    return out


def _add_lists(a: list, b: list) -> list:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def merge(parts: List[dict]) -> Optional[dict]:
    """Several requests' (a response's choices') objects -> one: counts summed, τ pooled over their
    steps (``tau.pool_tau``), the rates recomputed, per-step lists concatenated in order."""
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        return parts[0] if parts else None
    raw = {k: sum(p[k] for p in parts) for k in _COUNTS}
    raw["num_spec_tokens"] = max(p["num_spec_tokens"] for p in parts)
    for k in _LISTS:
        acc: list = []
        for p in parts:
            acc = _add_lists(acc, p[k])
        raw[k] = acc
    raw["tau"] = pool_tau([(p["tau"], p["num_spec_steps"]) for p in parts])
    sources: dict = {}
    for p in parts:
        for name, v in p["sources"].items():
            s = sources.setdefault(name, dict.fromkeys(v, 0))
            for k, n in v.items():
                s[k] = s.get(k, 0) + n
    raw["sources"] = sources
    for k in _STEP_LISTS:
        if all(k in p for p in parts):
            raw[k] = [x for p in parts for x in p[k]]
    return describe(raw)


def final_summary(req) -> list:
    """The customized-info value of one emitted request: [its summary] once it finished and gets
    metrics, else [] (a list either way: sglang's own accumulation would take it as is)."""
    if not req.finished():
        return []
    c = counts_of(req)
    return [] if c is None else [c.summary(len(req.output_ids_through_stop))]


# ---------------------------------------------------------------------------- the worker's round
class RoundStats:
    """One decode round's speculation per request, hung on the round's logits output (sglang's
    ``DeviceAuxiliaryOutput``: ``copy_to_host`` queues the accepted counts' copy with the result's
    own; ``consume`` runs where sglang has committed the round's tokens, before streaming)."""

    __slots__ = ("accepted", "drafts", "sources", "tree")

    def __init__(self, accepted, drafts: List[int], sources: List[str], tree: bool = False):
        self.accepted = accepted  # [B] drafts accepted (a tensor on the round's device, or a list)
        self.drafts = drafts  # [B] drafts verified
        self.sources = sources  # [B] who drafted them
        self.tree = tree

    def copy_to_host(self, copy_tensor):
        if hasattr(self.accepted, "device"):
            self.accepted = copy_tensor(self.accepted)  # complete when the result's copy_done is
        return self

    def consume(self, batch, commits) -> None:
        """``commits[i]``: the tokens request i returned from this round, None where sglang did not
        count the round for it (finished before it, retracted)."""
        accepted = self.accepted.tolist() if hasattr(self.accepted, "tolist") else list(self.accepted)
        acc, drafts = [], []
        for i, (req, commit) in enumerate(zip(batch.reqs, commits)):
            if commit is None:
                continue
            a, d = int(accepted[i]), int(self.drafts[i])
            acc.append(a)
            drafts.append(d)
            c = counts_of(req)
            if c is not None:
                c.add(a, d, self.sources[i], len(commit.token_ids), self.tree)
        dlite_metrics.record_acceptance(acc, drafts)


def wanted(reqs) -> bool:
    """Whether a round's stats are needed: /metrics on, or some request of it gets metrics."""
    return dlite_metrics.enabled() or any(counts_of(r) is not None for r in reqs)


def round_stats(rd, accepted, opted_out: Optional[List[bool]]) -> RoundStats:
    """A worker round (``rounds.Round``) -> its ``RoundStats``: drafts verified per request (a chain's
    W - 1, 0 without drafts or for an opted-out request; a tree's nodes, its padding rows not
    counted) and their sources (the lookup's choice, ``dlite`` without the lookup)."""
    B, W = rd.tokens.shape[0], rd.tokens.shape[1]
    if rd.tree:
        drafts = [len(t) - 1 for t in rd.trees]
    else:
        n = W - 1 if rd.drafted else 0
        drafts = [0 if opted_out is not None and opted_out[i] else n for i in range(B)]
    sources = list(rd.sources) if len(rd.sources) == B else ["dlite"] * B  # a step with no draft: NO_DRAFT
    return RoundStats(accepted, drafts, sources, rd.tree)


def attach(logits_output, stats: RoundStats) -> None:
    # sglang's auxiliary output: a composite where another one is there already
    from sglang.srt.managers.auxiliary_output import append_auxiliary_output  # optional: sglang

    logits_output.auxiliary_device_output = append_auxiliary_output(logits_output.auxiliary_device_output, stats)


# ---------------------------------------------------------------------------- scheduler -> tokenizer
_STREAMERS: dict = {}


def streamer_class(base):
    """``base`` (sglang's ``SchedulerOutputStreamer`` or a plugin's subclass) that also emits the
    finished requests' summaries as the customized-info key ``META_KEY`` (only in a batch that has one)."""
    cls = _STREAMERS.get(base)
    if cls is not None:
        return cls

    class DLiteOutputStreamer(base):
        @property
        def has_additional_customized_info(self) -> bool:  # not under sglang's Rust egress (it refuses them)
            return super().has_additional_customized_info or getattr(self, "rust_server", None) is None

        def build_additional_customized_info(self, reqs) -> dict:
            out = {}
            if super().has_additional_customized_info and super().should_build_additional_customized_info():
                out = dict(super().build_additional_customized_info(reqs))
            values = [final_summary(r) for r in reqs]
            if any(values):
                out[META_KEY] = values
            return out

        def should_build_additional_customized_info(self) -> bool:
            return True

    DLiteOutputStreamer.__qualname__ = DLiteOutputStreamer.__name__ = "DLite" + base.__name__
    _STREAMERS[base] = DLiteOutputStreamer
    return DLiteOutputStreamer


def streamer_class_hook(original, scheduler, *args, **kwargs):
    """AROUND hook on ``Scheduler.get_output_streamer_class``: DLITE's streamer for a DLITE scheduler."""
    base = original(scheduler, *args, **kwargs)
    if getattr(getattr(scheduler, "spec_algorithm", None), "name", None) != "DLITE":
        return base
    return streamer_class(base)


def meta_info_hook(original, tm, meta_info, state, customized_info, index, *args, **kwargs):
    """AROUND hook on ``TokenizerManager.update_request_meta_info``: the summary (not a per-token list
    to accumulate) goes to ``meta_info[META_KEY]`` of its request only; other keys to sglang."""
    values = customized_info.get(META_KEY) if isinstance(customized_info, dict) else None
    if values is None:
        return original(tm, meta_info, state, customized_info, index, *args, **kwargs)
    rest = {k: v for k, v in customized_info.items() if k != META_KEY}
    if rest:
        original(tm, meta_info, state, rest, index, *args, **kwargs)
    mine = values[index]
    if mine:
        meta_info[META_KEY] = mine[0]
    return None
