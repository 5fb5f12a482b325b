"""The SGLang adapter and its test double, checked against the released sglang source.

The released wheel is downloaded WITHOUT dependencies (pip download --no-deps; 39 MB for
0.5.23, 1-2 s from PyPI) into ~/.cache/concur-runner/ (or $CONCUR_RUNNER_CACHE) and its
Python source is read with `ast`: sglang is never imported (its CUDA dependencies are
absent here). What the adapter sends and reads is not listed by hand: the adapter runs
against the double (tests/support/sglang_double.py) behind recording proxies, and every server
argument, async_generate keyword, sampling key, result / meta_info key, load-snapshot
field and tokenizer-manager attribute it touched must exist in the release. The double
must accept and return nothing the release does not.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from runner.engines.protocol import EngineError, SamplingParams, TransientEngineError
from runner.engines.sglang import SGLangEngine
from runner.engines.sglang import engine as sg_engine
from runner.engines.sglang import versions as sg_versions
from tests.support import sglang_double as double

RELEASE = "0.5.23"
CACHE = Path(os.environ.get("CONCUR_RUNNER_CACHE") or Path.home() / ".cache" / "concur-runner")
# One wheel for every machine: the cp311 manylinux build (pure-Python releases match too).
PLATFORM = ["--platform", "manylinux_2_34_x86_64", "--python-version", "3.11"]
PLATFORM += ["--implementation", "cp", "--abi", "cp311", "--only-binary=:all:"]


# ---- the wheel --------------------------------------------------------------------------


def _download(version: str, wheels: Path) -> Path:
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM]
    cmd += [f"sglang=={version}", "-d", str(wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.fail(
            f"cannot get the sglang {version} wheel, which this test reads (never imports). "
            f"It needs PyPI: `{' '.join(cmd)}`, or put the wheel into {wheels}. "
            f"pip said: {(proc.stderr or proc.stdout).strip()[-800:]}",
            pytrace=False,
        )
    return found[0]


@functools.cache
def source(version: str) -> Path:
    """The directory holding the release's `sglang/` package source (.py files only)."""
    root = CACHE / f"sglang-{version}-src"
    if (root / "sglang" / "__init__.py").exists():
        return root
    wheel = _download(version, CACHE / "wheels")
    tmp = CACHE / f"sglang-{version}-src.{os.getpid()}.tmp"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(
            tmp, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")]
        )
    try:
        tmp.rename(root)
    except OSError:  # another process extracted it first
        assert (root / "sglang" / "__init__.py").exists()
    return root


@functools.cache
def tree(version: str, rel: str) -> ast.Module:
    return ast.parse((source(version) / "sglang" / rel).read_text(encoding="utf-8"))


def text(version: str, rel: str) -> str:
    return (source(version) / "sglang" / rel).read_text(encoding="utf-8")


def class_def(module: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def annotated(cls: ast.ClassDef) -> set[str]:
    """Field names declared in a class body (`name: type [= default]`)."""
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def dict_keys(node: ast.AST) -> set[str]:
    return {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant)}


def self_attributes(module: ast.AST, owner: str = "self") -> set[str]:
    """Attributes assigned as `owner.X = ...` anywhere, and the functions defined."""
    names = set()
    for node in ast.walk(module):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == owner
            ):
                names.add(t.attr)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
    return names


# ---- what a release defines -------------------------------------------------------------


