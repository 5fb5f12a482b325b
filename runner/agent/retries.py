"""Engine requests retried on transient failures (tenacity): timeouts, aborted or retracted
requests, out-of-memory aborts, lost connections (TransientEngineError, TimeoutError,
ConnectionError). Exponential backoff with jitter, bounded in attempts and in total time;
each retry is logged and counted. Everything else (a context limit, invalid arguments, any
other EngineError) fails at once: trying again would fail the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from ..engines.protocol import (
    ContextLimitExceeded,
    Engine,
    Generation,
    SamplingParams,
    TransientEngineError,
)

log = logging.getLogger("concur")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # in all, the first one included
    max_seconds: float = 120.0  # no new attempt after this long since the first
    initial_wait: float = 0.5  # before the first retry; doubles each time, plus jitter
    max_wait: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_seconds < 0 or self.initial_wait < 0:
            raise ValueError(f"bad retry policy {self}")


def is_transient(e: BaseException) -> bool:
    if isinstance(e, ContextLimitExceeded):
        return False
    return isinstance(e, TransientEngineError | TimeoutError | ConnectionError)


async def generate(
    engine: Engine,
    ids: list[int],
    sampling: SamplingParams,
    agent: str,
    policy: RetryPolicy,
    on_retry: Callable[[], None] = lambda: None,
) -> Generation:
    """engine.generate, with transient failures retried under `policy`; the last failure
    propagates when the attempts or the time run out."""

    def before_sleep(state: RetryCallState) -> None:
        on_retry()
        e = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        log.warning(
            "agent %s: engine request failed (%s: %s); retry %d of %d in %.1fs",
            agent,
            type(e).__name__,
            e,
            state.attempt_number,
            policy.attempts - 1,
            wait,
        )

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.attempts) | stop_after_delay(policy.max_seconds),
        # initial_wait * 2**k (at most max_wait), plus up to initial_wait of jitter
        wait=wait_exponential(multiplier=policy.initial_wait, max=policy.max_wait)
        + wait_random(0, policy.initial_wait),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return await engine.generate(ids, sampling, agent=agent)
    raise AssertionError("tenacity ended without an outcome")  # reraise=True: unreachable
