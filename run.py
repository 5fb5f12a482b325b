#!/usr/bin/env python3
"""Entry point: python run.py --tasks swe.jsonl (see README.md)."""

import sys

from runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
