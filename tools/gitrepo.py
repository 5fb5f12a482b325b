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
_DIFF = (
    'tmp=$(mktemp -d) && export GIT_INDEX_FILE="$tmp/index" && '
    f"{GIT} read-tree {{base}} && {GIT} add -A >/dev/null 2>&1 && "
    f"{GIT} diff --cached --binary --no-color --no-ext-diff --no-textconv {{base}} 2>/dev/null"
)
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
        r = await ctx.sandbox.run(_DIFF.format(base=base), ctx.workspace, ctx.uid, limits)
    except OSError as e:
        return {"base": base, "error": str(e), "summary": "The patch could not be captured."}
    if r.timed_out or r.exit_code != 0:
        why = "timed out" if r.timed_out else f"git exit code {r.exit_code}"
        return {
            "base": base,
            "error": f"{why}: {r.output[-500:].strip()}",
            "summary": f"The patch could not be captured ({why}; was .git removed?).",
        }
    diff = r.output
    for note, flag in (
        ("\n[workspace over its size limit", r.workspace_over_limit),
        (_TRUNC, r.truncated),
    ):
        if flag and note in diff:
            diff = diff[: diff.rfind(note)]
    files = len(re.findall(r"^diff --git ", diff, re.MULTILINE))
    return {
        "base": base,
        "diff": diff,
        "files": files,
        "truncated": r.truncated,
        "summary": f"Patch captured: {files} file(s) changed"
        + (" (truncated)." if r.truncated else "."),
    }
