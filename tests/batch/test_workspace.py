"""Workspaces from a directory or an archive: safe copying and extraction
(runner/batch/workspace.py), the `workspace` task field, and a batch that starts from them
(setup, git base, patch)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from runner.batch.workspace import WorkspaceError, populate
from runner.tasks.tasks import load_tasks
from tests.conftest import read_jsonl, run_cli, write_jsonl

LIMIT = 10 * 2**20


def tar_with(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def reg(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.type, i.linkname = kind, target
    return i


def test_copy_directory(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A\n")
    (src / "pkg" / "sub" / "b.txt").write_text("B\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o4755)  # setuid is dropped
    os.symlink("pkg/a.py", src / "alias.py")  # inside: kept as a link
    ws = tmp_path / "ws"
    ws.mkdir()
    populate(ws, src, {"pkg/a.py": "overridden\n", "new/c.txt": "C"}, LIMIT)
    assert (ws / "pkg/a.py").read_text() == "overridden\n"  # `files` win
    assert (ws / "pkg/sub/b.txt").read_text() == "B\n" and (ws / "new/c.txt").read_text() == "C"
    assert os.readlink(ws / "alias.py") == "pkg/a.py"
    assert (ws / "run.sh").stat().st_mode & 0o7777 == 0o755


@pytest.mark.parametrize(
    "target", ["/etc/passwd", "../../outside", "../sub/../../x", "/", "a/../../../root"]
)
def test_directory_links_leaving_are_refused(tmp_path: Path, target: str) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    os.symlink(target, src / "sub" / "l")
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(WorkspaceError, match="link leaves the workspace"):
        populate(ws, src, {}, LIMIT)


def test_directory_special_files_and_size(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "fifo")
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(WorkspaceError, match="not a regular file"):
        populate(ws, src, {}, LIMIT)  # and it did not block on the fifo
    os.unlink(src / "fifo")
    (src / "big").write_bytes(b"x" * 5000)
    with pytest.raises(WorkspaceError, match="size limit"):
        populate(tmp_path / "ws", src, {}, 4000)


def test_tar_and_zip(tmp_path: Path) -> None:
    archive = tar_with(
        tmp_path / "p.tar.gz",
        [
            (reg("proj/m.py"), b"M = 1\n"),
            (link("proj/alias.py", "m.py"), None),
            (link("proj/hard.py", "proj/m.py", tarfile.LNKTYPE), None),
        ],
    )
    ws = tmp_path / "ws1"
    ws.mkdir()
    populate(ws, archive, {}, LIMIT)
    assert (ws / "proj/m.py").read_text() == "M = 1\n"
    assert os.readlink(ws / "proj/alias.py") == "m.py"
    assert (ws / "proj/hard.py").read_text() == "M = 1\n"
    assert (ws / "proj/hard.py").stat().st_nlink == 1  # a copy, not a link
    z = tmp_path / "p.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("d/x.txt", "X")
        zf.writestr("d/e/", "")
    ws = tmp_path / "ws2"
    ws.mkdir()
    populate(ws, z, {}, LIMIT)
    assert (ws / "d/x.txt").read_text() == "X" and (ws / "d/e").is_dir()


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([(reg("/etc/evil"), b"x")], "absolute"),
        ([(reg("../evil"), b"x")], r"'\.\.'"),
        ([(reg("a/../../evil"), b"x")], r"'\.\.'"),
        ([(link("l", "/etc"), None)], "link leaves"),
        ([(link("d/l", "../.."), None)], "link leaves"),
        ([(link("l", "/etc/passwd", tarfile.LNKTYPE), None)], "absolute"),
        ([(link("h", "missing", tarfile.LNKTYPE), None)], "not a regular file earlier"),
        # a link to inside, then a file written "through" it: the link is made last, and the
        # file's path is a real directory by then: refused, nothing written through a link
        ([(link("l", "."), None), (reg("l/x"), b"x")], "already exists"),
        ([(link("fifo", "", tarfile.FIFOTYPE), None)], "special files"),
        ([(link("dev", "", tarfile.CHRTYPE), None)], "special files"),
        ([(reg("big"), b"x" * (LIMIT + 1))], "size limit"),
    ],
)
def test_unsafe_tar_refused(tmp_path: Path, members: list, match: str) -> None:
    archive = tar_with(tmp_path / "bad.tar.gz", members)
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(WorkspaceError, match=match):
        populate(ws, archive, {}, LIMIT)
    assert not (tmp_path / "evil").exists() and not Path("/etc/evil").exists()


def test_unsafe_zip_refused(tmp_path: Path) -> None:
    for name in ("../evil", "/abs", "a\\..\\..\\evil"):
        z = tmp_path / "bad.zip"
        with zipfile.ZipFile(z, "w") as zf:
            zf.writestr(name, "x")
        ws = tmp_path / "ws"
        shutil.rmtree(ws, ignore_errors=True)
        ws.mkdir()
        with pytest.raises(WorkspaceError):
            populate(ws, z, {}, LIMIT)
    z = tmp_path / "link.zip"
    with zipfile.ZipFile(z, "w") as zf:
        info = zipfile.ZipInfo("l")
        info.external_attr = 0o120777 << 16
        zf.writestr(info, "/etc/shadow")
    with pytest.raises(WorkspaceError, match="link leaves"):
        populate(tmp_path / "ws", z, {}, LIMIT)
    with zipfile.ZipFile(z, "w") as zf:  # a zip bomb announces its size
        zf.writestr("zeros", b"\0" * (LIMIT + 1), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(WorkspaceError, match="over the workspace limit"):
        populate(tmp_path / "ws", z, {}, LIMIT)


def test_task_field_validation(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "a.tar.gz").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    os.symlink("/etc", tmp_path / "etc-link")
    rows = [
        {"id": "ok-dir", "prompt": "p", "workspace": "repo"},
        {"id": "ok-tar", "prompt": "p", "workspace": "./a.tar.gz"},
        {"id": "abs", "prompt": "p", "workspace": "/etc"},
        {"id": "up", "prompt": "p", "workspace": "../"},
        {"id": "via-link", "prompt": "p", "workspace": "etc-link"},
        {"id": "missing", "prompt": "p", "workspace": "nope"},
        {"id": "kind", "prompt": "p", "workspace": "notes.txt"},
        {"id": "type", "prompt": "p", "workspace": 3},
        {"id": "replay", "prompt": "p", "replay": "not a list"},
    ]
    path = tmp_path / "t.jsonl"
    write_jsonl(path, rows)
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["ok-dir", "ok-tar"]
    assert tasks[0].workspace == str((tmp_path / "repo").resolve())
    why = {e.task_id: e.reason for e in errors}
    assert "relative to the dataset" in why["abs"]
    assert "outside the dataset file's directory" in why["up"]
    assert "outside the dataset file's directory" in why["via-link"]
    assert "does not exist" in why["missing"]
    assert "neither a directory nor" in why["kind"]
    assert "must be a path" in why["type"]
    assert '"replay" must be a list' in why["replay"]


def test_batch_from_archive_and_repo(tmp_path: Path, needs_bwrap) -> None:
    """A task starting from a .tar.gz, one from a directory that is a git repository with
    uncommitted work; setup runs first; the patch holds only what the agent changed."""
    tar_with(tmp_path / "proj.tar.gz", [(reg("proj/app.py"), b"def answer():\n    return 41\n")])
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "lib.py").write_text("X = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=a", "-c", "user.email=a@b"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    (repo / "lib.py").write_text("X = 2\n")  # uncommitted: part of the starting state
    call = lambda name, **a: f"<tool_call>{json.dumps({'name': name, 'arguments': a})}</tool_call>"  # noqa: E731
    tasks = [
        {
            "id": "from-tar",
            "prompt": "p",
            "workspace": "proj.tar.gz",
            "setup": ["test -f proj/app.py && echo built > setup.log"],
            "eval": 'python3 -c \'import sys; sys.path.insert(0, "proj"); import app; '
            "sys.exit(app.answer() != 42)'",
            "replay": [
                call("bash", command="cat setup.log"),
                call(
                    "str_replace_editor",
                    command="str_replace",
                    path="proj/app.py",
                    old_str="41",
                    new_str="42",
                ),
            ],
        },
        {
            "id": "from-repo",
            "prompt": "p",
            "workspace": "repo",
            "replay": [call("bash", command="echo 3 >> lib.py && git log --format=%s")],
        },
    ]
    tar_with(tmp_path / "evil.tar", [(link("l", "/etc"), None), (reg("l/pwned"), b"x")])
    tasks.append({"id": "evil", "prompt": "p", "workspace": "evil.tar", "eval": "true"})
    path = tmp_path / "t.jsonl"
    write_jsonl(path, tasks)
    out = tmp_path / "out"
    run_cli(
        "--tasks",
        str(path),
        "--out",
        str(out),
        "--engine",
        "replay",
        "--policy",
        "none",
        "--n-ctx",
        "100000",
    )
    recs = {r["task_id"]: r for r in read_jsonl(out / "trajectories.jsonl")}
    e = recs["evil"]
    assert e["status"] == "error" and "link leaves the workspace" in e["reason"]
    assert e["eval"]["command"] is None and not Path("/etc/pwned").exists()
    t = recs["from-tar"]
    assert t["status"] == "submitted" and t["eval"]["solved"]
    assert t["setup"]["git"]["kind"] == "new" and t["setup"]["commands"][0]["exit_code"] == 0
    assert t["step_log"][0]["observation"] == "built\n[exit code 0]"
    diff = t["patch"]["diff"]
    assert "-    return 41\n+    return 42" in diff and "setup.log" not in diff
    r = recs["from-repo"]
    assert r["setup"]["git"]["kind"] == "existing"
    assert r["step_log"][0]["observation"] == "first\n[exit code 0]"  # HEAD untouched
    assert (
        r["patch"]["diff"].endswith(" X = 2\n+3\n") and (repo / "lib.py").read_text() == "X = 2\n"
    )
