"""Subcommands of the caffeq CLI, one module each (add_parser + run)."""
