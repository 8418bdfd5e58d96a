"""Caffe LevelDB databases of Datum records (Data layers with `backend: LEVELDB`).

Read through plyvel (extra `data`). LevelDB lets one process at a time open a
database (it holds a LOCK file), so a LevelDB dataset is read in the main
process: `single_process` tells the evaluation to use no worker processes.
"""
import os

from ..errors import DataError
from .base import StringTable
from .lmdb_source import LmdbDataset, decode_datum, parse_datum


def is_leveldb(path):
    """A folder with LevelDB's CURRENT file and its table / log files."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "CURRENT")) and any(
        n.endswith((".ldb", ".log", ".sst")) for n in os.listdir(path))


def _plyvel():
    try:
        import plyvel
    except ImportError:
        raise DataError("reading LevelDB data needs the plyvel package (pip install 'caffeq[data]')") from None
    return plyvel


def open_leveldb(path):
    plyvel = _plyvel()
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such LevelDB database")
    try:
        # Caffe writes with LevelDB's default bytewise comparator; never create or repair
        return plyvel.DB(path, create_if_missing=False)
    except plyvel.Error as e:
        hint = " (another process holds it: LevelDB allows one reader process)" if "lock" in str(e).lower() else ""
        raise DataError(f"{path}: cannot open the LevelDB database: {e}{hint}") from None


_DBS = {}   # realpath -> (pid, db)


def shared_db(path):
    """This process's handle on the database at `path` (opened on first use, kept open)."""
    key = os.path.realpath(path)
    got = _DBS.get(key)
    if got is not None and got[0] == os.getpid():
        return got[1]
    db = open_leveldb(path)
    _DBS[key] = (os.getpid(), db)
    return db


def close_db(path=None):
    """Close this process's handle(s), releasing LevelDB's lock."""
    keys = [os.path.realpath(path)] if path is not None else list(_DBS)
    for key in keys:
        got = _DBS.pop(key, None)
        if got is not None and got[0] == os.getpid():
            got[1].close()


def first_datum_shape(path):
    """C x H x W of the first record, as Caffe's Data layer reads it to shape its top."""
    db = shared_db(path)
    with db.iterator() as it:
        first = next(it, None)
    if first is None:
        raise DataError(f"{path}: the LevelDB database is empty")
    d = parse_datum(first[1], f"{path}: first record")
    if d.encoded:
        img, _ = decode_datum(d, f"{path}: first record", dtype=None)
        return img.shape
    return (d.channels, d.height, d.width)


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

    def __init__(self, path, preprocess=None, limit=None, force_color=False, force_gray=False, resize=None):
        super(LmdbDataset, self).__init__(preprocess, limit)
        self.path = os.fspath(path)
        self.keys = StringTable(scan_keys(self.path, limit))
        self.is_color = True if force_color else (False if force_gray else None)
        self.resize = resize

    def close(self):
        close_db(self.path)

    def load(self, i):
        return self._decode(shared_db(self.path).get(self.keys.raw(i)), i)

    def __getitems__(self, indices):
        db = shared_db(self.path)
        return [self.make_item(i, lambda i: self._decode(db.get(self.keys.raw(i)), i)) for i in indices]