@functools.cache
def server_arg_fields(version: str) -> frozenset[str]:
    """ServerArgs fields: a dataclass's own (up to 0.5.19), or, since 0.5.20, the msgspec
    Struct `defstruct` assembles from the namespaces in `_INPUT_NAMESPACES`."""
    mod = tree(version, "srt/server_args.py")
    names = annotated(class_def(mod, "ServerArgs"))
    spaces: set[str] = set()
    for node in mod.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets
        ):
            spaces = {e.id for e in node.value.elts if isinstance(e, ast.Name)}
    for path in sorted((source(version) / "sglang/srt/arg_groups/fields").glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name in spaces:
                names |= annotated(node)
                spaces.discard(node.name)
    assert not spaces, f"namespaces not found: {spaces}"
    return frozenset(names)


def async_generate_params(version: str) -> dict[str, str]:
    """Engine.async_generate's keywords -> "positional" | "keyword_only"."""
    engine = class_def(tree(version, "srt/entrypoints/engine.py"), "Engine")
    fn = next(
        n for n in engine.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "async_generate"
    )
    params = {a.arg: "positional" for a in fn.args.args[1:]}
    params.update({a.arg: "keyword_only" for a in fn.args.kwonlyargs})
    return params


def meta_info_keys(version: str) -> set[str]:
    """Keys tokenizer_manager.py writes into meta_info (literal dicts, updates, items)."""
    keys = set()
    for node in ast.walk(tree(version, "srt/managers/tokenizer_manager.py")):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == "meta_info":
                    keys |= dict_keys(node.value)
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "meta_info"
                    and isinstance(t.slice, ast.Constant)
                ):
                    keys.add(t.slice.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "meta_info"
            and node.args
        ):
            keys |= dict_keys(node.args[0])
    return keys


def result_keys(version: str) -> set[str]:
    """Keys of the result dicts (the literal dicts that carry "meta_info")."""
    keys = set()
    for node in ast.walk(tree(version, "srt/managers/tokenizer_manager.py")):
        if isinstance(node, ast.Dict) and "meta_info" in dict_keys(node):
            keys |= dict_keys(node)
    return keys


def finish_reason_keys(version: str) -> set[str]:
    keys = set()
    for node in ast.walk(tree(version, "srt/managers/schedule_batch.py")):
        if isinstance(node, ast.ClassDef) and node.name.startswith("FINISH_"):
            for d in ast.walk(node):
                if isinstance(d, ast.Dict):
                    keys |= dict_keys(d)
    return keys


def cached_tokens_details_keys(version: str) -> set[str]:
    mod = tree(version, "srt/managers/scheduler_components/output_streamer.py")
    keys = set()
    for node in ast.walk(mod):
        if isinstance(node, ast.FunctionDef) and node.name == "get_cached_tokens_details":
            for d in ast.walk(node):
                if isinstance(d, ast.Dict):
                    keys |= dict_keys(d)
                if isinstance(d, ast.Subscript) and isinstance(d.slice, ast.Constant):
                    keys.add(d.slice.value)
    return keys


def tokenizer_manager_attributes(version: str) -> set[str]:
    """What a TokenizerManager has: its own and its mixins' attributes and methods, and the
    attributes engine.py sets on it (max_req_input_len)."""
    names = set()
    for path in sorted((source(version) / "sglang/srt/managers").glob("tokenizer_*.py")):
        names |= self_attributes(ast.parse(path.read_text(encoding="utf-8")))
    return names | self_attributes(tree(version, "srt/entrypoints/engine.py"), "tokenizer_manager")


# ---- what the adapter touches, recorded -------------------------------------------------


class Seen(dict):
    """category -> names read."""

    def add(self, category: str, name: str) -> None:
        self.setdefault(category, set()).add(name)


class Reads:
    """Forwards attribute reads to `target`, recording each name under `category`; the
    values of names in `wrap` are wrapped in turn (wrap: name -> category)."""

    def __init__(self, target: Any, seen: Seen, category: str, wrap: dict[str, str]) -> None:
        object.__setattr__(self, "_t", (target, seen, category, wrap))

    def __getattr__(self, name: str) -> Any:
        target, seen, category, wrap = object.__getattribute__(self, "_t")
        seen.add(category, name)
        value = getattr(target, name)
        if name in wrap:
            return Reads(value, seen, wrap[name], WRAP.get(wrap[name], {}))
        if name in ("read_all", "get_loads"):
            return _snapshots(value, seen)
        return value


