"""The one tool-call syntax the runner speaks (Hermes / Qwen style), and its only owner:

    <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>

The tags, the stop string, the text that teaches the syntax to a model whose chat template
has no tools, and the parser all live here; engines that constrain decoding import the tags
from here too. Small models get it wrong in many ways; every failure becomes a `ParseError`
whose message is meant for the model (it is sent back as the observation), so it can
correct itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Generation stops where a call closes: one call per reply, and nothing after it to discard.
STOP = CLOSE
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")

FORMAT_HELP = (
    f'Call exactly one tool per reply, written as {OPEN}{{"name": "<tool name>", '
    f'"arguments": {{...}}}}{CLOSE}.'
)
# Appended to the system prompt when the chat template cannot render tool schemas itself.
_TOOLS_IN_PROMPT = f"""

# Tools
You may call one of these tools per reply. Their JSON schemas:
{{schemas}}

To call a tool, write a JSON object with "name" and "arguments" inside {OPEN}{CLOSE} tags, for example:
{OPEN}{{{{"name": "bash", "arguments": {{{{"command": "ls"}}}}}}}}{CLOSE}"""  # noqa: E501


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call written in the syntax (what a model is expected to write)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CLOSE}"


def prose(text: str) -> str:
    """A reply without its tool-call block(s): the text a structured message keeps as
    `content` beside its `tool_calls`."""
    return _BLOCK.sub("", text).strip()


def tools_prompt(function_schemas: list[dict[str, Any]]) -> str:
    """The system-prompt text describing the tools and the syntax (one schema per line)."""
    return _TOOLS_IN_PROMPT.format(schemas="\n".join(json.dumps(s) for s in function_schemas))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ParseError(ValueError):
    """The reply held no usable tool call; str(self) is the message for the model."""


def parse_tool_call(text: str, known: set[str] | frozenset[str]) -> ToolCall:
    """The first tool call in `text`. Raises ParseError for none, malformed or unknown."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        raise ParseError(f"Your reply contained no tool call. {FORMAT_HELP}")
    raw = _FENCE.sub("", blocks[0].strip())
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        obj = _lenient(raw)
        if obj is None:
            snippet = raw[:200] + ("..." if len(raw) > 200 else "")
            raise ParseError(
                f"Your tool call is not valid JSON ({e.msg} at char {e.pos}): {snippet!r}. "
                f"{FORMAT_HELP}"
            ) from None
    if not isinstance(obj, dict):
        raise ParseError(f"A tool call must be a JSON object. {FORMAT_HELP}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ParseError(f'Your tool call has no "name". {FORMAT_HELP}')
    if name not in known:
        raise ParseError(
            f"Unknown tool {name!r}. Available tools: {', '.join(sorted(known))}. {FORMAT_HELP}"
        )
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ParseError(
                f'The "arguments" of {name!r} must be a JSON object, got a string. {FORMAT_HELP}'
            ) from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ParseError(f'The "arguments" of {name!r} must be a JSON object. {FORMAT_HELP}')
    return ToolCall(name, args)


def _lenient(raw: str) -> Any:
    """Recover the common near-misses: trailing text after the object, a missing final brace."""
    start = raw.find("{")
    if start < 0:
        return None
    dec = json.JSONDecoder()
    for candidate in (raw[start:], raw[start:] + "}", raw[start:] + "}}"):
        try:
            obj, _ = dec.raw_decode(candidate)
            return obj
        except json.JSONDecodeError:
            continue
    return None
