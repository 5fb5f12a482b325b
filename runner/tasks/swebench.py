"""SWE-bench-style tasks on a local repository: the workspace starts as a clone of `repo` (a
git repository or mirror next to the dataset) at `base_commit`; the evaluation applies the
record's `test_patch` and runs its `FAIL_TO_PASS` and `PASS_TO_PASS` tests with `test_cmd`.
Solved: every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes.

The clone is made on the host, as root, from a directory an untrusted dataset controls, so
the source must be a real directory inside the dataset's directory (no symlinks on the way,
no `.git` file pointing elsewhere, no alternates borrowing objects from elsewhere) and the new
repository gets git's own fresh config (no hooks or filters of the source). Everything that
runs in the workspace after that (the test patch, the tests) runs in the sandbox as the
agent's uid: the workspace's .git is the agent's to change.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.gitrepo import GIT
from tools.sandbox import CommandSandbox, ExecResult, Limits

DEFAULT_TEST_CMD = "python3 -m pytest -q -p no:cacheprovider"
# Task fields of this module (they are valid task fields; see KNOWN_FIELDS in tasks.py).
FIELDS = frozenset(
    {"repo", "base_commit", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "test_cmd"}
)
# SWE-bench's other columns: kept in the task's raw record, not reported as unknown.
SWEBENCH_COLUMNS = frozenset(
    {"patch", "hints_text", "created_at", "version", "environment_setup_commit"}
)
# Without --field-map, a record with neither `id` nor `prompt`/`messages` takes SWE-bench's.
DEFAULT_MAP = {"id": "instance_id", "prompt": "problem_statement"}
INDIVIDUAL_RUNS = 50  # a failing group's tests rerun one by one to name the failures, at most
_SHA = re.compile(r"^[0-9a-fA-F]{4,64}$")
_DIFF_PATH = re.compile(r"^diff --git a/(.+?) b/(.+)$", re.MULTILINE)
_GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}


@dataclass(frozen=True)
class SweSpec:
    repo: str  # absolute path of the local repository or mirror
    base_commit: str
    test_patch: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    test_cmd: str = DEFAULT_TEST_CMD

    @property
    def evaluates(self) -> bool:
        return bool(self.fail_to_pass or self.pass_to_pass)


def default_map(rec: dict[str, Any]) -> dict[str, Any]:
    """SWE-bench's `instance_id` / `problem_statement` as `id` / `prompt`, where the record
    has no `id` / no `prompt` or `messages` of its own."""
    if not isinstance(rec, dict) or "instance_id" not in rec:
        return rec
    out = dict(rec)
    if "id" not in out:
        out["id"] = out.pop("instance_id")
    if "prompt" not in out and "messages" not in out and "problem_statement" in out:
        out["prompt"] = out.pop("problem_statement")
    return out


def parse_spec(rec: dict[str, Any], base: Path | None) -> SweSpec | None:
    """The record's SWE-bench fields as a SweSpec; None when it has none but perhaps `repo`
    (which alone is not taken for a path). ValueError
    with the reason when they are incomplete or unusable."""
    repo = rec.get("repo")
    used = sorted(k for k in FIELDS - {"repo", "test_cmd"} if k in rec)
    if not used:
        return None  # a `repo` alone is a note (e.g. SWE-bench's GitHub name), not a task field
    if repo is None:
        raise ValueError(f'{used} need a local git repository in "repo" (and a base_commit)')
    if "workspace" in rec:
        raise ValueError('"repo" and "workspace" are two starting points: give one')
    commit = rec.get("base_commit")
    if not isinstance(commit, str) or not _SHA.match(commit.strip()):
        raise ValueError(f'"repo" needs "base_commit", a commit hash; got {commit!r}')
    spec = SweSpec(
        repo=str(repo_path(repo, base)),
        base_commit=commit.strip(),
        test_patch=_text(rec, "test_patch"),
        fail_to_pass=test_list(rec, "FAIL_TO_PASS"),
        pass_to_pass=test_list(rec, "PASS_TO_PASS"),
        test_cmd=_text(rec, "test_cmd") or DEFAULT_TEST_CMD,
    )
    if spec.evaluates and rec.get("eval") is not None:
        raise ValueError('"eval" and FAIL_TO_PASS/PASS_TO_PASS are two evaluations: give one')
    return spec


def _text(rec: dict[str, Any], key: str) -> str:
    v = rec.get(key)
    if v is None:
        return ""
    if not isinstance(v, str) or "\0" in v:
        raise ValueError(f'"{key}" must be a string without NUL characters')
    return v


def test_list(rec: dict[str, Any], key: str) -> tuple[str, ...]:
    """A list of test ids, or SWE-bench's JSON string of one."""
    v = rec.get(key)
    if v is None or v == "":
        return ()
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f'"{key}" is a string but not a JSON list: {e.msg}') from None
    if not isinstance(v, list) or not all(isinstance(t, str) and t.strip() for t in v):
        raise ValueError(f'"{key}" must be a list of test ids (or a JSON string of one)')
    return tuple(v)


