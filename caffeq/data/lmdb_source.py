"""Caffe LMDB databases of Datum records."""
import os

import numpy as np

from ..errors import DataError
from ..io.schema import caffe_pb2
from .base import CaffeDataset, StringTable


def open_lmdb(path):
    try:
        import lmdb
    except ImportError:
        raise DataError("reading LMDB data needs the lmdb package (pip install 'caffeq[data]')") from None
    if not os.path.exists(path):
        raise DataError(f"{path}: no such LMDB database")
    try:
        return lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False,
                         subdir=os.path.isdir(path))
    except lmdb.Error as e:
        raise DataError(f"{path}: not an LMDB database: {e}") from None


# One environment per database and process: py-lmdb refuses a second open of a path in one
# process, and a forked child inherits its parent's "open" mark.
_ENVS = {}   # realpath -> (pid, env)


def shared_env(path):
    """The process's environment for `path` (opened on first use, kept open)."""
    key = os.path.realpath(path)
    got = _ENVS.get(key)
    if got is not None and got[0] == os.getpid():
        return got[1]
    try:
        env = open_lmdb(path)
    except DataError as e:
        if got is None or "already open" not in str(e):
            raise
        # forked from a process that still holds it: read-only and lock-free, the inherited
        # map stays valid for reading
        env = got[1]
    _ENVS[key] = (os.getpid(), env)
    return env


def close_env(path=None):
    """Close this process's environment(s) (before forking worker processes)."""
    keys = [os.path.realpath(path)] if path is not None else list(_ENVS)
    for key in keys:
        got = _ENVS.pop(key, None)
        if got is not None and got[0] == os.getpid():
            got[1].close()


def parse_datum(raw, where="datum"):
    from google.protobuf.message import DecodeError
    d = caffe_pb2.Datum()
    try:
        d.ParseFromString(raw)
    except (DecodeError, ValueError, TypeError) as e:
        raise DataError(f"{where}: not a Caffe Datum: {e}") from None
    return d


def decode_datum(d, where="datum", dtype=np.float32, is_color=None):
    """Datum -> (C x H x W array as Caffe's DataTransformer sees it, label).

    Encoded datums decode as Caffe's DecodeDatumToCVMatNative (the file's own
    channels) unless is_color is True/False (force_color / force_gray).
    dtype=None keeps uint8 pixels as uint8 (float_data stays float32).
    """
    if d.encoded:
        from .images import decode_image_bytes
        img = decode_image_bytes(d.data, where, is_color=is_color)
    else:
        c, h, w = d.channels, d.height, d.width
        if c <= 0 or h <= 0 or w <= 0:
            raise DataError(f"{where}: datum has shape {c}x{h}x{w}")
        if d.data:
            arr = np.frombuffer(d.data, dtype=np.uint8)
        else:
            arr = np.asarray(d.float_data, dtype=np.float32)
        if arr.size != c * h * w:
            raise DataError(f"{where}: {arr.size} values for a {c}x{h}x{w} datum")
        img = arr.reshape(c, h, w)
    if dtype is not None:
        img = img.astype(dtype)
    return img, int(d.label)


def first_datum_shape(path):
    with shared_env(path).begin() as txn:
        cur = txn.cursor()
        if not cur.first():
            raise DataError(f"{path}: the LMDB database is empty")
        d = parse_datum(cur.value(), f"{path}: first record")
    if d.encoded:
        img, _ = decode_datum(d, f"{path}: first record", dtype=None)
        return img.shape
    return (d.channels, d.height, d.width)


def scan_keys(path, limit=None):
    """The keys in cursor order (the order Caffe's Data layer reads), up to limit."""
    keys = []
    with shared_env(path).begin() as txn:
        for key in txn.cursor().iternext(keys=True, values=False):
            if limit is not None and len(keys) >= limit:
                break
            keys.append(key)
    return keys


class LmdbDataset(CaffeDataset):
    """A Caffe Data-layer LMDB, read record by record.

    Only the keys are read up front (to index the records); each worker
    process opens its own environment on first use.
    """

    kind = "lmdb"

    def __init__(self, path, preprocess=None, limit=None, force_color=False, force_gray=False, resize=None):
        super().__init__(preprocess, limit)
        self.path = os.fspath(path)
        self.keys = StringTable(scan_keys(self.path, limit))
        self.is_color = True if force_color else (False if force_gray else None)
        self.resize = resize

    def __len__(self):
        return len(self.keys)

    def name(self, i):
        return f"{self.path}[{self.keys[i]}]"

    def _environment(self):
        return shared_env(self.path)

    def close(self):
        close_env(self.path)

    def _decode(self, raw, i):
        where = self.name(i)
        if raw is None:
            raise DataError(f"{where}: record vanished from the database")
        img, label = decode_datum(parse_datum(raw, where), where, dtype=None, is_color=self.is_color)
        if self.resize:
            from .base import resize_chw
            img = resize_chw(img, self.resize, where)
        return img, label

    def load(self, i):
        with self._environment().begin(buffers=False) as txn:
            return self._decode(txn.get(self.keys.raw(i)), i)

    def __getitems__(self, indices):
        # one read transaction per batch
        with self._environment().begin(buffers=False) as txn:
            return [self.make_item(i, lambda i: self._decode(txn.get(self.keys.raw(i)), i))
                    for i in indices]
