"""Running a batch: the orchestrator (batch.py), task evaluation (evaluation.py),
workspaces (workspace.py), re-scoring (rescore.py), a session around a batch and its
summary.json (session.py), progress on the terminal (progress.py).

May import: agent, gate, engines.protocol, policies.protocol, tasks, runfolder, report,
tools.
"""
