"""The workspace's git base and the final patch, both computed INSIDE the sandbox as the
agent's uid (the workspace, its .git included, is attacker-controlled).

`ensure_repo` runs once per agent after the task's setup: a workspace without `.git` becomes a
repository whose first commit holds the starting state; in a workspace that already is one,
the starting state (tracked, modified and untracked files) is snapshotted as a commit on top
of HEAD without moving HEAD or the index. Either way the base commit is kept under
`refs/concur/base`. `capture_patch` diffs the final workspace (new files included) against it.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from .core import ToolContext
from .sandbox import ExecResult

PATCH_BYTES = 2**20  # kept in the trajectory; a longer patch is cut and marked truncated
BASE_REF = "refs/concur/base"
# Fixed identity; no hooks, no fsmonitor, no external diff drivers from a planted config.
GIT = (
    "git -c user.name=concur -c user.email=concur@localhost -c commit.gpgsign=false "
    "-c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.quotepath=off"
)
_ENSURE = f"""set -e
command -v git >/dev/null || {{ echo "git is not installed"; exit 3; }}
if [ -e .git ]; then
  tmp=$(mktemp -d); export GIT_INDEX_FILE="$tmp/index"
  if parent=$({GIT} rev-parse -q --verify HEAD); then
    {GIT} read-tree HEAD
    {GIT} add -A >/dev/null 2>&1
    base=$({GIT} commit-tree "$({GIT} write-tree)" -p "$parent" -m "concur: initial state")
  else
    {GIT} add -A >/dev/null 2>&1
    base=$({GIT} commit-tree "$({GIT} write-tree)" -m "concur: initial state")
  fi
  rm -rf "$tmp"
  kind=existing
else
  {GIT} init -q
  {GIT} add -A >/dev/null 2>&1
  {GIT} commit -q --allow-empty --no-verify -m "initial state"
  base=$({GIT} rev-parse HEAD)
  kind=new
fi
{GIT} update-ref {BASE_REF} "$base"
echo "BASE $base $kind"
"""


# The diff stages the final workspace in a temporary index and object store under /tmp (the
# repository's objects borrowed read-only), so it writes nothing into the workspace: a full
# workspace still gets its patch. Each failure is named on a CONCUR-ERROR line.
def _diff_script(base: str) -> str:
    return f"""[ -e .git ] || {{ echo "CONCUR-ERROR no-git"; exit 90; }}
objects=$({GIT} rev-parse --path-format=absolute --git-path objects 2>/dev/null) ||
  {{ echo "CONCUR-ERROR bad-git"; exit 91; }}
{GIT} cat-file -e "{base}^{{commit}}" 2>/dev/null ||
  {{ echo "CONCUR-ERROR no-base"; exit 92; }}
tmp=$(mktemp -d) || {{ echo "CONCUR-ERROR no-tmp"; exit 93; }}
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/objects"
export GIT_INDEX_FILE="$tmp/index" GIT_OBJECT_DIRECTORY="$tmp/objects"
export GIT_ALTERNATE_OBJECT_DIRECTORIES="$objects"
if ! {GIT} read-tree {base} 2>"$tmp/err" || ! {GIT} add -A >/dev/null 2>"$tmp/err"; then
  echo "CONCUR-ERROR git-add"; tail -c 1500 "$tmp/err"; exit 94
fi
{GIT} diff --cached --binary --no-color --no-ext-diff --no-textconv {base} 2>"$tmp/err" ||
  {{ echo; echo "CONCUR-ERROR git-diff"; tail -c 1500 "$tmp/err"; exit 95; }}
"""


_FAILURES = {
    "no-git": "the workspace has no .git any more (it was deleted)",
    "bad-git": "git cannot read the repository in .git (it was damaged)",
    "no-base": "the base commit is no longer in .git (its objects were deleted or rewritten)",
    "no-tmp": "no temporary directory could be made in /tmp",
    "git-add": "git could not stage the workspace",
    "git-diff": "git diff failed",
}
_ENOSPC = "No space left on device"
_SHA = re.compile(r"^[0-9a-f]{40,64}$")
_TRUNC = "\n[... output truncated:"


async def ensure_repo(ctx: ToolContext) -> dict[str, Any]:
    """-> {"base": sha, "kind": "new" | "existing"} (also in ctx.state["git_base"]), or
    {"error": why}: then the workspace has no base and submit captures no patch."""
    try:
        r = await ctx.sandbox.run(_ENSURE, ctx.workspace, ctx.uid, ctx.limits)
    except OSError as e:
        return {"error": f"could not run git: {e}"}
    m = re.search(r"^BASE ([0-9a-f]+) (new|existing)$", r.output, re.MULTILINE)
    if r.exit_code != 0 or m is None or not _SHA.match(m.group(1)):
        why = "timed out" if r.timed_out else f"exit code {r.exit_code}"
        return {"error": f"git repository setup failed ({why}): {r.output[-500:].strip()}"}
    ctx.state["git_base"] = m.group(1)
    return {"base": m.group(1), "kind": m.group(2)}


async def capture_patch(ctx: ToolContext) -> dict[str, Any]:
    """The diff of the workspace against its base commit: {"base", "diff", "files",
    "truncated", "summary"} or {"base", "error", "summary"}."""
    base = ctx.state["git_base"]
    limits = replace(ctx.limits, output_bytes=PATCH_BYTES)
    try:
        r = await ctx.sandbox.run(_diff_script(base), ctx.workspace, ctx.uid, limits)
    except OSError as e:
        return {"base": base, "error": str(e), "summary": "The patch could not be captured."}
    if r.timed_out or r.exit_code != 0:
        why = _patch_failure(r, ctx)
        return {
            "base": base,
            "error": f"{why}: {r.output[-500:].strip()}",
            "summary": f"The patch could not be captured: {why}.",
        }
    diff = r.output[: len(r.output) - len(r.notes)]
    if r.truncated and _TRUNC in diff:
        diff = diff[: diff.rfind(_TRUNC)]
    files = len(re.findall(r"^diff --git ", diff, re.MULTILINE))
    return {
        "base": base,
        "diff": diff,
        "files": files,
        "truncated": r.truncated,
        "summary": f"Patch captured: {files} file(s) changed"
        + (" (truncated)." if r.truncated else "."),
    }


def _patch_failure(r: ExecResult, ctx: ToolContext) -> str:
    """What went wrong, from the script's CONCUR-ERROR line (or the exit status)."""
    if r.timed_out:
        return f"git timed out after {ctx.limits.timeout_s:g}s"
    if r.killed == "workspace":  # the watch (a workspace not on its own filesystem)
        return (
            f"the workspace is over its size limit of {_mib(ctx.limits.workspace_bytes)}, so "
            "the sandbox stopped git"
        )
    own = r.output[: len(r.output) - len(r.notes)]  # without the sandbox's notes
    m = re.search(r"^CONCUR-ERROR (\S+)$", own, re.MULTILINE)
    why = _FAILURES.get(m.group(1), m.group(1)) if m else f"git exit code {r.exit_code}"
    if m and m.group(1).startswith("git-"):
        detail = [ln.strip() for ln in own[m.end() :].splitlines() if ln.strip()]
        if detail:  # git's own last message
            why += f" ({detail[-1][:200]})"
    if _ENOSPC in own:
        why += (
            f"; out of space: the workspace is limited to {_mib(ctx.limits.workspace_bytes)}"
            f"{' and full' if r.workspace_full else ''}, /tmp to {_mib(ctx.limits.tmp_bytes)}"
        )
    return why


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"
