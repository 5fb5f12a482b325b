"""`python run.py report RUN [RUN ...] [--json] [--plot] [--html OUT.html]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .load import ReportError, load_run
from .table import build, render


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py report",
        description="Report on run folders: a per-task table, the solve rate with its 95% "
        "interval, pass@k over samples, engine and gate figures; with two or more runs of "
        "one dataset, the tasks that changed outcome and the rate difference against the "
        "first run (docs/report.md).",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folders")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--plot",
        action="store_true",
        help="draw timeline.png into each run folder from its control.jsonl",
    )
    p.add_argument(
        "--html",
        type=Path,
        metavar="OUT.html",
        help="write one self-contained HTML file: summary, timeline, trajectory viewer "
        "(of the first RUN)",
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        runs = [load_run(r) for r in args.runs]
        report = build(runs)
        for run in runs:
            if run.torn_tail:
                print(
                    f"run.py report: note: {run.root / 'trajectories.jsonl'} ends in a "
                    "half-written line (a run in progress or killed); it is left out",
                    file=sys.stderr,
                )
        if args.plot:
            plot(args.runs)
        if args.html:
            html(args.runs[0], args.html)
    except ReportError as e:
        print(f"run.py report: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report), end="")
    return 0


def plot(roots: list[Path]) -> None:
    from .timeline import TimelineError, write_timeline

    for root in roots:
        try:
            out = write_timeline(root)
        except TimelineError as e:
            raise ReportError(str(e)) from None
        print(f"wrote {out}", file=sys.stderr)


def html(root: Path, out: Path) -> None:
    from .html import write_html

    write_html(root, out)
    print(f"wrote {out}", file=sys.stderr)
