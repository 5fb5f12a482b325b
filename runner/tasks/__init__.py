"""Data in: tasks and their loading (tasks.py), dataset formats and field maps (formats.py),
SWE-bench records (swebench.py), rewards and sample seeds (rewards.py).

May import: runfolder.records, tools.
"""
