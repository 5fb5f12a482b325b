"""The tools, each called for real in a bubblewrap sandbox as an unprivileged uid: bash,
python, str_replace_editor (tricky inputs, undo, path and symlink escapes) and submit (the
git patch). Uids 220000+ (tests/tools/test_sandbox.py uses 210000+, batches 200000+)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from runner.agent.agent import Agent
from runner.engines.protocol import SamplingParams
from runner.engines.replay import ReplayEngine, scripts_from_trajectories
from runner.tasks.tasks import Task
from tools.core import ToolContext, check_args, schema
from tools.editor import StrReplaceEditor
from tools.gitrepo import ensure_repo
from tools.registry import DEFAULT_TOOLS, REGISTRY, get_tools
from tools.sandbox import BwrapSandbox, Limits, UnsandboxedSandbox

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root (per-agent uids)"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]
_uids = itertools.count(220000)


def make_ctx(
    sb: BwrapSandbox, base: Path, files: dict[str, str] | None = None, **lim
) -> ToolContext:
    uid = next(_uids)
    ws = base / f"ws{uid}"
    ws.mkdir()
    for rel, content in (files or {}).items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(content, encoding="utf-8")
    sb.prepare_workspace(ws, uid)
    return ToolContext(ws, uid, sb, Limits(**{"timeout_s": 20, **lim}))


async def call(ctx: ToolContext, name: str, **args):
    tool = get_tools([name])[name]
    problem = check_args(tool, args)
    assert problem is None, problem
    return await tool(args, ctx)


def tool_call(name: str, **args) -> str:
    """An assistant message calling a tool, as a model writes it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


async def ed(ctx: ToolContext, command: str, **args):
    return await StrReplaceEditor()({"command": command, **args}, ctx)


# ---- registry and schemas --------------------------------------------------------------


