"""`--engine replay`: the assistant turns come from a script instead of a model.

Scripts: each task's `replay` list, or (`--replay-from PATH`) the assistant messages a
previous run wrote to its trajectories.jsonl. The n-th request of an agent (identified by
the `agent=` keyword of generate) gets the n-th entry; when the entries run out the reply
is a submit call. Token in, token out, like every engine: the entry is encoded with a
deterministic ChatML tokenizer (reversible word ids, runner/engines/chatml_tokenizer.py), cut
where a real engine would stop (a stop string, max_new_tokens, the context window) and ended
with the end-of-turn token otherwise; cached tokens are the common prefix with that agent's
previous request and reply. Tool behaviour, sandbox incidents and evaluation are then
reproduced end to end, exactly, without a model.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..chat.toolcall import format_call
from .chatml_tokenizer import EOS_ID, ChatMLTokenizer
from .protocol import CacheStats, ContextLimitExceeded, EngineError, Generation, SamplingParams

END_OF_SCRIPT = format_call("submit", {"answer": "replay: no more scripted turns"})


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def scripts_from_tasks(tasks: Sequence[Any]) -> dict[str, list[str]]:
    """task id -> its `replay` list (tasks without one get none: they submit at once)."""
    return {t.id: list(t.raw.get("replay") or []) for t in tasks}


def scripts_from_trajectories(path: Path) -> dict[str, list[str]]:
    """task id -> the assistant messages its agent generated in a previous run (the last
    `steps` assistant messages of the record: earlier ones came with the task)."""
    if path.is_dir():
        path = path / "trajectories.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"--replay-from: {path} does not exist")
    out: dict[str, list[str]] = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                tid, msgs, steps = rec["task_id"], rec.get("messages") or [], rec.get("steps", 0)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--replay-from {path}:{n}: not a trajectory line ({e})") from e
            said = [m["content"] for m in msgs if m.get("role") == "assistant"]
            out[tid] = said[len(said) - steps :] if steps else []
    return out


class ReplayEngine:
    name = "replay"

    def __init__(
        self,
        scripts: dict[str, list[str]],
        context_limit: int = 8192,
        source: str = "tasks",
        tokenizer: ChatMLTokenizer | None = None,  # e.g. one with another chat template
    ) -> None:
        self.model = f"replay ({source})"
        self._from_tasks = source == "tasks"
        self.context_limit = context_limit
        self.scripts = scripts
        self._tok = tokenizer or ChatMLTokenizer()
        self._turn: dict[str, int] = {}
        self._last: dict[str, list[int]] = {}  # the agent's previous prompt + output ids
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._closed = False

    @property
    def tokenizer(self) -> ChatMLTokenizer:
        return self._tok

    def add_tasks(self, tasks: Sequence[Any]) -> None:
        """Tasks that arrive after the engine was built (TaskScripted): their `replay` lists
        are the scripts, unless the scripts came from --replay-from."""
        if self._from_tasks:
            self.scripts.update(scripts_from_tasks(tasks))

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, agent: str | None = None
    ) -> Generation:
        if self._closed:
            raise EngineError("engine is shut down")
        if agent is None:
            raise EngineError("the replay engine needs the agent= of each request")
        if not input_ids:
            raise EngineError("empty prompt")
        t0 = time.perf_counter()
        room = self.context_limit - len(input_ids)
        if room < 2:
            raise ContextLimitExceeded(
                f"prompt of {len(input_ids)} tokens leaves no room in the "
                f"{self.context_limit}-token context"
            )
        n = self._turn.get(agent, 0)
        self._turn[agent] = n + 1
        script = self.scripts.get(agent, [])
        text = script[n] if n < len(script) else END_OF_SCRIPT
        ids = self._tok.encode(text)
        out, finish, eos = self._cut(ids, sampling, min(sampling.max_new_tokens, room - 1))
        cached = min(_common_prefix(self._last.get(agent, []), input_ids), len(input_ids) - 1)
        self._last[agent] = [*input_ids, *out]
        self.requests += 1
        self.prompt_tokens += len(input_ids)
        self.cached_tokens += cached
        await asyncio.sleep(0)  # a real engine yields: other agents run meanwhile
        visible = out[:-1] if eos else out
        return Generation(
            output_ids=out,
            text=self._tok.decode(visible),
            prompt_tokens=len(input_ids),
            cached_tokens=cached,
            completion_tokens=len(out),
            finish_reason=finish,
            seconds=time.perf_counter() - t0,
            stopped_on_eos=eos,
        )

    def _cut(self, ids: list[int], sp: SamplingParams, max_new: int) -> tuple[list[int], str, bool]:
        """What a sampling engine would return for a model that wants to say `ids` then end
        its turn: -> (output ids, finish reason, ended on EOS)."""
        pieces = [self._tok.decode([i]) for i in ids]
        text = "".join(pieces)
        ends = [text.find(s) + len(s) for s in sp.stop if s and s in text]
        if ends:  # stop at the token that completes the first stop string (kept, no EOS)
            end, acc = min(ends), 0
            for k, piece in enumerate(pieces, start=1):
                acc += len(piece)
                if acc >= end:
                    if k <= max_new:
                        return ids[:k], "stop", False
                    break
        if len(ids) >= max_new:
            return ids[:max_new], "length", False
        return [*ids, EOS_ID], "stop", True

    async def end_agent(self, agent: str) -> None:
        self._last.pop(agent, None)
        self._turn.pop(agent, None)

    def cache_stats(self) -> CacheStats:
        return CacheStats(
            usage=None,
            extra={
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
            },
        )

    async def aclose(self) -> None:
        self._closed = True


def replay_engine_from_args(args: Any, tasks: list[Any]) -> ReplayEngine:
    src = getattr(args, "replay_from", None)
    if src:
        return ReplayEngine(
            scripts_from_trajectories(Path(src)), context_limit=args.n_ctx, source=str(src)
        )
    return ReplayEngine(scripts_from_tasks(tasks), context_limit=args.n_ctx)
