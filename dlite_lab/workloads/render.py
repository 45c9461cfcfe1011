"""Render a workload conversation into token-level turns with the target's chat template.

For every assistant message at index j, turn j's ``prompt_ids`` are ``messages[:j]`` rendered with
the chat template and the generation prompt; ``reference_ids`` are the recorded reply's tokens
(the tokens the template adds for message j after that prompt: the reply text, then the
template's end-of-turn tokens), or None when there is nothing recorded (a generated placeholder,
or the final generated turn of a conversation that ends on a non-assistant message).

Template adaptations (so a template without tool support still sees the tools):
- ``tools``: if ``apply_chat_template(..., tools=...)`` actually renders them (probed with a dummy
  function name), they are passed that way; otherwise they are written into the system prompt as
  JSON (one function schema per line) with a short instruction on the call format. A conversation
  without a system message gets one (replacing the template's default system prompt, if any).
- ``tool`` messages, when the template has no tool role (its source never mentions "tool"): they
  become user messages prefixed "Tool result:" — the model then reads them as a turn from its
  user, which is what a ChatML-only model was trained to condition on; an unknown "tool" role
  header would be out of distribution.
- assistant messages with OpenAI ``tool_calls`` and no tool support: the calls are appended to
  the content as JSON.

Prefix property: the prompt of turn j+1 extends ``prompt_ids + reference_ids`` of turn j whenever
the template renders earlier messages unchanged (true for ChatML templates such as SmolLM2's), so
an engine session reuses the target KV across turns. Prompts are tokenized as whole rendered
strings (never concatenated token lists), so they are exactly what a server would see.

Turns whose prompt exceeds ``max_context_tokens`` are skipped and counted (``TurnList.skipped``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

from dlite_lab.workloads.format import is_placeholder

TOOLS_SYSTEM_HEADER = (
    "You have access to the following tools (JSON function schemas, one per line):\n"
)
TOOLS_SYSTEM_FOOTER = (
    "\nTo call a tool, reply with a JSON object {\"name\": <tool name>, \"arguments\": {...}}."
)
DEFAULT_TOOL_SYSTEM = "You are a helpful assistant with access to tools."
TOOL_RESULT_PREFIX = "Tool result:"
_PROBE = "zq_dlite_probe_fn"


@dataclass
class Turn:
    prompt_ids: list
    reference_ids: Optional[list]  # None: nothing recorded (generated turn)
    conv_id: str = ""
    index: int = 0  # message index j of the turn (len(messages) for a final generated turn)
    placeholder: bool = False  # generated, and the conversation continues with the generated reply


class TurnList(list):
    """list[Turn] with the turns skipped for being over the context limit: ``skipped_ids``
    (conversation id, message index, prompt length or None when skipped after a skipped
    placeholder), ``skipped`` their count."""

    def __init__(self, *a):
        super().__init__(*a)
        self.skipped_ids = []

    @property
    def skipped(self) -> int:
        return len(self.skipped_ids)


@dataclass
class TemplateCaps:
    tools: bool
    tool_role: bool


_CAPS: dict = {}


def template_caps(tokenizer) -> TemplateCaps:
    """What the chat template supports (once per tokenizer): tools given as ``tools=`` (probed with a
    dummy function name) and a tool role (its source mentions "tool")."""
    key = id(tokenizer)
    if key not in _CAPS:
        src = tokenizer.chat_template
        src = src if isinstance(src, str) else json.dumps(src)
        try:
            probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                       "parameters": {"type": "object", "properties": {}}}}]
            tools_ok = _PROBE in tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=probe,
                                                               tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - any template failure means "no tool support"
            tools_ok = False
        _CAPS[key] = TemplateCaps(tools=tools_ok, tool_role="tool" in (src or ""))
    return _CAPS[key]


def turn_indices(messages: list) -> list:
    """The message index j of every turn: each assistant message, and len(messages) (the final
    generated turn) when the conversation does not end on one."""
    out = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    return out if messages and messages[-1]["role"] == "assistant" else out + [len(messages)]


def count_turns(conversation: dict) -> int:
    return len(turn_indices(conversation["messages"]))


def adapt_messages(messages: list, tools: Optional[list], caps: TemplateCaps) -> list:
    """The conversation's messages as the template should see them (see the module docstring)."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool" and not caps.tool_role:
            name = m.get("name")
            head = f"{TOOL_RESULT_PREFIX}" if not name else f"{TOOL_RESULT_PREFIX} ({name})"
            out.append({"role": "user", "content": f"{head}\n{content}"})
            continue
        msg = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            if caps.tools:
                msg["tool_calls"] = m["tool_calls"]
            else:
                calls = "\n".join(json.dumps(c.get("function", c)) for c in m["tool_calls"])
                msg["content"] = (content + "\n" + calls).strip()
        if role == "tool" and m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    if tools and not caps.tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": tools_system_prompt(tools, out[0]["content"])}
        else:
            out.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
    return out


