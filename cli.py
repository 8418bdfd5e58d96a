#!/usr/bin/env python3
"""Thin shim so that `python cli.py ...` works from a source checkout."""
import sys

from caffeq.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
