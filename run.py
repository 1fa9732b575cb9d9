#!/usr/bin/env python3
"""Thin shim: `python run.py <command> ...` runs engine.cli (see `python run.py --help`)."""
import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