WRAP = {
    "engine": {"tokenizer_manager": "tokenizer_manager", "server_args": "server_args"},
    "tokenizer_manager": {"model_config": "model_config", "load_snapshot_reader": "reader"},
}


def _snapshots(fn: Any, seen: Seen) -> Any:
    def wrap(loads: list[Any]) -> list[Any]:
        return [Reads(s, seen, "snapshot", {}) for s in loads]

    if inspect.iscoroutinefunction(fn):

        async def read_async(*a: Any, **k: Any) -> list[Any]:
            return wrap(await fn(*a, **k))

        return read_async
    return lambda *a, **k: wrap(fn(*a, **k))


class Keys(dict):
    """A dict that records the keys read from it."""

    def __init__(self, data: dict[str, Any], seen: Seen, category: str) -> None:
        super().__init__(data)
        self._seen, self._category = seen, category

    def get(self, key: Any, default: Any = None) -> Any:
        self._seen.add(self._category, key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._seen.add(self._category, key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self._seen.add(self._category, key)
        return super().__contains__(key)


def _recording_result(out: dict[str, Any], seen: Seen, returned: Seen) -> Keys:
    meta = dict(out["meta_info"])
    for key in ("finish_reason", "cached_tokens_details"):
        if isinstance(meta.get(key), dict):
            returned.setdefault(key, set()).update(meta[key])
            meta[key] = Keys(meta[key], seen, key)
    returned.setdefault("meta_info", set()).update(meta)
    returned.setdefault("result", set()).update(out)
    return Keys({**out, "meta_info": Keys(meta, seen, "meta_info")}, seen, "result")


CALL = {"type": "object", "properties": {"name": {"const": "submit"}}, "required": ["name"]}


async def _drive(eng: SGLangEngine) -> None:
    eng.check_sampling(SamplingParams(max_new_tokens=8, tool_call_schema=json.dumps(CALL)))
    await eng.generate([200, 201], SamplingParams(max_new_tokens=8, logprobs=True), agent="a")
    await eng.generate([200, 201, 202], SamplingParams(max_new_tokens=8), agent="a")
    await eng.generate([200], SamplingParams(tool_call_schema=json.dumps(CALL)), agent="b")
    with pytest.raises(TransientEngineError):  # the fourth reply: an abort
        await eng.generate([200], SamplingParams(max_new_tokens=8), agent="b")
    for _ in range(3):
        eng.cache_stats()
        await asyncio.sleep(0.01)
    eng.rank_stats(0)
    await eng.end_agent("a")
    await eng.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def recorded() -> tuple[Seen, Seen]:
    """(names the adapter read or sent, names the double returned) over runs that use every
    opt-in, once with load snapshots and once with the get_loads fallback."""
    seen, returned = Seen(), Seen()
    mp = pytest.MonkeyPatch()
    try:
        abort = {"replies": [double.Reply("ok")] * 3 + [double.Abort()]}
        legacy = {**abort, "legacy_loads": True}
        for config, dp_assign in ((abort, "least_loaded"), (legacy, "round_robin")):
            handle = double.install_fake_sglang(mp, **config)
            base = handle.engine_class

            class Recording(base):
                def __init__(self, **kwargs: Any) -> None:
                    for k in kwargs:
                        seen.add("server_args_set", k)
                    super().__init__(**kwargs)

                async def async_generate(self, **kwargs: Any) -> Any:
                    seen.setdefault("async_generate", set()).update(kwargs)
                    seen.setdefault("sampling", set()).update(kwargs["sampling_params"])
                    return _recording_result(await super().async_generate(**kwargs), seen, returned)

            # the adapter reads the keywords async_generate takes from its signature
            Recording.async_generate.__signature__ = inspect.signature(base.async_generate)
            eng = SGLangEngine(
                "m",
                tp_size=1,
                dp_size=2,
                mem_fraction_static=0.8,
                sessions=True,
                priority="fifo",
                dp_assign=dp_assign,
                sampling_extra={"top_k": 20},
                loads_refresh_s=0.001,
                engine_factory=lambda **kw: Reads(Recording(**kw), seen, "engine", WRAP["engine"]),
            )
            await _drive(eng)
    finally:
        mp.undo()
    return seen, returned


# ---- the checks -------------------------------------------------------------------------


def missing(used: set[str], real: set[str] | frozenset[str]) -> list[str]:
    return sorted(used - set(real))


def test_every_server_argument_the_adapter_sets_or_reads_exists(recorded):
    seen, _ = recorded
    fields = server_arg_fields(RELEASE)
    assert seen["server_args_set"] >= {"model_path", "enable_session_radix_cache"}
    assert missing(seen["server_args_set"], fields) == []
    # read from Engine.server_args (context_length: a fallback the double never reaches)
    assert missing(seen["server_args"] | {"context_length"}, fields) == []


def test_every_async_generate_keyword_the_adapter_passes_exists(recorded):
    seen, _ = recorded
    params = async_generate_params(RELEASE)
    assert seen["async_generate"] >= {"input_ids", "session_id", "routed_dp_rank"}
    assert missing(seen["async_generate"], set(params)) == []


def test_every_sampling_key_the_adapter_sends_is_a_sampling_params_field(recorded):
    seen, _ = recorded
    fields = annotated(
        class_def(tree(RELEASE, "srt/sampling/sampling_params.py"), "SamplingParams")
    )
    assert seen["sampling"] >= {"max_new_tokens", "stop_token_ids", "structural_tag", "top_k"}
    assert missing(seen["sampling"], fields) == []


def test_every_result_and_meta_info_key_the_adapter_reads_is_sent(recorded):
    seen, _ = recorded
    assert missing(seen["result"], result_keys(RELEASE)) == []
    assert "output_token_logprobs" in seen["meta_info"]
    assert missing(seen["meta_info"], meta_info_keys(RELEASE)) == []
    assert missing(seen["finish_reason"], finish_reason_keys(RELEASE)) == []
    assert missing(seen["cached_tokens_details"], cached_tokens_details_keys(RELEASE)) == []


def test_every_load_snapshot_field_the_adapter_reads_exists(recorded):
    seen, _ = recorded
    snapshot = annotated(class_def(tree(RELEASE, "srt/managers/load_snapshot.py"), "LoadSnapshot"))
    assert seen["snapshot"] >= {"token_usage", "dp_rank", "max_total_num_tokens"}
    assert missing(seen["snapshot"], snapshot) == []
    assert seen["reader"] == {"read_all"}


def test_every_engine_and_tokenizer_manager_attribute_the_adapter_reads_exists(recorded):
    seen, _ = recorded
    engine = self_attributes(class_def(tree(RELEASE, "srt/entrypoints/engine.py"), "Engine"))
    assert missing(seen["engine"], engine) == []
    tm = tokenizer_manager_attributes(RELEASE)
    assert {"load_snapshot_reader", "get_loads", "close_session"} <= seen["tokenizer_manager"]
    assert missing(seen["tokenizer_manager"], tm) == []
    model_config = self_attributes(tree(RELEASE, "srt/configs/model_config.py"))
    assert missing(seen["model_config"], model_config) == []
    close = annotated(class_def(tree(RELEASE, "srt/managers/io_struct.py"), "CloseSessionReqInput"))
    assert close == {"session_id"}
    init = text(RELEASE, "__init__.py")
    assert 'Engine = LazyImport("sglang.srt.entrypoints.engine", "Engine")' in init


# ---- the double accepts and returns nothing the release does not -------------------------


def test_the_double_takes_only_real_server_arguments():
    assert missing(set(double.KNOWN_SERVER_ARGS), server_arg_fields(RELEASE)) == []


def test_the_double_async_generate_has_the_real_keywords():
    real = async_generate_params(RELEASE)
    sig = inspect.signature(double.FakeSGLangEngine.async_generate).parameters
    kinds = {
        n: "keyword_only" if p.kind is p.KEYWORD_ONLY else "positional"
        for n, p in sig.items()
        if n != "self"
    }
    assert {n: real.get(n) for n in kinds} == kinds


def test_the_double_takes_only_real_sampling_keys():
    real = annotated(class_def(tree(RELEASE, "srt/sampling/sampling_params.py"), "SamplingParams"))
    assert missing(set(double.SAMPLING_KEYS), real) == []
    assert "topk" not in double.SAMPLING_KEYS  # and SGLang raises on such a key: so does it


def test_the_double_returns_only_real_keys_and_fields(recorded):
    _, returned = recorded
    assert missing(returned["result"], result_keys(RELEASE)) == []
    assert missing(returned["meta_info"], meta_info_keys(RELEASE)) == []
    assert missing(returned["finish_reason"], finish_reason_keys(RELEASE)) == []
    assert missing(returned["cached_tokens_details"], cached_tokens_details_keys(RELEASE)) == []
    snapshot = annotated(class_def(tree(RELEASE, "srt/managers/load_snapshot.py"), "LoadSnapshot"))
    assert missing({f.name for f in dataclass_fields(double.FakeLoad)}, snapshot) == []
    io = tree(RELEASE, "srt/managers/io_struct.py")
    for cls in (double.OpenSessionReqInput, double.CloseSessionReqInput):
        real = annotated(class_def(io, cls.__name__))
        assert missing({f.name for f in dataclass_fields(cls)}, real) == []


# ---- what each release needs (versions.py, docs/sglang.md's table) ------------------------------

# One release per row of versions.session_requirements and of docs/sglang.md's versions table:
# (DP keyword, U from load_snapshot_reader).
RELEASES = {
    "0.5.9": ("data_parallel_rank", False),
    "0.5.16": ("routed_dp_rank", True),
    "0.5.18": ("routed_dp_rank", True),
    "0.5.23": ("routed_dp_rank", True),
}


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_session_requirements_match_the_release(version):
    parsed = sg_versions.parse_version(version)
    fields = server_arg_fields(version)
    srt = source(version) / "sglang" / "srt"
    every = "\n".join(p.read_text(encoding="utf-8") for p in srt.rglob("*.py"))
    try:
        args, env = sg_versions.session_requirements(parsed)
    except EngineError:
        assert "enable_session_radix_cache" not in fields  # ServerArgs(...) would raise
        return
    assert missing(set(args), fields) == []
    assert "session_id" in async_generate_params(version)
    needs_priority = "requires --radix-eviction-policy priority" in every
    assert (args.get("radix_eviction_policy") == "priority") == needs_priority
    # the env var is needed where sessions need the unified tree and only the env var
    # selects it (mem_cache/registry.py)
    needs_unified = "--enable-session-radix-cache requires UnifiedRadixCache" in every
    env_selects = sg_versions.UNIFIED_TREE_ENV in text(version, "srt/mem_cache/registry.py")
    assert (sg_versions.UNIFIED_TREE_ENV in env) == (needs_unified and env_selects)
    if version == RELEASE:  # the variable is gone altogether
        assert sg_versions.UNIFIED_TREE_ENV not in every


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_dp_keyword_and_load_path_per_release(version):
    dp_keyword, has_reader = RELEASES[version]
    params = async_generate_params(version)
    assert dp_keyword in params
    assert ("routed_dp_rank" in params) == (dp_keyword == "routed_dp_rank")
    tm = text(version, "srt/managers/tokenizer_manager.py")
    assert ("load_snapshot_reader" in tm) == has_reader
    assert "get_loads" in tokenizer_manager_attributes(version)


def test_server_args_is_a_msgspec_struct_in_the_release():
    assert "ServerArgs = msgspec.defstruct(" in text(RELEASE, "srt/server_args.py")


# ---- how a request fails, and which failures may pass (engine._request, _raise_abort) ----


def function_source(version: str, rel: str, name: str) -> str:
    """The source of function `name` in `rel`, its whitespace collapsed."""
    src = text(version, rel)
    for node in ast.walk(tree(version, rel)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return " ".join((ast.get_source_segment(src, node) or "").split())
    raise AssertionError(f"{rel}: no function {name}")


def test_a_scheduler_abort_raises_by_status_in_async_generate():
    tm = "srt/managers/tokenizer_manager.py"
    handle = function_source(RELEASE, tm, "_handle_abort_finish_reason")
    # no status (or one outside 400..599): the result comes back with finish_reason abort
    assert "or status_code is None or not HTTPStatus.BAD_REQUEST <= status_code < 600" in handle
    assert "return None" in handle
    # 400: ValueError (permanent); 401..599: fastapi.HTTPException with status_code, detail
    assert (
        'if status_code == HTTPStatus.BAD_REQUEST: raise ValueError(finish_reason["message"])'
        in handle
    )
    assert (
        'raise fastapi.HTTPException( status_code=status_code, detail=finish_reason["message"] )'
        in handle
    )
    assert "_handle_abort_finish_reason(" in function_source(RELEASE, tm, "_stream_one_response")
    # an AbortReq (waiting queue): a result without status, which the adapter retries
    abort_req = function_source(RELEASE, tm, "_handle_abort_req")
    assert 'abort_message = recv_obj.abort_message or "Abort in waiting queue"' in abort_req
    assert '{ "type": "abort", "message": abort_message, }' in abort_req
    finish_abort = class_def(tree(RELEASE, "srt/managers/schedule_batch.py"), "FINISH_ABORT")
    keys = set().union(*(dict_keys(d) for d in ast.walk(finish_abort) if isinstance(d, ast.Dict)))
    assert keys == {"type", "message", "status_code", "err_type"}


def test_older_releases_raise_400_500_and_503_aborts_and_return_the_others():
    # 0.5.9: inside the response loop; the adapter also reads a status from the result
    tm = " ".join(text("0.5.9", "srt/managers/tokenizer_manager.py").split())
    assert (
        'and finish_reason.get("status_code") == HTTPStatus.BAD_REQUEST ): if not is_stream: '
        'raise ValueError(finish_reason["message"])' in tm
    )
    assert (
        "HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.INTERNAL_SERVER_ERROR, ):" in tm
        and 'raise fastapi.HTTPException( status_code=finish_reason["status_code"], '
        'detail=finish_reason["message"], )'
        in tm
    )


def _aborts(version: str) -> list[tuple[str, str]]:
    """(message text, HTTPStatus member) of every FINISH_ABORT(...) whose status is written
    as HTTPStatus.X, in the files that build them for a generate request (the scheduler and
    its components, the batch, the caches); the message's literal parts only."""
    found = []
    srt = source(version) / "sglang" / "srt"
    for path in sorted([*(srt / "managers").rglob("*.py"), *(srt / "mem_cache").rglob("*.py")]):
        src = path.read_text(encoding="utf-8")
        if "FINISH_ABORT(" not in src:
            continue
        mod = ast.parse(src)
        for node in ast.walk(mod):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "FINISH_ABORT"):
                continue
            status = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "status_code")]
            if not (status and isinstance(status[0], ast.Attribute)):
                continue
            parts = [c.value for c in ast.walk(node.args[0]) if isinstance(c, ast.Constant)]
            found.append(("".join(str(p) for p in parts), status[0].attr))
    return found


