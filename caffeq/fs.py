"""Files: writing outputs safely, finding data sources, sizes in messages. Below every other caffeq
module (it imports only errors).

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


def read_text_numbers(path, kind, max_bytes, too_big, error=CaffeqError):
    """The numbers of a text file as C's fscanf reads them one by one (kind int or float), up to the first
    word that is not one; a file past max_bytes raises error(too_big(size)) before it is read."""
    size = os.path.getsize(path)
    if size > max_bytes:
        raise error(too_big(size))
    with open(path, "rb") as f:
        words = f.read().split()
    values = []
    for word in words:
        try:
            values.append(kind(word))
        except ValueError:
            break
    return values


def resolve_source(path, base_dir):
    """A data path as Caffe users write it: relative to the prototxt's folder, then the cwd.  An empty
    path (a train file whose sources were blanked) names nothing: "" (which does not exist)."""
    if not path.strip():
        return ""
    if os.path.isabs(path):
        return path
    for root in (base_dir, os.getcwd()):
        cand = os.path.join(root or "", path)
        if os.path.exists(cand):
            return cand
    return os.path.join(base_dir or "", path)


def _make_folders(folder):
    """Create `folder` and its missing parents -> the folders created, deepest first."""
    created = []
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    for d in reversed(created):
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        except OSError as e:
            raise CaffeqError(f"cannot create folder {d}: {e.strerror}") from None
    return created


def _remove_folders(created):
    for d in created:            # deepest first; only folders left empty
        try:
            os.rmdir(d)
        except OSError:
            break


def _plain_mode(path):
    """mkstemp creates 0600 files; outputs get the mode a plain open() would give."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


@contextmanager
def atomic_path(path, inputs=()):
    """Yield a temporary path beside `path`; rename it onto `path` on success, delete it on failure.

    For writers that open files themselves. inputs: files that `path` must not be. Missing
    folders are created, and removed again on failure.
    """
    path = os.fspath(path)
    target = os.path.abspath(path)
    refuse_overwrite(path, inputs)
    if os.path.isdir(target):
        raise CaffeqError(f"{path}: is a folder; name a file")
    folder = os.path.dirname(target) or "."
    created = _make_folders(folder)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".caffeq-", suffix=os.path.splitext(path)[1] or ".tmp", dir=folder)
    except OSError as e:
        _remove_folders(created)
        raise CaffeqError(f"{path}: cannot write in {folder}: {e.strerror}") from None
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
        _remove_folders(created)
        raise


@contextmanager
def atomic_output(path, mode="wb", inputs=()):
    """atomic_path, yielding the temporary file opened in `mode`."""
    # the file is closed before atomic_path renames (or deletes) it
    with atomic_path(path, inputs) as tmp, open(tmp, mode) as f:
        yield f


def format_bytes(n):
    """Decimal units, one style everywhere: 950 B, 9.02 kB, 150.10 kB, 1.20 MB."""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n):
    """A count as every report prints it: 38,428."""
    return f"{int(n):,}"
