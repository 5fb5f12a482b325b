"""Chat templates (Jinja, as shipped in GGUF / Hugging Face tokenizer configs) and the token-in
token-out turn deltas the agent loop needs.

The conversation is rendered ONCE (system + first user turn). Every later turn is appended
as a delta: the text that the template would put after the assistant's content, i.e. the
assistant's closing tokens plus the observation turn plus the next generation prompt. The
delta is found by rendering a tiny conversation around a marker, so it is exactly what the
template writes, for any template, without re-rendering (and re-tokenizing) the past.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

_MARK = "\x00CONCUR-MARK\x00"
# chat templates shipped with the runner, by name (NAME.jinja): docs/outputs.md
SHIPPED = Path(__file__).resolve().parent / "templates"


def shipped(name: str) -> Path:
    """The path of the shipped chat template `name`; ValueError naming those there are."""
    path = SHIPPED / f"{name}.jinja"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.jinja")))
        raise ValueError(f"no shipped chat template {name!r} (shipped: {names})")
    return path


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' mark of the assistant's text
    (its assistant-token mask, TRL's assistant_only_loss): rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(msg: str) -> None:
    raise TemplateError(msg)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation]
        )
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(
            v, indent=indent, ensure_ascii=False
        )
        self.source = source
        self._tmpl = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.supports_tools = "tools" in source
        # transformers' assistant-token mask needs these marks (TRL's assistant_only_loss)
        self.marks_generation = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        kw: dict[str, Any] = {}
        if tools and self.supports_tools:
            kw["tools"] = tools
        return self._tmpl.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kw,
        )


def turn_delta(render: Any, role: str, content: str, eos_text: str) -> str:
    """Text to append after an assistant reply so that the conversation continues with a
    `role` turn holding `content` and a fresh generation prompt.

    `render(messages, add_generation_prompt)` is the tokenizer's template. If the reply ended
    on the end-of-turn token (which the engine already put in the agent's ids), that token's
    text is not written twice."""
    head = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _MARK},
    ]
    closed = render(head, False)
    close = closed[closed.index(_MARK) + len(_MARK) :]
    full = render([*head, {"role": role, "content": content}], True)
    after = full[full.index(_MARK) + len(_MARK) :]
    if not after.startswith(close):
        raise ValueError(
            "chat template renders the assistant turn differently when followed "
            "by another turn; cannot append turns token by token"
        )
    if eos_text and close.startswith(eos_text):
        return after[len(eos_text) :]
    return after