def test_out_of_memory_retraction_and_timeout_aborts_are_transient_bad_requests_not():
    from http import HTTPStatus

    aborts = _aborts(RELEASE)
    assert len(aborts) >= 5
    for message, status in aborts:
        transient = sg_engine.transient_status(HTTPStatus[status])
        if any(w in message for w in ("memory", "Retract", "KV", "exhausted")):
            assert transient, (message, status)
        if status == "BAD_REQUEST":
            assert not transient, message
    messages = " ".join(m for m, _ in aborts)
    assert "Out of memory even after retracting all other requests" in messages
    # retracted without a KV backup: its status is a variable, set beside the message
    retract = function_source(RELEASE, "srt/managers/schedule_batch.py", "retract_decode")
    assert (
        '"Retracted under decode memory pressure without a KV " "backup. Retry later." ) '
        "status_code = HTTPStatus.SERVICE_UNAVAILABLE" in retract
    )
    # a timed-out request (AbortReq with a message): 503
    scheduler = " ".join(text(RELEASE, "srt/managers/scheduler.py").split())
    assert "FINISH_ABORT( recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE )" in scheduler
    # validation aborts default to 400: permanent
    setter = function_source(RELEASE, "srt/managers/schedule_batch.py", "set_finish_with_abort")
    assert "status_code: int = HTTPStatus.BAD_REQUEST" in setter


