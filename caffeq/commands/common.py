"""Argument helpers shared by subcommands."""
import json
import os
import sys
import tempfile
from contextlib import contextmanager

from ..errors import CaffeqError


def add_model_args(p, weights=True):
    p.add_argument("model", help="deploy/train_val .prototxt (or a .caffeq file)")
    if weights:
        p.add_argument("--weights", "-w", help=".caffemodel with the trained weights")
    p.add_argument("--phase", default="TEST", choices=["TEST", "TRAIN"], help="phase rules to apply")
    p.add_argument("--stage", action="append", default=[], metavar="NAME",
                   help="a NetState stage for include/exclude rules (repeatable)")
    p.add_argument("--level", type=int, default=0, help="the NetState level for min/max_level rules")
    p.add_argument("--batch", type=int, default=None, help="override the batch dimension of the inputs")
    p.add_argument("--ignore-unknown", action="store_true",
                   help="skip fields unknown to caffe.proto (with a warning) instead of failing")


def load_model(args, random_weights=False):
    from ..model import load
    if args.batch is not None and args.batch < 1:
        raise CaffeqError(f"--batch must be >= 1, got {args.batch}")
    model = load(args.model, getattr(args, "weights", None), phase=args.phase, batch=args.batch,
                 ignore_unknown=args.ignore_unknown, random_weights=random_weights,
                 stages=tuple(getattr(args, "stage", ())), level=getattr(args, "level", 0))
    for w in model.warnings:
        print(f"caffeq: warning: {w}", file=sys.stderr)
    return model


def _plain_mode(path):
    """mkstemp creates 0600 files; outputs get the mode a plain open() would give."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


@contextmanager
def atomic_output(path, mode="wb", inputs=()):
    """Write to a temporary file beside `path`, rename on success, delete on failure."""
    path = os.fspath(path)
    target = os.path.abspath(path)
    for src in inputs:
        if src and os.path.exists(src) and os.path.exists(target) and os.path.samefile(src, target):
            raise CaffeqError(f"{path}: refusing to overwrite an input file")
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        raise CaffeqError(f"{path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".caffeq-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        _plain_mode(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextmanager
def atomic_path(path, inputs=()):
    """Like atomic_output but yields a temporary *path* for writers that open files themselves."""
    path = os.fspath(path)
    target = os.path.abspath(path)
    for src in inputs:
        if src and os.path.exists(src) and os.path.exists(target) and os.path.samefile(src, target):
            raise CaffeqError(f"{path}: refusing to overwrite an input file")
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        raise CaffeqError(f"{path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".caffeq-", suffix=os.path.splitext(path)[1] or ".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        _plain_mode(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path, obj):
    if path in (None, "-"):
        json.dump(obj, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    with atomic_output(path, "w") as f:
        json.dump(obj, f, indent=1)