def repo_path(value: Any, base: Path | None) -> Path:
    """`repo`: a git repository (with a work tree) or a bare mirror, relative to the dataset's
    directory and inside it, with no symlink anywhere on the way."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError('"repo" must be a path to a local git repository')
    if base is None:
        raise ValueError('"repo" needs a local dataset file (the path is relative to it)')
    root = base.resolve()
    rel = Path(value)
    hint = (
        f"; SWE-bench's repo names ({value!r}) need a local clone or mirror: "
        f'`git clone --mirror https://github.com/{value}` under {root} and set "repo" to '
        "its relative path"
    )
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f'"repo" {value!r} must be a path relative to {root}, inside it')
    path = root / rel
    for i in range(1, len(rel.parts) + 1):
        part = root.joinpath(*rel.parts[:i])
        if part.is_symlink():
            raise ValueError(
                f'"repo" {value!r}: {part} is a symlink; the repository must lie inside {root}'
            )
    if not path.is_dir():
        raise ValueError(
            f'"repo" {value!r}: {path} is not a directory'
            + (hint if "/" in value and len(rel.parts) == 2 else "")
        )
    git_dir = path / ".git"
    if git_dir.is_symlink() or (git_dir.exists() and not git_dir.is_dir()):
        raise ValueError(
            f'"repo" {value!r}: {git_dir} is not a directory (a link or a '
            "gitdir file pointing elsewhere)"
        )
    gd = git_dir if git_dir.is_dir() else path
    if not ((gd / "HEAD").is_file() and (gd / "objects").is_dir()):
        raise ValueError(f'"repo" {value!r}: {path} is not a git repository or mirror')
    if (gd / "objects" / "info" / "alternates").exists():
        raise ValueError(
            f'"repo" {value!r}: it borrows objects from another repository '
            "(objects/info/alternates); use a standalone clone"
        )
    return path


def checkout(ws: Path, spec: SweSpec, limit: int) -> None:
    """Clone spec.repo into the (new, empty) workspace and check out base_commit, detached,
    with no remote (the agent never sees the host path). Host side; ValueError naming the
    repository and what git said, or that the clone is over `limit` bytes."""
    _git(["clone", "-q", "--no-checkout", "--no-hardlinks", spec.repo, str(ws)], spec, None)
    _git(["checkout", "-q", "--detach", spec.base_commit], spec, ws)
    _git(["remote", "remove", "origin"], spec, ws)
    size = tree_bytes(ws)
    if size > limit:
        raise ValueError(
            f"repo {spec.repo} at {spec.base_commit}: the clone is {size} bytes, over the "
            f"workspace limit of {limit}"
        )


def tree_bytes(root: Path) -> int:
    """Bytes under root, never following a symlink."""
    total = 0
    for d, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            total += os.lstat(os.path.join(d, name)).st_size
    return total


def _git(args: list[str], spec: SweSpec, cwd: Path | None) -> None:
    cmd = [
        "git",
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "core.fsmonitor=false",
        "-c",
        "protocol.file.allow=always",
        *args,
    ]
    # The dataset's repository is usually not root's: trust that one path, for the clone
    # and for the upload-pack it starts (which ignores `-c safe.directory`; a global
    # config file is read by both).
    with tempfile.NamedTemporaryFile("w", suffix=".gitconfig") as cfg:
        cfg.write(f"[safe]\n\tdirectory = {json.dumps(spec.repo)}\n")
        cfg.flush()
        env = {**_GIT_ENV, "GIT_CONFIG_GLOBAL": cfg.name}
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise ValueError(
            f"repo {spec.repo} at {spec.base_commit}: git {args[0]} failed: "
            f"{r.stderr.strip()[-500:]}"
        )


def patched_paths(patch: str) -> list[str]:
    """The files a patch touches (both sides of a rename)."""
    paths: dict[str, None] = {}
    for a, b in _DIFF_PATH.findall(patch):
        paths[a] = paths[b] = None
    return list(paths)


def apply_script(spec: SweSpec) -> str:
    """Restore the files the test patch touches to base_commit (removing those it creates),
    so an agent's edits to them do not count and a second evaluation (--eval-only) applies
    it again cleanly; then apply the patch from stdin."""
    lines = ["set -e"]
    base = shlex.quote(spec.base_commit)
    for p in patched_paths(spec.test_patch):
        q = shlex.quote(p)
        lines.append(
            f"if {GIT} cat-file -e {base}:{q} 2>/dev/null; then "
            f"{GIT} checkout -q {base} -- {q}; else rm -f -- {q}; fi"
        )
    lines.append(f"{GIT} apply --whitespace=nowarn -")
    return "\n".join(lines)


async def evaluate_swe(
    sandbox: CommandSandbox, spec: SweSpec, workspace: Path, uid: int, limits: Limits
) -> dict[str, Any]:
    """The eval record (the keys of every eval record, runner/runfolder/records.py): `solved`;
    `exit_code` 0 when every test run passed, else the first failing run's; `tests`: the
    test patch and, per list, the tests that passed, failed, or could not be told apart."""
    tests: dict[str, Any] = {"test_patch": None}
    rec: dict[str, Any] = {"command": spec.test_cmd, "solved": False, "tests": tests}
    seconds = 0.0
    if spec.test_patch:
        r = await sandbox.run(apply_script(spec), workspace, uid, limits, stdin=spec.test_patch)
        seconds += r.seconds
        if r.exit_code != 0 or r.timed_out:
            tests["test_patch"] = "failed"
            rec.update(
                exit_code=r.exit_code,
                timed_out=r.timed_out,
                error="the test patch does not apply",
                output_tail=r.output[-2000:],
                seconds=round(seconds, 3),
            )
            return rec
        tests["test_patch"] = "applied"
    tails: list[str] = []
    exit_code: int | None = 0
    timed_out = False
    for key, ids in (("FAIL_TO_PASS", spec.fail_to_pass), ("PASS_TO_PASS", spec.pass_to_pass)):
        result, secs, run = await _run_group(sandbox, spec.test_cmd, ids, workspace, uid, limits)
        tests[key] = result
        seconds += secs
        if run is not None:
            tails.append(run.output[-1000:])
            if exit_code == 0:
                exit_code, timed_out = run.exit_code, run.timed_out
    rec["solved"] = all(
        not tests[k]["failed"] and not tests[k]["unknown"] for k in ("FAIL_TO_PASS", "PASS_TO_PASS")
    )
    rec.update(
        exit_code=exit_code,
        timed_out=timed_out,
        output_tail="\n".join(tails)[-2000:],
        seconds=round(seconds, 3),
    )
    return rec


async def _run_group(
    sandbox: CommandSandbox,
    test_cmd: str,
    tests: tuple[str, ...],
    workspace: Path,
    uid: int,
    limits: Limits,
) -> tuple[dict[str, list[str]], float, ExecResult | None]:
    """All the group's tests in one command; if that fails, each alone (up to
    INDIVIDUAL_RUNS) to name the failures. -> ({passed, failed, unknown}, seconds, the
    failing group run or None)."""
    out: dict[str, list[str]] = {"passed": [], "failed": [], "unknown": []}
    if not tests:
        return out, 0.0, None

    def command(ids: tuple[str, ...]) -> str:
        return f"{test_cmd} {' '.join(shlex.quote(t) for t in ids)}"

    r = await sandbox.run(command(tests), workspace, uid, limits)
    seconds = r.seconds
    if r.exit_code == 0 and not r.timed_out:
        out["passed"] = list(tests)
        return out, seconds, None
    for i, t in enumerate(tests):
        if i >= INDIVIDUAL_RUNS:
            out["unknown"] += tests[i:]
            break
        one = await sandbox.run(command((t,)), workspace, uid, limits)
        seconds += one.seconds
        out["passed" if one.exit_code == 0 and not one.timed_out else "failed"].append(t)
    if not out["failed"] and not out["unknown"]:
        # each passes alone but not together (order dependence): the group failed
        out["unknown"] = list(tests)
        out["passed"] = []
    return out, seconds, r