def test_context_length_refusals_carry_the_phrases_the_adapter_looks_for():
    # before the scheduler: ValueError; in it: validate_input_length's message as a
    # set_finish_with_abort (400), which the tokenizer manager raises as ValueError
    tm = function_source(RELEASE, "srt/managers/tokenizer_manager.py", "_validate_one_request")
    utils = function_source(RELEASE, "srt/managers/utils.py", "validate_input_length")
    phrases = sg_engine._CONTEXT_ERRORS
    assert "raise ValueError" in tm and phrases[0] in tm.lower()
    assert phrases[1] in utils.lower()
    handle = function_source(RELEASE, "srt/managers/scheduler.py", "_handle_generate_request")
    assert (
        "error_msg = validate_input_length( req, self.max_req_input_len, "
        "get_serving().allow_auto_truncate, ) if error_msg: req.set_finish_with_abort(error_msg)"
        in handle
    )


# ---- sampling checked at start-up (engine.check_sampling) --------------------------------


def test_check_sampling_builds_sampling_params_as_the_tokenizer_manager_does():
    tm = text(RELEASE, "srt/managers/tokenizer_manager.py")
    assert "self.sampling_params_class = SamplingParams" in tm
    assert "sampling_params = self.sampling_params_class(**sampling_kwargs)" in tm
    assert "sampling_params.normalize(self.tokenizer)" in tm
    assert "sampling_params.verify(self.model_config.vocab_size)" in tm
    assert "sampling_kwargs = {**self.preferred_sampling_params, **obj.sampling_params}" in tm
    sp = class_def(tree(RELEASE, "srt/sampling/sampling_params.py"), "SamplingParams")
    methods = {
        n.name: [a.arg for a in n.args.args] for n in sp.body if isinstance(n, ast.FunctionDef)
    }
    assert methods["normalize"] == ["self", "tokenizer"]
    assert methods["verify"] == ["self", "vocab_size"]
    # a msgspec Struct: the adapter reads its fields from __struct_fields__
    assert "class SamplingParams(msgspec.Struct" in text(RELEASE, "srt/sampling/sampling_params.py")


@pytest.mark.parametrize("version", ["0.5.16", "0.5.18", RELEASE])
def test_the_internal_sampling_fields_are_the_ones_the_adapter_refuses(version):
    src = text(version, "srt/sampling/sampling_params.py")
    sp = class_def(tree(version, "srt/sampling/sampling_params.py"), "SamplingParams")
    marker = next(
        i + 1 for i, line in enumerate(src.splitlines()) if "# --- Internal fields" in line
    )
    internal = {
        n.target.id
        for n in sp.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.lineno > marker
    }
    assert internal <= sg_engine.INTERNAL_SAMPLING_FIELDS
    if version == RELEASE:
        assert internal == sg_engine.INTERNAL_SAMPLING_FIELDS


def test_the_doubles_sampling_checks_are_sglangs():
    verify = function_source(RELEASE, "srt/sampling/sampling_params.py", "verify")
    for _, message in double.VERIFY_CHECKS.values():
        assert message in verify, message
    assert double.MIN_NEW_ABOVE_MAX in verify
    assert "Only one of json_schema, regex, ebnf, or structural_tag can be set." in verify
