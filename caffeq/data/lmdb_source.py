"""Caffe LMDB databases of Datum records."""
import os

import numpy as np

from ..errors import DataError
from ..io.schema import caffe_pb2
from .base import CaffeDataset, ProcessHandles, StringTable, optional_module


def open_lmdb(path):
    lmdb = optional_module("lmdb", "LMDB")
    if not os.path.exists(path):
        raise DataError(f"{path}: no such LMDB database")
    try:
        return lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False,
                         subdir=os.path.isdir(path))
    except lmdb.Error as e:
        raise DataError(f"{path}: not an LMDB database: {e}") from None


def _open_env(path, inherited):
    try:
        return open_lmdb(path)
    except DataError as e:
        if inherited is None or "already open" not in str(e):
            raise
        # forked from a process that still holds it: read-only and lock-free, the inherited
        # map stays valid for reading
        return inherited


# One environment per database and process: py-lmdb refuses a second open of a path in one
# process, and a forked child inherits its parent's "open" mark.
_ENVS = ProcessHandles(_open_env)
shared_env = _ENVS.get
close_env = _ENVS.close     # before forking worker processes


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
    with _ENVS.borrowed(path) as env, env.begin() as txn:
        cur = txn.cursor()
        if not cur.first():
            raise DataError(f"{path}: the LMDB database is empty")
        return record_shape(cur.value(), f"{path}: first record")


def record_shape(raw, where):
    """C x H x W of a stored Datum, as Caffe's Data layer reads its first record to shape its top."""
    d = parse_datum(raw, where)
    if d.encoded:
        img, _ = decode_datum(d, where, dtype=None)
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
    scan_keys = staticmethod(scan_keys)

    def __init__(self, path, preprocess=None, limit=None, force_color=False, force_gray=False, resize=None):
        super().__init__(preprocess, limit)
        self.path = os.fspath(path)
        self.keys = StringTable(self.scan_keys(self.path, limit))
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
