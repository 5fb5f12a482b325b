"""Tokenizer and chat template of a GGUF model, through llama.cpp's own vocabulary."""

from __future__ import annotations

import ctypes
from typing import Any

from ...chat.template import ChatTemplate
from ..protocol import EngineError


class LlamaTokenizer:
    """Implements runner.engines.protocol.Tokenizer over a loaded llama.cpp model. Token pieces are
    kept once read: decoding is then a join of bytes."""

    def __init__(self, model: Any, path: str) -> None:
        import llama_cpp

        self._lc = llama_cpp
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.closed = False
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._pieces: dict[tuple[int, bool], bytes] = {}
        source = llama_cpp.llama_model_chat_template(model, None)
        if not source:
            raise EngineError(f"{path}: the GGUF carries no chat template")
        self.bos_id = llama_cpp.llama_vocab_bos(self._vocab)
        bos = self._piece(self.bos_id, True).decode("utf-8", "replace")
        eos_id = llama_cpp.llama_vocab_eos(self._vocab)
        eos = self._piece(eos_id, True).decode("utf-8", "replace")
        self.template = ChatTemplate(source.decode("utf-8"), bos_token=bos, eos_token=eos)
        ids = {eos_id}
        for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            t = self.encode(special)
            if len(t) == 1:
                ids.add(t[0])
        self._eos = frozenset(ids)

    def _check(self) -> None:
        if self.closed:
            raise EngineError("the engine is shut down; its tokenizer cannot be used")

    def _piece(self, token: int, special: bool) -> bytes:
        key = (token, special)
        p = self._pieces.get(key)
        if p is None:
            buf = ctypes.create_string_buffer(64)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
            if n < 0:  # a longer piece: its size, negated
                buf = ctypes.create_string_buffer(-n)
                n = self._lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            p = self._pieces[key] = buf.raw[:n]
        return p

    def encode(self, text: str) -> list[int]:
        self._check()
        data = text.encode("utf-8")
        n_max = len(data) + 8
        out = (self._lc.llama_token * n_max)()
        n = self._lc.llama_tokenize(self._vocab, data, len(data), out, n_max, False, True)
        if n < 0:
            n_max = -n
            out = (self._lc.llama_token * n_max)()
            n = self._lc.llama_tokenize(self._vocab, data, len(data), out, n_max, False, True)
        return list(out[:n])

    def decode_bytes(self, ids: list[int]) -> bytes:
        self._check()
        out = b"".join(self._piece(int(t), False) for t in ids)
        # as llama-cpp-python's detokenize: a BOS's leading space is not text
        if ids and ids[0] == self.bos_id and out[:1] == b" ":
            out = out[1:]
        return out

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", "replace")

    def piece(self, token_id: int) -> bytes:
        """The token's bytes as llama.cpp's grammar reads them (special tokens rendered)."""
        return self._piece(token_id, True)

    def token_text(self, token_id: int) -> str:
        self._check()
        return self._piece(token_id, True).decode("utf-8", "replace")

    def render(self, messages, tools=None, add_generation_prompt=True) -> str:
        return self.template.render(messages, tools, add_generation_prompt)

    @property
    def supports_tools(self) -> bool:
        return self.template.supports_tools

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos
