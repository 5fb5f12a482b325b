"""parse_tool_call: the happy path, the near-misses it recovers, and the errors it explains."""

from __future__ import annotations

import pytest

from runner.chat.toolcall import FORMAT_HELP, ParseError, ToolCall, parse_tool_call

KNOWN = frozenset({"bash", "submit", "read_file"})
LS = ToolCall("bash", {"command": "ls"})


def parse(text: str) -> ToolCall:
    return parse_tool_call(text, KNOWN)


def error(text: str) -> str:
    with pytest.raises(ParseError) as ei:
        parse(text)
    msg = str(ei.value)
    assert FORMAT_HELP in msg, msg  # every message teaches the format
    return msg


# ---------------------------------------------------------------- accepted


def test_well_formed():
    call = parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
    assert call == LS
    assert isinstance(call, ToolCall)


def test_text_around_the_call():
    text = 'Let me look.\n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>\n'
    assert parse(text) == LS


def test_whitespace_and_newlines_inside_tags():
    text = (
        '<tool_call>\n\n  {\n  "name": "bash",\n  "arguments": {"command": "ls"}\n}\n\t</tool_call>'
    )
    assert parse(text) == LS


@pytest.mark.parametrize(
    "body",
    [
        '```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```',
        '```\n{"name": "bash", "arguments": {"command": "ls"}}\n```',
        '\n```json {"name": "bash", "arguments": {"command": "ls"}} ```\n',
    ],
)
def test_fenced_json_inside_tags(body):
    assert parse(f"<tool_call>{body}</tool_call>") == LS


def test_missing_closing_tag():
    assert parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}') == LS
    assert parse('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n') == LS


def test_trailing_garbage_after_the_object():
    text = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}} hope it works}</tool_call>'
    assert parse(text) == LS
    assert parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}}</tool_call>') == LS


def test_missing_final_brace():
    assert parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}</tool_call>') == LS
    # both closing braces missing, and no closing tag either
    assert parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"') == LS


def test_arguments_as_json_encoded_string():
    text = '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>'
    assert parse(text) == LS


def test_parameters_instead_of_arguments():
    assert parse('<tool_call>{"name": "bash", "parameters": {"command": "ls"}}</tool_call>') == LS


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "submit"}</tool_call>',
        '<tool_call>{"name": "submit", "arguments": null}</tool_call>',
        '<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
    ],
)
def test_no_arguments_means_empty_dict(text):
    assert parse(text) == ToolCall("submit", {})


def test_nested_and_unicode_arguments_survive():
    text = (
        '<tool_call>{"name": "read_file", "arguments": '
        '{"path": "ü/a.py", "range": [1, 2], "opts": {"raw": true}}}</tool_call>'
    )
    assert parse(text) == ToolCall(
        "read_file", {"path": "ü/a.py", "range": [1, 2], "opts": {"raw": True}}
    )


def test_two_calls_first_wins():
    text = (
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>\n'
        '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'
    )
    assert parse(text) == LS


def test_known_can_be_dict_keys():
    """The agent passes `self.tools.keys()`."""
    tools = {"bash": object(), "submit": object()}
    assert parse_tool_call('<tool_call>{"name": "submit"}</tool_call>', tools.keys()).name == (
        "submit"
    )


# ---------------------------------------------------------------- rejected


def test_unknown_tool_lists_available_tools():
    msg = error('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert "Unknown tool 'python'" in msg
    for name in KNOWN:
        assert name in msg


@pytest.mark.parametrize(
    "text",
    [
        "",
        "I think the bug is in pager.py.",
        '{"name": "bash", "arguments": {"command": "ls"}}',  # JSON, but no tags
        '<tool_call >{"name": "bash"}</tool_call>',
    ],
)
def test_no_tool_call(text):
    assert "no tool call" in error(text)


@pytest.mark.parametrize(
    "body",
    [
        "{'name': 'bash', 'arguments': {'command': 'ls'}}",  # Python quotes
        '{"name": "bash", "arguments": {"command": "ls",}}',  # trailing comma
        "bash ls",
        "",
    ],
)
def test_invalid_json(body):
    msg = error(f"<tool_call>{body}</tool_call>")
    assert "not valid JSON" in msg


def test_invalid_json_snippet_is_truncated():
    body = "{" + "x" * 1000
    msg = error(f"<tool_call>{body}</tool_call>")
    assert "not valid JSON" in msg
    assert "..." in msg and len(msg) < 600


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {"command": "ls"}}',
        '{"name": "", "arguments": {}}',
        '{"name": 5, "arguments": {}}',
        '{"tool": "bash", "arguments": {}}',
    ],
)
def test_name_missing(body):
    assert 'no "name"' in error(f"<tool_call>{body}</tool_call>")


@pytest.mark.parametrize("body", ['[{"name": "bash"}]', '"bash"', "42"])
def test_not_an_object(body):
    assert "must be a JSON object" in error(f"<tool_call>{body}</tool_call>")


@pytest.mark.parametrize(
    "args",
    ['["ls"]', '"ls"', "5", "true", '"[1, 2]"', '"{not json}"'],
)
def test_arguments_not_an_object(args):
    msg = error(f'<tool_call>{{"name": "bash", "arguments": {args}}}</tool_call>')
    assert "\"arguments\" of 'bash' must be a JSON object" in msg


def test_first_call_wins_even_when_it_is_broken():
    text = (
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    )
    assert "Unknown tool 'nope'" in error(text)


def test_parse_error_is_a_value_error():
    assert issubclass(ParseError, ValueError)


def test_call_schema_covers_each_tool_and_its_arguments():
    from tools.core import call_schema
    from tools.registry import get_tools

    tools = get_tools(("bash", "submit"))
    alts = call_schema(tools)["oneOf"]
    assert [a["properties"]["name"]["const"] for a in alts] == ["bash", "submit"]
    assert alts[0]["properties"]["arguments"] == tools["bash"].parameters
    assert all(a["required"] == ["name", "arguments"] for a in alts)
