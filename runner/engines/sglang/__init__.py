"""The GPU engine: SGLang's offline `Engine` in process, token in and token out.

`SGLangEngine` (engine.py) starts `sglang.Engine(model_path=..., **server_args)` in this
process (its scheduler and detokenizer run as child processes) and talks to it only through
calls that are safe inside a running event loop:

- requests: `await engine.async_generate(input_ids=..., sampling_params=..., ...)`; the
  agent's ids go in unchanged and the engine's `output_ids` come back unchanged.
  `return_logprob=True` is sent only when SamplingParams.logprobs asks for it; no
  `logprob_start_len` is ever sent: prompt logprobs cap the radix-cache match and silently
  kill prefix reuse.
- signals (loads.py): `engine.tokenizer_manager.load_snapshot_reader.read_all()` (a
  shared-memory read, one snapshot per DP rank) for U; on releases without it,
  `await tokenizer_manager.get_loads()` polled by a background task.
- sessions: `await tokenizer_manager.close_session(CloseSessionReqInput(session_id=...))`;
  what each release needs to enable them is in versions.py.

The synchronous `Engine` helpers (`generate`, `get_server_info`, `flush_cache`,
`open_session`, `close_session`, ...) call `loop.run_until_complete` and must never run
inside the runner's event loop; this package never calls them. `engine.shutdown()` is the
one synchronous call, made once from `aclose()` in a worker thread.

sglang is imported lazily inside `SGLangEngine.__init__`, so this package imports (and its
tests run) on machines without SGLang or a GPU. The command line is in args.py, the
tokenizer in tokenizer.py. docs/sglang.md lists every SGLang call and key used here with
the source file it comes from; tests/contract/test_sglang_source.py checks them against the
released wheel.
"""

from .args import (
    add_sglang_arguments,
    parse_engine_args,
    parse_value,
    sglang_available,
    sglang_engine_from_args,
)
from .engine import SGLangEngine
from .tokenizer import SGLangTokenizer

__all__ = [
    "SGLangEngine",
    "SGLangTokenizer",
    "add_sglang_arguments",
    "parse_engine_args",
    "parse_value",
    "sglang_available",
    "sglang_engine_from_args",
]
