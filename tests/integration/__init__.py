"""Whole runs through run.py: end to end, kills, signals, the benchmarks' command lines."""
