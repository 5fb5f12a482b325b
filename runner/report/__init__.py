"""Reports over run folders: `python run.py report RUN [RUN ...]` (docs/report.md).

load.py reads a run folder (read-only), stats.py holds the estimators, table.py builds and
prints the report, timeline.py draws timeline.png from control.jsonl, html.py writes the
self-contained trajectory viewer.
"""