def tools_system_prompt(tools: list, system: Optional[str] = None) -> str:
    """The system prompt with the tools written in (for a template without tool support): the
    conversation's own system prompt, or ``DEFAULT_TOOL_SYSTEM``, then one JSON schema per line."""
    block = TOOLS_SYSTEM_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_SYSTEM_FOOTER
    return (DEFAULT_TOOL_SYSTEM if system is None else system) + "\n\n" + block


def _encode_chat(tokenizer, messages: list, tools, caps: TemplateCaps, generation_prompt: bool) -> list:
    kw = {"tools": tools} if (tools and caps.tools) else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def default_context_limit(tokenizer, max_new_tokens: int = 0, model_limit: Optional[int] = None) -> Optional[int]:
    limit = model_limit
    if limit is None:
        m = getattr(tokenizer, "model_max_length", None)
        limit = m if isinstance(m, int) and m < 10_000_000 else None
    return None if limit is None else limit - max(0, max_new_tokens)


def render_turns(tokenizer, conversation: dict, max_context_tokens: Optional[int] = None, *,
                 max_new_tokens: int = 0, model_limit: Optional[int] = None,
                 generate: Optional[Callable[[Turn], list]] = None, decode_skip_ids=()) -> TurnList:
    """Token-level turns of one conversation (see the module docstring).

    ``max_context_tokens`` defaults to the model limit (``model_limit``, else the tokenizer's
    ``model_max_length`` when sane) minus ``max_new_tokens``; no limit if neither is known.

    ``generate(turn) -> reply token ids``: called for every turn that is not skipped, in order.
    A placeholder's reply (decoded, without the ids in ``decode_skip_ids``, e.g. EOS) becomes the
    message content for later turns. Without ``generate``, rendering stops after the first
    placeholder (later turns depend on its reply); the turns after it are not returned.
    """
    caps = template_caps(tokenizer)
    tools = conversation.get("tools")
    msgs = [dict(m) for m in conversation["messages"]]
    cid = str(conversation.get("id", ""))
    if max_context_tokens is None:
        max_context_tokens = default_context_limit(tokenizer, max_new_tokens, model_limit)
    targets = turn_indices(msgs)
    out = TurnList()
    skip = set(int(t) for t in decode_skip_ids)
    for n, j in enumerate(targets):
        placeholder = j < len(msgs) and is_placeholder(msgs[j])
        prompt = _encode_chat(tokenizer, adapt_messages(msgs[:j], tools, caps), tools, caps, True)
        if max_context_tokens is not None and len(prompt) > max_context_tokens:
            out.skipped_ids.append((cid, j, len(prompt)))
            if placeholder:  # later turns need this reply: skip them all
                out.skipped_ids += [(cid, k, None) for k in targets[n + 1:]]
                break
            continue
        ref = None
        if j < len(msgs) and not placeholder:
            full = _encode_chat(tokenizer, adapt_messages(msgs[: j + 1], tools, caps), tools, caps, False)
            if full[: len(prompt)] == prompt and len(full) > len(prompt):
                ref = full[len(prompt):]
            else:  # the template rewrites history (e.g. strips thinking): plain content tokens
                ref = list(tokenizer(msgs[j].get("content") or "", add_special_tokens=False)["input_ids"])
        turn = Turn(prompt_ids=prompt, reference_ids=ref, conv_id=cid, index=j, placeholder=placeholder)
        out.append(turn)
        reply = generate(turn) if generate is not None else None
        if placeholder:
            if reply is None:
                break
            ids = [int(t) for t in reply if int(t) not in skip]
            msgs[j] = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return out
