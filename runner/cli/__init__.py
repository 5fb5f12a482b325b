"""The command line: parser.py (the options), engines.py (the engine factory table),
main.py (plans and the run)."""

from .main import main

__all__ = ["main"]