def test_default_suite_and_schemas() -> None:
    assert DEFAULT_TOOLS == ("bash", "python", "str_replace_editor", "submit")
    tools = get_tools(list(DEFAULT_TOOLS))
    assert list(tools) == list(DEFAULT_TOOLS)
    for t in tools.values():
        s = schema(t)
        json.dumps(s)  # what the chat template gets
        assert s["function"]["name"] == t.name and s["function"]["description"]
        params = s["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
    assert "submit" in get_tools(["python"])  # an agent can always end
    with pytest.raises(ValueError, match="unknown tool"):
        get_tools(["bash", "nope"])
    assert set(DEFAULT_TOOLS) <= set(REGISTRY)
    editor = tools["str_replace_editor"]
    assert "must be of type integer" in check_args(
        editor, {"command": "insert", "path": "a", "insert_line": "3", "new_str": "x"}
    )


# ---- bash and python -------------------------------------------------------------------


async def test_bash(sb: BwrapSandbox, base: Path) -> None:
    ctx = make_ctx(sb, base)
    o = await call(ctx, "bash", command="echo hi; id -u; pwd")
    assert o.ok and o.text == f"hi\n{ctx.uid}\n/work\n[exit code 0]"
    o = await call(ctx, "bash", command="exit 3")
    assert not o.ok and o.text == "(no output)\n[exit code 3]"
    o = await call(ctx, "bash", command="sleep 5", timeout=1)
    assert not o.ok and "[killed: timed out after 1s]" in o.text
    for bad in (0, -1, 10_000, True):
        o = await call(ctx, "bash", command="true", timeout=bad)
        assert not o.ok and "timeout must be" in o.text
    o = await call(ctx, "bash", command="head -c 100000 /dev/zero | tr '\\0' x")
    assert "more bytes not shown" in o.text and "characters truncated" in o.text
    assert len(o.text) < 17_000


async def test_workspace_bound_while_running(sb: BwrapSandbox, base: Path) -> None:
    """Many empty files (inodes) and big files are both stopped while the command runs."""
    ctx = make_ctx(sb, base, workspace_bytes=4 << 20)
    code = "import itertools\nfor i in itertools.count():\n    open(f'e{i}', 'w').close()"
    o = await call(ctx, "python", code=code)
    assert o.text.endswith("[killed: the workspace exceeded its size limit]")
    assert len(os.listdir(ctx.workspace)) < 200_000
    o = await call(ctx, "bash", command="rm -f e* && echo clean")
    assert o.ok and "clean" in o.text and "size limit" not in o.text
    o = await call(ctx, "bash", command="while :; do head -c 1000000 /dev/zero > f$RANDOM; done")
    assert "[killed: the workspace exceeded its size limit]" in o.text


async def test_python(sb: BwrapSandbox, base: Path) -> None:
    ctx = make_ctx(sb, base, {"mymod.py": "VALUE = 'from the workspace'\n"})
    o = await call(
        ctx, "python", code="import mymod, os\nprint(mymod.VALUE, os.getuid(), os.getcwd())"
    )
    assert o.ok and o.text == f"from the workspace {ctx.uid} /work\n[exit code 0]"
    o = await call(ctx, "python", code="x = 1\n\ndef f():\n    return 1 / 0\n\nf()\n")
    assert not o.ok and "ZeroDivisionError" in o.text and "return 1 / 0" in o.text
    assert "[exit code 1]" in o.text
    o = await call(ctx, "python", code="print('é ✓ 😀'); print(input())")
    assert "é ✓ 😀" in o.text and "EOFError" in o.text  # no stdin: input() ends at once
    o = await call(ctx, "python", code="import sys; print(sys.executable); sys.exit(4)")
    assert o.text == "/usr/bin/python3\n[exit code 4]"
    o = await call(ctx, "python", code="while True: pass", timeout=1)
    assert not o.ok and "[killed: timed out after 1s]" in o.text
    o = await call(ctx, "python", code="   ")
    assert not o.ok and "empty" in o.text
    o = await call(ctx, "python", code="open('/etc/passwd2', 'w')")
    assert "Read-only file system" in o.text or "Permission denied" in o.text
    assert not (ctx.workspace / "snippet").exists() and os.listdir(ctx.workspace) == ["mymod.py"]


# ---- str_replace_editor ----------------------------------------------------------------

GIT = "git -c user.name=a -c user.email=a@b"
SRC = "def f(x):\n    return x\n\n\ndef g(x):\n    return x\n"


async def test_editor_view(sb: BwrapSandbox, base: Path) -> None:
    ctx = make_ctx(sb, base, {"a.py": SRC, "pkg/b/c/deep.py": "", ".hidden": "x"})
    o = await ed(ctx, "view", path="/work/a.py")
    assert o.ok and o.text.splitlines()[0] == "Here's the result of running `cat -n` on /work/a.py:"
    assert o.text.splitlines()[1:3] == ["     1\tdef f(x):", "     2\t    return x"]
    assert len(o.text.splitlines()) == 7
    o = await ed(ctx, "view", path="a.py", view_range=[5, 6])  # relative paths work too
    assert o.ok and o.text.splitlines()[1:] == ["     5\tdef g(x):", "     6\t    return x"]
    o = await ed(ctx, "view", path="a.py", view_range=[5, -1])
    assert o.text.splitlines()[1:] == ["     5\tdef g(x):", "     6\t    return x"]
    o = await ed(ctx, "view", path="a.py", view_range=[4, 99])
    assert o.ok and "only 6 lines" in o.text
    for bad in ([0, 3], [7, 8], [3, 2], [1], ["1", 2]):
        o = await ed(ctx, "view", path="a.py", view_range=bad)
        assert not o.ok and "Invalid `view_range`" in o.text, (bad, o.text)
    o = await ed(ctx, "view", path="/work")
    assert o.ok
    lines = o.text.splitlines()
    assert "/work/a.py" in lines and "/work/pkg/" in lines and "/work/pkg/b/" in lines
    assert "/work/pkg/b/c/" not in lines  # 2 levels
    assert ".hidden" not in o.text.split("excluding")[1].split("\n\n")[0]
    assert "1 hidden" in o.text
    o = await ed(ctx, "view", path="/work", view_range=[1, 2])
    assert not o.ok and "not allowed when `path` points to a directory" in o.text
    o = await ed(ctx, "view", path="/work/missing.py")
    assert (
        not o.ok
        and o.text == "The path /work/missing.py does not exist. Please provide a valid path."
    )


async def test_editor_view_big_and_binary(sb: BwrapSandbox, base: Path) -> None:
    big = "".join(f"line {i} " + "x" * 60 + "\n" for i in range(1, 5001))
    ctx = make_ctx(sb, base, {"big.txt": big})
    o = await ed(ctx, "view", path="big.txt")
    assert o.ok and "output truncated: showing lines 1-" in o.text and "of 5000" in o.text
    assert "use view_range" in o.text and len(o.text) <= 16_500
    o = await ed(ctx, "view", path="big.txt", view_range=[4999, -1])
    assert o.text.splitlines()[1].startswith("  4999\tline 4999 ")
    (ctx.workspace / "bin").write_bytes(b"\x7fELF\x00\x01\xff")
    o = await ed(ctx, "view", path="bin")
    assert not o.ok and "binary" in o.text
    (ctx.workspace / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    o = await ed(ctx, "str_replace", path="latin1.txt", old_str="caf", new_str="tea")
    assert not o.ok and "not UTF-8" in o.text


async def test_editor_create_and_str_replace(sb: BwrapSandbox, base: Path) -> None:
    ctx = make_ctx(sb, base, {"a.py": SRC})
    o = await ed(ctx, "create", path="/work/new/dir/n.py", file_text="print('hi')\n")
    assert o.ok and o.text == "File created successfully at: /work/new/dir/n.py"
    st = (ctx.workspace / "new/dir/n.py").stat()
    assert (st.st_uid, st.st_gid) == (ctx.uid, ctx.uid)  # written by the agent's uid, not root
    o = await ed(ctx, "create", path="new/dir/n.py", file_text="x")
    assert not o.ok and "File already exists at: /work/new/dir/n.py" in o.text
    o = await ed(ctx, "create", path="new", file_text="x")
    assert not o.ok and "is a directory" in o.text
    o = await ed(ctx, "create", path="c.py")
    assert not o.ok and "`file_text` is required" in o.text
    # no match
    o = await ed(ctx, "str_replace", path="a.py", old_str="return y", new_str="return 2")
    assert not o.ok and "did not appear verbatim in /work/a.py" in o.text
    # several matches: the count and the lines
    o = await ed(ctx, "str_replace", path="a.py", old_str="    return x", new_str="    return 0")
    assert not o.ok and "2 matches" in o.text and "[2, 6]" in o.text
    assert (ctx.workspace / "a.py").read_text() == SRC  # untouched
    # exactly one
    o = await ed(
        ctx,
        "str_replace",
        path="a.py",
        old_str="def g(x):\n    return x",
        new_str="def g(x):\n    return -x",
    )
    assert o.ok and "has been edited" in o.text and "     6\t    return -x" in o.text
    assert (ctx.workspace / "a.py").read_text() == SRC[: -len("return x\n")] + "return -x\n"
    o = await ed(ctx, "str_replace", path="a.py", old_str="", new_str="x")
    assert not o.ok and "empty" in o.text
    o = await ed(ctx, "str_replace", path="a.py", old_str="def f", new_str="def f")
    assert not o.ok and "identical" in o.text
    o = await ed(ctx, "str_replace", path="missing.py", old_str="a", new_str="b")
    assert not o.ok and "does not exist" in o.text
    o = await ed(ctx, "str_replace", path="/work/new", old_str="a", new_str="b")
    assert not o.ok and "is a directory" in o.text
    # new_str omitted: deletion
    o = await ed(ctx, "str_replace", path="a.py", old_str="\n\ndef g(x):\n    return -x\n")
    assert o.ok and (ctx.workspace / "a.py").read_text() == "def f(x):\n    return x\n"


async def test_editor_unicode_and_line_endings(sb: BwrapSandbox, base: Path) -> None:
    text = "naïve = 'café'  # ✓\nemoji = '😀'\nname = 'Ωmega'\n"
    ctx = make_ctx(sb, base, {"u.py": text, "crlf.txt": "one\r\ntwo\r\nthree\r\n"})
    o = await ed(
        ctx, "str_replace", path="u.py", old_str="emoji = '😀'", new_str="emoji = '🎉🎉'  # ünï"
    )
    assert o.ok and "🎉🎉" in o.text
    assert (ctx.workspace / "u.py").read_text(encoding="utf-8") == text.replace(
        "emoji = '😀'", "emoji = '🎉🎉'  # ünï"
    )
    o = await ed(ctx, "view", path="u.py")
    assert "naïve = 'café'  # ✓" in o.text
    o = await ed(ctx, "str_replace", path="u.py", old_str="Ω", new_str="\ud800")  # a lone surrogate
    assert not o.ok and "invalid characters" in o.text
    o = await ed(ctx, "str_replace", path="crlf.txt", old_str="one\ntwo", new_str="1\n2")
    assert o.ok and (ctx.workspace / "crlf.txt").read_bytes() == b"1\r\n2\r\nthree\r\n"


async def test_editor_insert(sb: BwrapSandbox, base: Path) -> None:
    ctx = make_ctx(sb, base, {"i.txt": "a\nb\nc\n", "nonl.txt": "a\nb"})
    p = ctx.workspace / "i.txt"
    assert (await ed(ctx, "insert", path="i.txt", insert_line=0, new_str="top")).ok
    assert p.read_text() == "top\na\nb\nc\n"
    o = await ed(ctx, "insert", path="i.txt", insert_line=2, new_str="x1\nx2\n")
    assert o.ok and p.read_text() == "top\na\nx1\nx2\nb\nc\n"
    assert "     3\tx1" in o.text and "     4\tx2" in o.text
    assert (await ed(ctx, "insert", path="i.txt", insert_line=6, new_str="end")).ok
    assert p.read_text() == "top\na\nx1\nx2\nb\nc\nend\n"
    o = await ed(ctx, "insert", path="i.txt", insert_line=8, new_str="z")
    assert not o.ok and "[0, 7]" in o.text
    o = await ed(ctx, "insert", path="i.txt", insert_line=-1, new_str="z")
    assert not o.ok and "Invalid `insert_line`" in o.text
    assert (await ed(ctx, "insert", path="nonl.txt", insert_line=2, new_str="c")).ok
    assert (ctx.workspace / "nonl.txt").read_text() == "a\nb\nc\n"
    o = await ed(ctx, "insert", path="i.txt", insert_line=1)
    assert not o.ok and "`new_str` is required" in o.text


async def test_editor_undo(sb: BwrapSandbox, base: Path) -> None:
    ctx = make_ctx(sb, base, {"a.py": SRC})
    p = ctx.workspace / "a.py"
    o = await ed(ctx, "undo_edit", path="a.py")
    assert not o.ok and o.text == "No edit history found for /work/a.py."
    await ed(ctx, "str_replace", path="a.py", old_str="def f(x)", new_str="def f(y)")
    await ed(ctx, "insert", path="/work/a.py", insert_line=0, new_str="# header")
    assert p.read_text().startswith("# header\ndef f(y)")
    o = await ed(ctx, "undo_edit", path="/work/./a.py")  # same file, another spelling
    assert o.ok and "undone successfully" in o.text and p.read_text() == SRC.replace("f(x)", "f(y)")
    assert (await ed(ctx, "undo_edit", path="a.py")).ok and p.read_text() == SRC
    assert not (await ed(ctx, "undo_edit", path="a.py")).ok
    # undo of a create removes the file
    await ed(ctx, "create", path="n.py", file_text="new\n")
    o = await ed(ctx, "undo_edit", path="n.py")
    assert o.ok and not (ctx.workspace / "n.py").exists()
    # the history is per agent: another agent has none for the same path
    other = make_ctx(sb, base, {"a.py": SRC})
    await ed(ctx, "str_replace", path="a.py", old_str="def g", new_str="def h")
    assert not (await ed(other, "undo_edit", path="a.py")).ok
    assert (await ed(ctx, "undo_edit", path="a.py")).ok and p.read_text() == SRC


async def test_editor_path_escapes(sb: BwrapSandbox, base: Path) -> None:
    secret = base / "host-secret.txt"
    secret.write_text("TOP SECRET\n")
    ctx = make_ctx(sb, base, {"a.py": SRC})
    for path in ("/etc/passwd", "../host-secret.txt", "/work/../etc/passwd", "/tmp/x", "/", ""):
        for cmd, extra in (
            ("view", {}),
            ("create", {"file_text": "x"}),
            ("str_replace", {"old_str": "root", "new_str": "x"}),
            ("insert", {"insert_line": 0, "new_str": "x"}),
        ):
            o = await ed(ctx, cmd, path=path, **extra)
            assert not o.ok, (cmd, path, o.text)
            assert "outside the workspace" in o.text or "path` parameter is required" in o.text
    # symlinks planted in the workspace that point outside it (even at host paths)
    ws = ctx.workspace
    os.symlink("/etc/passwd", ws / "pw")
    os.symlink(str(secret), ws / "sec")
    os.symlink("..", ws / "up")
    os.symlink("a.py", ws / "inside")  # pointing inside: fine
    for path, cmd, extra in (
        ("pw", "view", {}),
        ("sec", "view", {}),
        ("sec", "str_replace", {"old_str": "TOP", "new_str": "x"}),
        ("up/host-secret.txt", "view", {}),
        ("up/evil.txt", "create", {"file_text": "x"}),
        ("pw", "insert", {"insert_line": 0, "new_str": "x"}),
    ):
        o = await ed(ctx, cmd, path=path, **extra)
        assert not o.ok and "outside" in o.text, (path, o.text)
        assert "TOP SECRET" not in o.text and "root:" not in o.text
    assert secret.read_text() == "TOP SECRET\n" and not (base / "evil.txt").exists()
    o = await ed(ctx, "str_replace", path="inside", old_str="def f", new_str="def F")
    assert o.ok and (ws / "a.py").read_text().startswith("def F")
    # a fifo does not hang the editor
    os.mkfifo(ws / "fifo")
    os.chown(ws / "fifo", ctx.uid, ctx.uid)
    o = await ed(ctx, "view", path="fifo")
    assert not o.ok and "not a regular file" in o.text
    o = await ed(ctx, "str_replace", path="fifo", old_str="a", new_str="b")
    assert not o.ok and "not a regular file" in o.text


async def test_editor_runs_as_the_uid_not_root(sb: BwrapSandbox, base: Path) -> None:
    """A root-owned 0600 file in the workspace is out of the agent's reach, editor included."""
    ctx = make_ctx(sb, base)
    f = ctx.workspace / "root-only.txt"
    f.write_text("root data\n")
    f.chmod(0o600)  # still owned by root: prepare_workspace ran before
    o = await ed(ctx, "view", path="root-only.txt")
    assert not o.ok and "Permission denied" in o.text and "root data" not in o.text
    o = await ed(ctx, "str_replace", path="root-only.txt", old_str="root", new_str="agent")
    assert not o.ok and f.read_text() == "root data\n"


async def test_editor_and_python_in_none_mode(base: Path) -> None:
    """--sandbox none: paths are the real workspace path; still run as the agent's uid."""
    sb = UnsandboxedSandbox()
    uid = next(_uids)
    ws = base / f"none{uid}"
    ws.mkdir()
    (ws / "a.py").write_text(SRC)
    sb.prepare_workspace(ws, uid)
    ctx = ToolContext(ws, uid, sb, Limits(timeout_s=20))
    o = await ed(ctx, "str_replace", path=str(ws / "a.py"), old_str="def g", new_str="def h")
    assert o.ok and (ws / "a.py").stat().st_uid == uid
    assert (await ed(ctx, "undo_edit", path="a.py")).ok and (ws / "a.py").read_text() == SRC
    o = await ed(ctx, "view", path="/etc/passwd")
    assert not o.ok and f"outside the workspace {ws}" in o.text
    o = await call(ctx, "python", code="import os; print(os.getcwd() == os.environ['HOME'])")
    assert o.text == "True\n[exit code 0]"


# ---- submit and the patch --------------------------------------------------------------


async def test_submit_captures_the_patch(sb: BwrapSandbox, base: Path) -> None:
    ctx = make_ctx(sb, base, {"a.py": SRC, "keep.txt": "same\n", "gone.txt": "bye\n"})
    o = await call(ctx, "submit", answer="no repo")
    assert o.submitted and o.answer == "no repo" and o.text == "Submitted."
    assert "patch" not in ctx.state  # no git base: no patch
    info = await ensure_repo(ctx)
    assert info["kind"] == "new" and len(info["base"]) == 40
    await ed(ctx, "str_replace", path="a.py", old_str="def g", new_str="def h")
    await ed(ctx, "create", path="added.py", file_text="NEW = 1\n")
    await call(
        ctx,
        "bash",
        command=f"rm gone.txt && git add -A && {GIT} commit -qm agent",
    )
    o = await call(ctx, "submit", answer="done")
    assert o.submitted and "2 file(s)" not in o.text and "Patch captured: 3 file(s)" in o.text
    diff = ctx.state["patch"]["diff"]
    assert "+def h(x):" in diff and "+NEW = 1" in diff and "deleted file mode" in diff
    assert "keep.txt" not in diff
    # an existing repository with uncommitted work: the base is its state at the start
    ctx2 = make_ctx(sb, base, {"x.txt": "1\n"})
    await call(
        ctx2,
        "bash",
        command=f"git init -q && git add -A && {GIT} commit -qm c && echo 2 > x.txt && "
        "echo u > untracked.txt",
    )
    info = await ensure_repo(ctx2)
    assert info["kind"] == "existing"
    await call(ctx2, "bash", command="echo 3 > x.txt")
    await call(ctx2, "submit")
    diff = ctx2.state["patch"]["diff"]
    assert "-2\n+3" in diff and "untracked" not in diff
    head = await call(ctx2, "bash", command="git log --format=%s")
    assert head.text.startswith("c\n")  # HEAD was not moved by the snapshot
    # .git removed by the agent: submit still ends, and says so
    await call(ctx2, "bash", command="rm -rf .git")
    o = await call(ctx2, "submit")
    assert o.submitted and "could not be captured" in o.text


# ---- replay engine (no sandbox needed, but cheap) -------------------------------------


async def test_replay_engine_token_in_token_out(tmp_path: Path) -> None:
    script = [
        'thinking <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call> ignored',
        "no call here",
    ]
    eng = ReplayEngine({"a": script}, context_limit=10_000)
    tok = eng.tokenizer
    sp = SamplingParams(max_new_tokens=100, stop=("</tool_call>",))

    async def go() -> list:
        p1 = tok.encode(tok.render([{"role": "user", "content": "hi"}]))
        g1 = await eng.generate(p1, sp, agent="a")
        p2 = p1 + g1.output_ids + tok.encode("<|im_end|>\n<|im_start|>user\nobs<|im_end|>\n")
        g2 = await eng.generate(p2, sp, agent="a")
        g3 = await eng.generate(p2 + g2.output_ids, sp, agent="a")
        g4 = await eng.generate(p1, SamplingParams(max_new_tokens=3), agent="b")
        with pytest.raises(Exception, match="agent="):
            await eng.generate(p1, sp)
        return [p1, g1, p2, g2, g3, g4]

    p1, g1, p2, g2, g3, g4 = await go()
    assert g1.text.endswith("</tool_call>") and "ignored" not in g1.text  # cut at the stop
    assert not g1.stopped_on_eos and g1.finish_reason == "stop" and g1.cached_tokens == 0
    assert g2.text == "no call here" and g2.stopped_on_eos and g2.output_ids[-1] in tok.eos_ids
    assert g2.cached_tokens == len(p1) + len(g1.output_ids)  # the agent's previous request
    assert g2.prompt_tokens == len(p2)
    assert '"submit"' in g3.text  # entries ran out
    assert g4.finish_reason == "length" and g4.completion_tokens == 3  # max_new_tokens
    stats = eng.cache_stats()
    assert stats.usage is None and stats.extra["requests"] == 4
    # the assistant turns of a previous run's trajectories
    traj = tmp_path / "trajectories.jsonl"
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "given with the task"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "step 1"},
        {"role": "user", "content": "obs"},
        {"role": "assistant", "content": "step 2"},
    ]
    traj.write_text(json.dumps({"task_id": "t", "steps": 2, "messages": msgs}) + "\n")
    assert scripts_from_trajectories(tmp_path) == {"t": ["step 1", "step 2"]}


