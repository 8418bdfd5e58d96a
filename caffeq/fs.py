"""Writing output files safely: below every other caffeq module (it imports only errors).

Every writer (backends, io, sensitivity plots, the commands) goes through these, so that an output
never replaces an input file and a failed write leaves no partial file behind.
"""
import os
import tempfile
from contextlib import contextmanager

from .errors import CaffeqError

INPUT_CLASH = "refusing to overwrite an input file"


def same_file(a, b):
    """True when paths a and b name one file (the same path, or both exist and are one file)."""
    if not a or not b:
        return False
    a, b = os.path.abspath(os.fspath(a)), os.path.abspath(os.fspath(b))
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def refuse_overwrite(target, inputs, error=CaffeqError, message=INPUT_CLASH):
    """Raise error(f"{target}: {message}") when `target` is one of the files in `inputs`.

    Only files that exist count (a new output cannot be an input), as os.path.samefile decides.
    """
    if not target:
        return
    for src in inputs:
        if src and os.path.exists(src) and os.path.exists(target) and os.path.samefile(src, target):
            raise error(f"{target}: {message}")


def resolve_source(path, base_dir):
    """A data path as Caffe users write it: relative to the prototxt's folder, then the cwd."""
    if os.path.isabs(path):
        return path
    for root in (base_dir, os.getcwd()):
        cand = os.path.join(root or "", path)
        if os.path.exists(cand):
            return cand
    return os.path.join(base_dir or "", path)


def _plain_mode(path):
    """mkstemp creates 0600 files; outputs get the mode a plain open() would give."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


@contextmanager
def atomic_path(path, inputs=()):
    """Yield a temporary path beside `path`; rename it onto `path` on success, delete it on failure.

    For writers that open files themselves. inputs: files that `path` must not be.
    """
    path = os.fspath(path)
    target = os.path.abspath(path)
    refuse_overwrite(path, inputs)
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


@contextmanager
def atomic_output(path, mode="wb", inputs=()):
    """atomic_path, yielding the temporary file opened in `mode`."""
    # the file is closed before atomic_path renames (or deletes) it
    with atomic_path(path, inputs) as tmp, open(tmp, mode) as f:
        yield f
