"""User mode's process bound, measured: N concurrent sandboxed commands that all run as ONE uid
(as every agent does in user mode), each `sleep 0.5` under bubblewrap in its own user
namespace, with RLIMIT_NPROC 64 set outside bwrap (what root mode does per agent uid) against
set inside the namespace (what user mode does); and a fork loop per sandbox, K sandboxes at
once, counting the children each got.

    python -m bench.usermode_bench [--n 100] [--forkers 3] [--uid 65534]

Run as root it starts the commands as `--uid` (setpriv); run as an ordinary user, as that
user. Needs bubblewrap. Prints the figures and writes bench/results/usermode/usermode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.paths import USERMODE_RESULTS
from tools.sandbox.bwrap import INNER_PRLIMIT, bwrap_flags, find_bwrap, inner_env

RESULTS = USERMODE_RESULTS
FORKS = (
    "import os, time\nn = 0\nwhile n < 500:\n    try:\n        pid = os.fork()\n"
    "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(3)\n"
    "        os._exit(0)\n    n += 1\nprint(n)\n"
)


def argv(ws: Path, command: str, inside: bool, uid: int | None) -> list[str]:
    from tools.sandbox import Limits

    limits = Limits()
    as_uid = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}",
                                     "--clear-groups", "--"]  # fmt: skip
    outside = [] if inside else ["prlimit", f"--nproc={limits.nproc}", "--"]
    inner = [INNER_PRLIMIT, f"--nproc={limits.nproc}", "--"] if inside else []
    flags = bwrap_flags(ws, limits, "/work", inner_env("/work"))
    return [*as_uid, *outside, find_bwrap(), *flags, "--", *inner, "/usr/bin/bash", "-c", command]


def concurrent(n: int, ws: Path, command: str, inside: bool, uid: int | None) -> dict:
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            argv(ws, command, inside, uid),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(n)
    ]
    outs = [(p.communicate()[0], p.returncode) for p in procs]
    failed = [o for o, rc in outs if rc != 0]
    return {
        "commands": n,
        "failed": len(failed),
        "seconds": round(time.monotonic() - t0, 3),
        "first_error": failed[0].strip()[-200:] if failed else None,
        "outputs": [o.strip() for o, rc in outs if rc == 0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--forkers", type=int, default=3)
    ap.add_argument("--uid", type=int, default=65534, help="as root: the one uid of them all")
    a = ap.parse_args()
    uid = a.uid if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory(prefix="usermode-bench-", dir="/tmp") as tmp:
        ws = Path(tmp) / "ws"
        ws.mkdir()
        os.chmod(tmp, 0o755)
        if uid is not None:
            os.chown(ws, uid, uid)
        rows = {}
        for inside in (False, True):
            key = "inside" if inside else "outside"
            sleeps = concurrent(a.n, ws, "sleep 0.5", inside, uid)
            sleeps.pop("outputs")
            forks = concurrent(a.forkers, ws, f"python3 -c '{FORKS}'", inside, uid)
            rows[key] = {"sleep": sleeps, "forks": forks["outputs"], "fork_failed": forks["failed"]}
            print(
                f"RLIMIT_NPROC 64 {key:7} bwrap: {sleeps['failed']:3}/{a.n} concurrent sleeps "
                f"failed ({sleeps['seconds']:.2f} s); {a.forkers} concurrent fork loops got "
                f"{', '.join(forks['outputs']) or '-'} children"
                + (f"; {sleeps['first_error']}" if sleeps["first_error"] else "")
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "usermode.json"
    meta = {
        "kernel": platform.release(),
        "uid": uid if uid is not None else os.geteuid(),
        "n": a.n,
        "forkers": a.forkers,
        "load": os.getloadavg(),
    }
    out.write_text(json.dumps({"meta": meta, **rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
