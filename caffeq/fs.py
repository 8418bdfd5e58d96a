"""Files: writing outputs safely, finding data sources, reading numbers from small text files as C's
fscanf does, sizes in messages. Below every other caffeq module (it imports only errors).

Every writer (backends, io, sensitivity plots, the commands) goes through these, so that an output
never replaces an input file and a failed write leaves no partial file behind.
"""
import math
import os
import re
import stat
import struct
import tempfile
from contextlib import contextmanager
from decimal import Decimal
from fractions import Fraction

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


# ---- reading numbers from a small text file as C's fscanf does ------------------------------------

#: one number as strtod reads it (fscanf's %f and %lf): hex (before the decimal form, whose "0" would match
#: first), decimal, inf/infinity, nan/nan(chars)
_FLOAT = re.compile(rb"""[+-]?(?:
      0[xX](?P<hmant>[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)(?P<hexp>[pP](?P<hexpv>[+-]?[0-9]+))?
    | (?P<dec>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<dexp>[eE][+-]?[0-9]+)?
    | (?P<inf>[iI][nN][fF](?:[iI][nN][iI][tT][yY])?)
    | (?P<nan>[nN][aA][nN](?:\([0-9A-Za-z_]*\))?)
)""", re.X)
#: one number as strtol reads it in base 10 (fscanf's %d)
_INT = re.compile(rb"[+-]?[0-9]+")
#: C's isspace in the "C" locale: what fscanf skips before a number
_SPACE = b" \t\n\v\f\r"
_STARTS = b"+-.0123456789iInN"
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
CONVERSIONS = ("%f", "%lf", "%d")


def _unclear_float_end(m, after):
    """True when the byte after a strtod number could still extend it (a partial exponent, "0x", "infin",
    "nan(..."): how much fscanf then consumes, and whether it converts at all, differs between C libraries."""
    if not after:
        return False
    if m.group("dec") is not None:
        if m.group("dexp") is None and after in b"eE":
            return True
        return m.group("dec") == b"0" and after in b"xX"
    if m.group("inf") is not None:
        return len(m.group("inf")) == 3 and after in b"iI"
    if m.group("nan") is not None:
        return after == b"("
    return m.group("hexp") is None and after in b"pP"


def _exact(m):
    """The exact value of a finite strtod match, as a Fraction."""
    text = m.group(0).decode("ascii")
    sign = -1 if text.startswith("-") else 1
    if m.group("dec") is not None:
        return Fraction(Decimal(text))
    whole, _, frac = m.group("hmant").decode("ascii").partition(".")
    value = Fraction(int(whole + frac or "0", 16), 16 ** len(frac))
    return sign * value * Fraction(2) ** int(m.group("hexpv") or 0)


