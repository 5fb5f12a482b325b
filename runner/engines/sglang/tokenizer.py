"""The runner's Tokenizer over the Hugging Face tokenizer SGLang loaded."""

from __future__ import annotations

from typing import Any

from ..protocol import EngineError

# Single-token end-of-turn markers of common chat templates (added to eos_ids when the
# template writes them).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class SGLangTokenizer:
    """The runner's Tokenizer over the Hugging Face tokenizer SGLang loaded
    (`engine.tokenizer_manager.tokenizer`), so ids agree with the engine by construction."""

    def __init__(self, hf: Any, model_eos: Any = None) -> None:
        if hf is None:
            raise EngineError(
                "SGLang has no tokenizer (skip_tokenizer_init=True?); the runner needs it"
            )
        self.hf = hf
        source = getattr(hf, "chat_template", None)
        if isinstance(source, dict):  # named templates (e.g. "default", "tool_use")
            source = "\n".join(str(v) for v in source.values())
        self.template_source: str = source or ""
        self._eos = self._find_eos(model_eos)

    def _find_eos(self, model_eos: Any) -> frozenset[int]:
        ids: set[int] = set()
        eos = getattr(self.hf, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        if isinstance(model_eos, int):
            ids.add(model_eos)
        elif model_eos:  # generation config: a set or list of ids
            ids.update(int(t) for t in model_eos)
        unk = getattr(self.hf, "unk_token_id", None)
        for tok in END_OF_TURN_TOKENS:
            if tok not in self.template_source:
                continue
            try:
                tid = self.hf.convert_tokens_to_ids(tok)
            except Exception:
                continue
            if isinstance(tid, int) and tid >= 0 and tid != unk:
                ids.add(tid)
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if not self.template_source:
            raise EngineError("the model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages,
            tools=tools if tools and self.supports_tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    @property
    def supports_tools(self) -> bool:
        return "tools" in self.template_source

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos
