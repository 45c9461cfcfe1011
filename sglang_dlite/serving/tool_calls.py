"""The bundled target's tool-call parser: ``--tool-call-parser smollm2`` (registered by the plugin in
the process that runs sglang's HTTP server; ``sglang-dlite serve`` passes it for the default target).

SmolLM2 writes a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format its
family's tool prompt asks for, and that ``chat_templates/smollm2_tools.jinja`` lists the tools in):
sglang's ``hermes`` format, parsed by its ``HermesDetector``. What this subclass changes is the
grammar sglang constrains generation with. sglang 0.5.23's hermes grammar (the legacy structural
tag) admits every tool under a named ``tool_choice`` (measured: ``{"function": {"name":
"calculate"}}`` came back as a ``get_weather`` call), constrains the arguments to the tool's schema
only for ``strict`` tools, and lets text follow a forced call. Here, with xgrammar's structural tags:

- ``"required"`` / a named tool: only ``<tool_call>`` blocks (one for a named tool or
  ``parallel_tool_calls=false``), each naming a tool sglang allows, its arguments valid against that
  tool's JSON schema; generation ends after the last block;
- ``"auto"``: free text; once the model writes ``<tool_call>``, the same call grammar.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.entrypoints.openai.protocol import ToolChoice
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.function_call.hermes_detector import HermesDetector
from xgrammar import StructuralTag

PARSER_NAME = "smollm2"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def _call_tags(tools: list) -> list:
    tags = []
    for tool in tools:
        fn = tool.function
        schema = fn.parameters if isinstance(fn.parameters, dict) and fn.parameters else {"type": "object"}
        tags.append({"type": "tag", "begin": f'{CALL_OPEN}{{"name": "{fn.name}", "arguments": ',
                     "content": {"type": "json_schema", "json_schema": schema}, "end": "}" + CALL_CLOSE})
    return tags


def call_structural_tag(tools: Optional[list], tool_choice: Any = "auto",
                        parallel_tool_calls: bool = True) -> Optional[StructuralTag]:
    """The xgrammar structural tag for ``tools`` under ``tool_choice`` (None: nothing to call)."""
    named = isinstance(tool_choice, ToolChoice)
    if named:
        tools = [t for t in tools or () if t.function.name == tool_choice.function.name]
    if not tools:
        return None
    tags = _call_tags(tools)
    one = named or not parallel_tool_calls
    if named or tool_choice == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": one}
    else:
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags, "at_least_one": False,
               "stop_after_first": one}
    return StructuralTag.model_validate({"type": "structural_tag", "format": fmt})


class SmolLM2Detector(HermesDetector):
    """hermes parsing; the grammar of ``call_structural_tag``."""

    def get_structural_tag(self, tools=None, tool_choice="auto", thinking_mode=False, parallel_tool_calls=True):
        return call_structural_tag(tools, tool_choice, parallel_tool_calls)

    def get_auto_tool_call_structural_tag(self, tools=None, thinking_mode=False, parallel_tool_calls=True):
        return call_structural_tag(tools, "auto", parallel_tool_calls)


def register_parser() -> None:
    """Add ``smollm2`` to sglang's tool-call parsers (before sglang parses its arguments: the
    ``--tool-call-parser`` choices are read from the same table)."""
    FunctionCallParser.ToolCallParserEnum.setdefault(PARSER_NAME, SmolLM2Detector)