def _float32(x):
    """The double x rounded to the nearest float32 (ties to even), as a float; past the range: +-inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _strtof(m, double):
    """strtof's value of a finite match, rounded once from the exact number to float32.  `double` is the
    correctly rounded double (strtod's); rounding it again differs only where it lies on a float32 midpoint."""
    if double == 0 or math.isinf(double):
        return _float32(double)
    e = math.frexp(abs(double))[1] - 1                      # 2**e <= |double| < 2**(e + 1)
    half_ulp_exp = max(e, -126) - 24                        # float32 spacing there, halved
    t = math.ldexp(abs(double), -half_ulp_exp)
    if t != int(t) or int(t) % 2 == 0:                      # not a midpoint: one rounding is enough
        return _float32(double)
    exact = abs(_exact(m))
    mid = Fraction(abs(double))
    if exact == mid:
        return _float32(double)                             # a true tie: to even, as the cast does
    away = math.ldexp(int(t) + 1, half_ulp_exp) if exact > mid else math.ldexp(int(t) - 1, half_ulp_exp)
    return math.copysign(_float32(away) if away < 2.0 ** 128 else math.inf, double)


def _float_value(m, single):
    if m.group("nan") is not None:
        return math.nan
    text = m.group(0).decode("ascii")
    if m.group("dec") is None and m.group("inf") is None:
        double = float.fromhex(text)
    else:
        double = float(text)
    return _strtof(m, double) if single else double


def fscanf_numbers(data, conversion, what, count=None, truncated=False, error=CaffeqError):
    """The numbers that calls of fscanf(f, conversion, &x) read from the bytes `data`, conversion "%f"
    (strtof: each value rounded once to float32, returned as the float of that value), "%lf" (strtod:
    doubles) or "%d" (strtol in base 10, into an int).  Each call skips C white space and reads the longest
    number there ("1-2" gives 1 and -2, "1.5" under %d gives 1 and then a stop); the first word that does not
    start one ends the reading, as the forks' `while (fscanf(...) > 0)` loops end.  count: stop after that
    many (fewer are returned where the reading ends first).
    truncated: `data` is the head of a longer file; a number, or the white space before it, that reaches
    its end may go on past it: error.  Also error(f"{what}: ...", one line) where C libraries differ:
    a float followed by what could extend it ("1e", "0x", "infin", "nan("), an int outside 32 bits."""
    if conversion not in CONVERSIONS:
        raise ValueError(f"conversion must be one of {CONVERSIONS}, got {conversion!r}")
    pattern = _INT if conversion == "%d" else _FLOAT
    values, pos, end = [], 0, len(data)
    past_head = f"{what}: its numbers are not within its first {end} bytes, all caffeq reads"
    while count is None or len(values) < count:
        while pos < end and data[pos] in _SPACE:
            pos += 1
        if pos == end:
            if truncated:
                raise error(past_head)
            break
        m = pattern.match(data, pos)
        if m is None:
            rest = data[pos:]
            if truncated and rest[:1] in _STARTS and not any(b in _SPACE for b in rest):
                raise error(past_head)
            break
        if truncated and m.end() == end:
            raise error(past_head)
        if conversion == "%d":
            value = int(m.group(0))
            if not _INT_MIN <= value <= _INT_MAX:
                raise error(f"{what}: the integer at byte {pos} is outside int's 32 bits; what fscanf(\"%d\") "
                            f"stores then differs between C libraries")
        else:
            after = data[m.end():m.end() + 1]
            if _unclear_float_end(m, after):
                raise error(f"{what}: the number at byte {pos} is followed by '{after.decode('latin-1')}'; how far "
                            f"fscanf reads it differs between C libraries")
            value = _float_value(m, conversion == "%f")
        values.append(value)
        pos = m.end()
    return values


def read_file_head(path, max_bytes, what, error=CaffeqError, whole=False):
    """(the first max_bytes bytes of the regular file `path`, whether the file goes on past them), or None
    where nothing is at `path` (opened as given: a relative path from the current folder, as fopen).
    Opened without blocking and checked before any read: a FIFO, device or folder is refused; at most
    max_bytes + 1 bytes are read.  whole: a file of more than max_bytes is refused before any read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    except OSError as e:
        raise error(f"{what}: cannot open it: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what}: not a regular file (fopen would read a folder, device or pipe)")
        if whole and st.st_size > max_bytes:
            raise error(f"{what}: {st.st_size} bytes, past the {max_bytes} caffeq reads")
        chunks, got = [], 0
        while got <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise error(f"{what}: cannot read it: {e.strerror}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if whole and len(data) > max_bytes:             # grew since the fstat
        raise error(f"{what}: more than {max_bytes} bytes, past the {max_bytes} caffeq reads")
    return data[:max_bytes], len(data) > max_bytes


def read_text_numbers(path, conversion, max_bytes, what, error=CaffeqError, count=None):
    """The numbers fscanf(f, conversion) calls read from the small text file `path` (fscanf_numbers), or
    None where nothing is there.  Without count, every number up to the first word that is not one, from
    a file of at most max_bytes (a larger one is refused unread); with count, the first `count`, which must
    lie within the file's first max_bytes.  Errors are error(f"{what}: ..."), one line."""
    head = read_file_head(path, max_bytes, what, error, whole=count is None)
    if head is None:
        return None
    data, truncated = head
    return fscanf_numbers(data, conversion, what, count, truncated, error)


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
