"""The simulator's tokenizer: a ChatML template over a synthetic vocabulary.

Simulation assumption: what matters to the cache and the cost model is how many tokens each
piece of text has and which of them are shared between requests, not what they say. So:
- ordinary words map to stable hashed ids (whitespace runs too), and decode back exactly;
- a "span" written as `⟦n:seed⟧` stands for n content tokens with ids unique to `seed`:
  a workload writes a 12,000-token tool observation as one short string, and two agents
  share tokens only where they share seeds (the system prompt);
- ChatML's special tokens are single ids, the end-of-turn token is the EOS.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..chat.template import ChatTemplate

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
EOS_ID = SPECIALS["<|im_end|>"]
SPAN_BASE = 1 << 48  # span ids live above every hashed word id
SPAN_STRIDE = 1 << 24  # at most 16M tokens per span
_PIECES = re.compile(
    r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|⟦(\d+):(\d+)⟧|\s+|[^\s⟦<]+|.", re.DOTALL
)


def span(n: int, seed: int) -> str:
    """Text standing for n tokens unique to seed."""
    return f"⟦{n}:{seed}⟧"


def span_ids(n: int, seed: int) -> list[int]:
    base = SPAN_BASE + seed * SPAN_STRIDE
    return list(range(base, base + n))


class ChatMLTokenizer:
    def __init__(self) -> None:
        self.template = ChatTemplate(CHATML)
        self._words: dict[int, str] = {v: k for k, v in SPECIALS.items()}
        self._ids: dict[str, int] = {}  # word -> id, of the words seen

    def _word_id(self, w: str) -> int:
        wid = self._ids.get(w)
        if wid is not None:  # the same few words recur in every prompt: hash each once
            return wid
        wid = 16 + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=5).digest(), "big")
        known = self._words.setdefault(wid, w)
        if known != w:  # 2^40 ids: a collision would silently merge two words
            raise ValueError(f"sim tokenizer hash collision: {known!r} vs {w!r}")
        self._ids[w] = wid
        return wid

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for m in _PIECES.finditer(text):
            piece = m.group(0)
            if piece in SPECIALS:
                out.append(SPECIALS[piece])
            elif m.group(1) is not None:
                out += span_ids(int(m.group(1)), int(m.group(2)))
            else:
                out.append(self._word_id(piece))
        return out

    def decode(self, ids: list[int]) -> str:
        # spans decode to nothing: nobody reads them, only counts them
        return "".join(self._words.get(i, "") for i in ids if i >= 16 and i < SPAN_BASE)

    def token_text(self, token_id: int) -> str:
        return self._words.get(token_id, "")

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self.template.render(messages, tools, add_generation_prompt)

    @property
    def supports_tools(self) -> bool:
        return False

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset({EOS_ID})
