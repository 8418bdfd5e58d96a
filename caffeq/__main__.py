"""The caffeq command line: `python cli.py COMMAND ...` or `caffeq COMMAND ...`.

Each subcommand lives in caffeq/commands/<name>.py with `add_parser(sub)`
and `run(args)`; this module only dispatches and turns CaffeqError into one
line on stderr with exit status 2.
"""
import argparse
import importlib
import sys

from .errors import CaffeqError

COMMANDS = ["inspect", "run", "convert", "upgrade", "eval", "finetune", "sensitivity"]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="caffeq", description="Read, run, quantize and export Caffe models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers = {}
    for name in COMMANDS:
        mod = importlib.import_module(f"caffeq.commands.{name}")
        p = mod.add_parser(sub)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        handlers[name] = mod.run
    return parser, handlers


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return handlers[args.command](args) or 0
    except CaffeqError as e:
        if getattr(args, "debug", False):
            raise
        print(f"caffeq: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("caffeq: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        if getattr(args, "debug", False):
            raise
        print("caffeq: error: out of memory", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
