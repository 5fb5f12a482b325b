"""Run agent shell commands in a bubblewrap sandbox: as root one unprivileged host uid per
agent, as an ordinary user in an unprivileged user namespace per command (user mode).

Design, and what is and is not contained: docs/sandbox.md. The modules, each one job:

- limits.py: Limits, ExecResult, SandboxUnavailable, the uid constants, the CommandSandbox
  protocol;
- filesystem.py: the root-side walkers over workspace trees (chown, disk usage), removal and
  moving of trees;
- processes.py: spawning one command, its output, wall clock and workspace watch, kill/reap;
- cgroups.py: the per-agent cgroups (v1 memory, or cgroup2.py: v2 memory and pids);
- bwrap.py: the command line (prlimit, setpriv, bwrap flags, the environment inside) and the
  startup probe;
- enforced.py: which limits are really in force here (for summary.json);
- sandboxes.py: Sandbox, BwrapSandbox, UnsandboxedSandbox and make_sandbox;
- uids.py: agent uids leased per run from a host-wide registry (lock file per uid block);
- reaper.py: the process beside each run that kills and removes what it leaves if killed.

The names below are the public interface; everything else is internal to this package.
"""

from .bwrap import probe_bwrap
from .enforced import limits_in_force, limits_line
from .filesystem import move_tree, remove_tree
from .limits import AGENT_UID_BASE, CommandSandbox, ExecResult, Limits, SandboxUnavailable
from .sandboxes import MODES, BwrapSandbox, Sandbox, UnsandboxedSandbox, make_sandbox
from .uids import UidLease, UidsExhausted, lease_uids, start_reaper

__all__ = [
    "AGENT_UID_BASE",
    "MODES",
    "BwrapSandbox",
    "CommandSandbox",
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxUnavailable",
    "UidLease",
    "UidsExhausted",
    "UnsandboxedSandbox",
    "lease_uids",
    "limits_in_force",
    "limits_line",
    "make_sandbox",
    "move_tree",
    "probe_bwrap",
    "remove_tree",
    "start_reaper",
]
