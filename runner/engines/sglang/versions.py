"""What an SGLang release needs for the adapter's opt-ins, read from the released wheels.

Most differences between releases the adapter detects from the running engine
(`async_generate`'s keywords, `tokenizer_manager.load_snapshot_reader`). The session radix
cache cannot be detected that way: its server arguments are checked inside `ServerArgs`,
before any engine exists, so the release number decides. Measured on the wheels of
0.5.9 to 0.5.23 (tests/contract/test_sglang_source.py re-checks one release of each row):

- before 0.5.15: ServerArgs has no `enable_session_radix_cache` (TypeError at start);
- 0.5.15, 0.5.16: it exists, and ServerArgs raises unless `radix_eviction_policy="priority"`;
- 0.5.17, 0.5.18: the session radix cache needs the unified radix tree, enabled by the
  environment variable SGLANG_ENABLE_UNIFIED_RADIX_TREE=1;
- 0.5.19 on: the unified tree is the default (0.5.19-0.5.22 warn that the variable is
  deprecated; 0.5.23 no longer knows it).
"""

from __future__ import annotations

import importlib.metadata
import re

from ..protocol import EngineError

Version = tuple[int, int, int]

UNIFIED_TREE_ENV = "SGLANG_ENABLE_UNIFIED_RADIX_TREE"
SESSIONS_SINCE: Version = (0, 5, 15)
PRIORITY_EVICTION_UNTIL: Version = (0, 5, 17)  # exclusive
UNIFIED_ENV_UNTIL: Version = (0, 5, 19)  # exclusive


def parse_version(text: str) -> Version | None:
    """ "0.5.15.post1" -> (0, 5, 15); None when it does not start with three numbers."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def installed_version() -> Version | None:
    """The installed sglang distribution's release, or None (not installed as a
    distribution: a source tree on sys.path, or a test double)."""
    try:
        return parse_version(importlib.metadata.version("sglang"))
    except importlib.metadata.PackageNotFoundError:
        return None


def show(version: Version | None) -> str:
    return ".".join(map(str, version)) if version else "an unknown release"


def session_requirements(version: Version | None) -> tuple[dict[str, object], dict[str, str]]:
    """(server args, environment variables) the session radix cache needs on `version`.
    An unknown release is taken to be a current one. Raises EngineError where it has none."""
    if version is not None and version < SESSIONS_SINCE:
        raise EngineError(
            f"sessions need sglang >= {show(SESSIONS_SINCE)} (the session radix cache); "
            f"sglang {show(version)} has no enable_session_radix_cache server argument. "
            "Upgrade sglang or run without --sglang-sessions"
        )
    server_args: dict[str, object] = {"enable_session_radix_cache": True}
    env: dict[str, str] = {}
    if version is not None and version < PRIORITY_EVICTION_UNTIL:
        server_args["radix_eviction_policy"] = "priority"
    elif version is not None and version < UNIFIED_ENV_UNTIL:
        env[UNIFIED_TREE_ENV] = "1"
    return server_args, env
