"""The SGLang command line: flags, --engine-arg / --sampling-arg parsing, the --engine auto
check, and building the engine from parsed flags."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import shutil
from typing import Any

from .engine import DP_ASSIGN, INSTALL_HINT, SGLangEngine


def parse_value(text: str) -> Any:
    """An --engine-arg value: true/false -> bool, none/null -> None, int, float, else str.
    Quote a value ('"1"') to keep it a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    with contextlib.suppress(ValueError):
        value = float(text)
        if value == value and value not in (float("inf"), float("-inf")):
            return value
    return text


def parse_engine_args(items: list[str] | None, flag: str = "--engine-arg") -> dict[str, Any]:
    """`["tp_size=2", "enable-hierarchical-cache=true"]` -> `{"tp_size": 2, ...}`.

    Keys may be written with dashes or a leading `--` (as on SGLang's own command line);
    they become ServerArgs field names. Values are parsed by `parse_value`. Raises ValueError
    with a message naming the offending item."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} tp_size=2")
        raw_key, raw_value = item.split("=", 1)
        key = raw_key.strip().removeprefix("--").replace("-", "_")
        if not key:
            raise ValueError(f"{flag} {item!r}: the key is empty")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{flag} {item!r}: {raw_key.strip()!r} is not a valid argument name")
        if key in out:
            raise ValueError(f"{flag} {key!r} is given twice")
        out[key] = parse_value(raw_value)
    return out


def sglang_available() -> tuple[bool, str]:
    """Whether `--engine auto` may pick SGLang here: the package is installed and a CUDA GPU is
    visible. -> (ok, reason). Checks the GPU with torch when torch imports, else by the
    presence of nvidia-smi. Never imports sglang itself (slow, and it sets uvloop as the
    event loop policy)."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, f"sglang is not installed ({INSTALL_HINT})"
    try:
        import torch
    except Exception:
        torch = None
    if torch is not None:
        try:
            ok = bool(torch.cuda.is_available())
        except Exception as e:
            return False, f"sglang is installed but torch cannot query CUDA ({e})"
        if ok:
            return True, "sglang is installed and torch sees a CUDA GPU"
        return False, "sglang is installed but torch sees no CUDA GPU"
    if shutil.which("nvidia-smi"):
        return True, "sglang is installed and nvidia-smi is present (torch did not import)"
    return False, "sglang is installed but no CUDA GPU is visible (no torch, no nvidia-smi)"


def add_sglang_arguments(group: Any) -> None:
    """The SGLang flags, for an argparse group (runner/cli/parser.py's SGLang group)."""
    group.add_argument("--tp-size", "--tp", type=int, help="SGLang tensor parallel size")
    group.add_argument(
        "--dp-size",
        "--dp",
        type=int,
        help="SGLang data parallel size; each agent stays on one DP rank for its life",
    )
    group.add_argument(
        "--mem-fraction-static",
        "--mem-fraction",
        type=float,
        help="SGLang: GPU memory fraction for weights + KV",
    )
    group.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any SGLang ServerArgs field (repeatable), e.g. enable_hierarchical_cache=true "
        "hicache_ratio=2 radix_eviction_policy=priority; values parse as int/float/bool/str",
    )
    group.add_argument(
        "--sglang-sessions",
        action="store_true",
        help="one SGLang session per agent (session radix cache: the agent's KV is evicted "
        "after unreferenced KV; closed when the agent ends)",
    )
    group.add_argument(
        "--dp-assign",
        choices=list(DP_ASSIGN),
        default="round_robin",
        help="how an agent's DP rank is picked on its first request",
    )


def sglang_engine_from_args(args: Any) -> SGLangEngine:
    """Build the engine from the flags of `add_sglang_arguments` plus --model."""
    if not getattr(args, "model", None):
        raise ValueError("--engine sglang needs --model (a Hugging Face model name or path)")
    return SGLangEngine(
        args.model,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        mem_fraction_static=args.mem_fraction_static,
        engine_args=parse_engine_args(args.engine_arg),
        sampling_extra=parse_engine_args(args.sampling_arg, flag="--sampling-arg"),
        sessions=args.sglang_sessions,
        dp_assign=args.dp_assign,
    )
