"""The policies by name, and building one from `--policy NAME:key=value,...`.

The default path's policies are imported here; the experiments (experimental/) only when
one is named, or when every policy is listed (--help, `run.py policies`).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from typing import Any

from .aimd import AIMD
from .baselines import AgentCap, NoGate, RequestCap
from .protocol import Policy
from .wset2 import WorkingSet2

# Registered policies, in the order `run.py policies` lists them. A policy's parameters are
# its dataclass fields; a new policy is one entry here, and `--policy NAME:key=value,...` and
# `run.py policies` know it at once. Experiments: (module of experimental/, class), imported
# only when needed.
_ORDER: tuple[str, ...] = ("wset2", "aimd", "none", "agent-cap", "request-cap", "wset")
_DEFAULT: dict[str, type[Policy]] = {
    c.name: c for c in (WorkingSet2, AIMD, NoGate, AgentCap, RequestCap)
}
_EXPERIMENTAL: dict[str, tuple[str, str]] = {"wset": ("wset", "WorkingSet")}
# `--policy` when none is given: the policy within 2% of the best baseline on the most
# generated workloads (docs/policies.md, "Where the policies stand")
DEFAULT_POLICY = WorkingSet2.name
# The AIMD flags (--alpha, ...) set AIMD's parameters: of `aimd` itself, and of the AIMD a
# policy falls back on (its field of type AIMD). Other policies take none.
_AIMD_OPTIONS = tuple(f.name for f in dataclasses.fields(AIMD))
_FLAG_NAMES = {"initial": "initial_window"}  # where the flag's name is not the field's


def policy_class(name: str) -> type[Policy] | None:
    """The policy registered as `name` (an experiment's module is imported now), or None."""
    if name in _EXPERIMENTAL:
        module, cls = _EXPERIMENTAL[name]
        return getattr(importlib.import_module(f"{__package__}.experimental.{module}"), cls)
    return _DEFAULT.get(name)


def registered() -> dict[str, type[Policy]]:
    """Every registered policy by name, experiments included (imported now)."""
    out = {}
    for name in _ORDER:
        cls = policy_class(name)
        assert cls is not None, name
        out[name] = cls
    return out


def __getattr__(name: str) -> Any:
    if name == "REGISTRY":  # every policy by name (imports the experiments)
        return registered()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fields(cls: type[Policy]) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(cls)  # type: ignore[arg-type]  # every policy is a dataclass


def parameters(cls: type[Policy]) -> dict[str, tuple[type, Any]]:
    """A policy's settable parameters: name -> (type, default or MISSING), in field order."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, Any]] = {}
    for f in _fields(cls):
        if hints[f.name] is AIMD:  # the fallback: set through the AIMD flags
            continue
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        out[f.name] = (hints[f.name], default)
    return out


def describe(cls: type[Policy]) -> str:
    """`name:key=default,...` for help texts; a parameter without default shows as <key>,
    an optional one whose default depends on others (None) as [key]."""
    items = [
        f"<{k}>" if d is dataclasses.MISSING else f"[{k}]" if d is None else f"{k}={d}"
        for k, (_, d) in parameters(cls).items()
    ]
    return cls.name + (":" + ",".join(items) if items else "")


def make_policy(spec: str, **aimd_options: Any) -> Policy:
    """Build a policy from `name` or `name:args`, where args are comma-separated `key=value`
    pairs of the policy's parameters (a policy with one parameter without default also takes
    it bare: `agent-cap:32`). `aimd_options` are the AIMD flags (None: not given). Unknown
    keys, bad values and options the policy does not take are errors naming them."""
    name, _, arg = spec.partition(":")
    cls = policy_class(name)
    if cls is None:
        known = ", ".join(describe(c) for c in registered().values())
        raise ValueError(f"unknown policy {name!r}; registered: {known}")
    params = parameters(cls)
    values = _parse_args(cls, params, arg)
    given = {k: v for k, v in aimd_options.items() if v is not None}
    bad = [k for k in given if k not in _AIMD_OPTIONS]
    if bad:
        raise ValueError(f"unknown AIMD option(s) {bad}; valid: {', '.join(_AIMD_OPTIONS)}")
    hints = typing.get_type_hints(cls)
    fallback = [f.name for f in _fields(cls) if hints[f.name] is AIMD]
    if given and cls is AIMD:
        twice = sorted(set(given) & set(values))
        if twice:
            raise ValueError(f"policy aimd: {twice} given both as a flag and in --policy")
        values = {**given, **values}
    elif given and fallback:
        values[fallback[0]] = AIMD(**given)
    elif given:
        flags = ", ".join("--" + _FLAG_NAMES.get(k, k).replace("_", "-") for k in given)
        raise ValueError(f"{flags}: AIMD options, which policy {name!r} does not take")
    missing = [k for k, (_, d) in params.items() if d is dataclasses.MISSING and k not in values]
    if missing:
        raise ValueError(f"policy {name!r} needs {missing}: e.g. --policy {describe(cls)}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: {e}") from None


def _parse_args(cls: type[Policy], params: dict[str, tuple[type, Any]], arg: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    items = [a.strip() for a in arg.split(",")] if arg else []
    required = [k for k, (_, d) in params.items() if d is dataclasses.MISSING]
    for i, item in enumerate(items):
        key, eq, text = item.partition("=")
        if not eq:  # a bare value: the one parameter without default
            if i > 0 or len(required) != 1:
                raise ValueError(
                    f"policy {cls.name!r}: {item!r} is not key=value; valid keys: "
                    f"{', '.join(params) or '(none)'}"
                )
            key, text = required[0], item
        key = key.strip()
        if key not in params:
            raise ValueError(
                f"policy {cls.name!r} has no parameter {key!r}; valid: "
                f"{', '.join(params) or '(none)'}"
            )
        if key in values:
            raise ValueError(f"policy {cls.name!r}: {key!r} given twice")
        values[key] = _convert(cls.name, key, params[key][0], text.strip())
    return values


def _convert(policy: str, key: str, kind: Any, text: str) -> Any:
    """`text` as the parameter's type (int, float, bool, or one of them | None)."""
    options = (
        typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType)
        else (kind,)
    )
    if type(None) in options and text.lower() == "none":
        return None
    for t in options:
        try:
            if t is bool:
                if text.lower() in ("true", "1", "yes", "false", "0", "no"):
                    return text.lower() in ("true", "1", "yes")
                continue
            if t in (int, float, str):
                return t(text)
        except ValueError:
            continue
    names = "/".join(getattr(t, "__name__", str(t)) for t in options)
    raise ValueError(f"policy {policy!r}: {key}={text!r} is not a valid {names}")
