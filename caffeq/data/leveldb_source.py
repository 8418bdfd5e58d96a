"""Caffe LevelDB databases of Datum records (Data layers with `backend: LEVELDB`).

Read through plyvel (extra `data`). LevelDB lets one process at a time open a
database (it holds a LOCK file), so a LevelDB dataset is read in the main
process: `single_process` tells the evaluation to use no worker processes.
"""
import os

from ..errors import DataError
from .base import ProcessHandles, optional_module
from .lmdb_source import LmdbDataset, record_shape


def is_leveldb(path):
    """A folder with LevelDB's CURRENT file and its table / log files."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "CURRENT")) and any(
        n.endswith((".ldb", ".log", ".sst")) for n in os.listdir(path))


def open_leveldb(path):
    plyvel = optional_module("plyvel", "LevelDB")
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such LevelDB database")
    try:
        # Caffe writes with LevelDB's default bytewise comparator; never create or repair
        return plyvel.DB(path, create_if_missing=False)
    except plyvel.Error as e:
        hint = " (another process holds it: LevelDB allows one reader process)" if "lock" in str(e).lower() else ""
        raise DataError(f"{path}: cannot open the LevelDB database: {e}{hint}") from None


# This process's handle on each database (opened on first use, kept open); close_db releases
# LevelDB's lock.
_DBS = ProcessHandles(lambda path, _inherited: open_leveldb(path))
shared_db = _DBS.get
close_db = _DBS.close


def first_datum_shape(path):
    """C x H x W of the first record, as Caffe's Data layer reads it to shape its top."""
    with _DBS.borrowed(path) as db, db.iterator() as it:
        first = next(it, None)
    if first is None:
        raise DataError(f"{path}: the LevelDB database is empty")
    return record_shape(first[1], f"{path}: first record")


def scan_keys(path, limit=None):
    """The keys in iteration (key) order, the order Caffe's Data layer reads, up to limit."""
    keys = []
    with shared_db(path).iterator(include_value=False) as it:
        for key in it:
            if limit is not None and len(keys) >= limit:
                break
            keys.append(key)
    return keys


class LeveldbDataset(LmdbDataset):
    """A Caffe Data-layer LevelDB, read record by record (keys indexed up front)."""

    kind = "leveldb"
    single_process = True
    scan_keys = staticmethod(scan_keys)

    def close(self):
        close_db(self.path)

    def load(self, i):
        return self._decode(shared_db(self.path).get(self.keys.raw(i)), i)

    def __getitems__(self, indices):
        db = shared_db(self.path)
        return [self.make_item(i, lambda i: self._decode(db.get(self.keys.raw(i)), i)) for i in indices]
