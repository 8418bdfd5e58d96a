"""The caffeq command line: `python cli.py COMMAND ...` or `caffeq COMMAND ...`.

Each subcommand lives in caffeq/commands/<name>.py with `add_parser(sub)`
and `run(args)`; their shared options are in caffeq/commands/options.py. This
module only dispatches and turns every user error (CaffeqError, and the
command-line errors argparse finds) into one line on stderr with exit status 2.
A reader that stops early (`caffeq inspect M --json | head`) ends the command
quietly with status 141 (128 + SIGPIPE), as other Unix tools do.
"""
import importlib
import os
import sys

from . import __version__
from .errors import CaffeqError

COMMANDS = ["inspect", "run", "convert", "upgrade", "eval", "finetune", "sensitivity"]


def build_parser():
    from .commands.options import CliParser
    parser = CliParser(prog="caffeq", description="Read, run, quantize and export Caffe models.")
    parser.add_argument("--version", action="version", version=f"caffeq {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CliParser)
    handlers = {}
    for name in COMMANDS:
        mod = importlib.import_module(f"caffeq.commands.{name}")
        p = mod.add_parser(sub)
        p.add_argument("--debug", action="store_true", default=False, help="show tracebacks")
        handlers[name] = mod.run
    parser.subcommands = sub.choices
    for p in sub.choices.values():
        p.siblings = sub.choices     # "--no-progress is an option of eval, ..., not of run"
    return parser, handlers


def _parse(parser, argv):
    args, extra = parser.parse_known_args(argv)
    if extra:
        # unknown options are reported by the command's parser, which can suggest its own options
        owner = parser.subcommands.get(getattr(args, "command", None), parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(map(str, argv))
    debug = "--debug" in argv
    args = None
    try:
        parser, handlers = build_parser()
        args = _parse(parser, argv)
        if not args.command:
            parser.print_help()
            return 2
        return handlers[args.command](args) or 0
    except CaffeqError as e:
        if debug:
            raise
        print(f"caffeq: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("caffeq: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        gone = _readers_gone()
        if debug or not gone:      # another pipe (a worker's, a subprocess's) broke: a real error
            raise
        return _closed_pipe(gone)
    except MemoryError:
        if debug:
            raise
        print("caffeq: error: out of memory", file=sys.stderr)
        return 2


EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE: what a shell reports for a writer its reader left


def _readers_gone():
    """The standard streams (stdout, stderr) whose reader has gone away: a pipe or socket whose
    other end is closed polls as an error or hang-up. Where that cannot be asked (no poll, as on
    Windows), stdout is taken to be the one that broke."""
    import select
    if not hasattr(select, "poll"):
        return [sys.stdout]
    gone = []
    for stream in (sys.stdout, sys.stderr):
        try:
            poller = select.poll()
            poller.register(stream.fileno(), 0)
            if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
                gone.append(stream)
        except (OSError, ValueError, AttributeError):   # replaced by one without a descriptor (tests)
            pass
    return gone


def _closed_pipe(streams):
    """A reader went away (`| head`): point its stream at devnull, so that Python's flush at exit
    finds nowhere to fail, and end quietly (Python's documented idiom for SIGPIPE)."""
    for stream in streams:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