async def test_agent_survives_tool_failures(sb: BwrapSandbox, base: Path) -> None:
    """Through the agent loop: bad calls are observations, never exceptions."""
    ctx = make_ctx(sb, base, {"a.py": SRC})
    replies = [
        "no tool call at all",
        tool_call("str_replace_editor", command="fly", path="a"),
        tool_call("str_replace_editor", command="view"),
        tool_call("python", code=5),
        tool_call("bash", command="exit 9"),
        tool_call("submit", answer="ok"),
    ]
    eng = ReplayEngine({"t": replies}, context_limit=100_000)

    class OpenGate:
        async def acquire(self, key: str, n: int) -> None:
            return None

        def done_request(self, key: str) -> None:
            return None

    task = Task("t", [{"role": "user", "content": "do it"}])
    agent = Agent(
        "t",
        task,
        eng,
        OpenGate(),
        get_tools(list(DEFAULT_TOOLS)),
        ctx,  # type: ignore[arg-type]
        SamplingParams(stop=("</tool_call>",)),
        max_steps=10,
    )
    status, _reason, answer = await agent.run()
    assert (status, answer) == ("submitted", "ok")
    obs = [s.observation for s in agent.steps]
    assert "no tool call" in obs[0]
    assert "unknown command 'fly'" in obs[1]
    assert "missing required argument(s) ['path']" in obs[2]
    assert "must be of type string" in obs[3]
    assert "[exit code 9]" in obs[4]
    assert [s.tool_ok for s in agent.steps[:5]] == [False] * 5


def test_no_process_left() -> None:
    used = ",".join(str(u) for u in range(220000, next(_uids)))
    p = subprocess.run(["pgrep", "-a", "-u", used], capture_output=True, text=True)
    assert p.stdout == ""
