"""Caffe LMDB databases of Datum records."""
import os

import numpy as np

from ..errors import DataError
from ..io.schema import caffe_pb2


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


def parse_datum(raw, where="datum"):
    d = caffe_pb2.Datum()
    try:
        d.ParseFromString(raw)
    except Exception as e:
        raise DataError(f"{where}: not a Caffe Datum: {e}") from None
    return d


def decode_datum(d, where="datum"):
    """Datum -> (CHW float32 array as Caffe's DataTransformer sees it, label)."""
    if d.encoded:
        from .images import decode_image_bytes
        img = decode_image_bytes(d.data, where)
        return img, int(d.label)
    c, h, w = d.channels, d.height, d.width
    if d.data:
        arr = np.frombuffer(d.data, dtype=np.uint8)
    else:
        arr = np.asarray(d.float_data, dtype=np.float32)
    if arr.size != c * h * w:
        raise DataError(f"{where}: {arr.size} values for a {c}x{h}x{w} datum")
    return arr.reshape(c, h, w).astype(np.float32), int(d.label)


def first_datum_shape(path):
    env = open_lmdb(path)
    try:
        with env.begin() as txn:
            cur = txn.cursor()
            if not cur.first():
                raise DataError(f"{path}: the LMDB database is empty")
            d = parse_datum(cur.value(), f"{path}: first record")
    finally:
        env.close()
    if d.encoded:
        img, _ = decode_datum(d, f"{path}: first record")
        return img.shape
    return (d.channels, d.height, d.width)
