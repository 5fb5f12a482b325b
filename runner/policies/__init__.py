"""Admission policies: the protocol (protocol.py), the default `wset2` (wset2.py, with the
helpers it shares with `wset` in fit.py), the paper's law `aimd` (aimd.py), the baselines
(baselines.py) and the registry that builds one from `--policy` (registry.py). Policies
under trial live in experimental/, behind the same protocol; only the registry names them,
and imports them only when asked.

Policies are pure: they import nothing of the runner or the tools (import-linter).
"""
