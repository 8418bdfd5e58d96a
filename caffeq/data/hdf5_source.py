"""HDF5 data as Caffe's HDF5Data layer reads it (through h5py, extra `data`).

The layer's `source` is a text file listing .h5 files, one per line; each file
holds one dataset per top, named like the top, with the items along the first
axis. Caffe reads the values as float and applies no transform_param.
A single .h5 file is accepted in place of the list.
"""
import os

import numpy as np

from ..errors import DataError
from .base import NO_LABEL, CaffeDataset, _limited, optional_module

H5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")


def _h5py():
    return optional_module("h5py", "HDF5")


def looks_like_h5_list(path):
    """A text file whose first entry names an HDF5 file (HDF5Data's source list)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if b"\x00" in head:
        return False
    first = next((ln.strip() for ln in head.decode("utf-8", "replace").splitlines() if ln.strip()), "")
    return first.lower().endswith(H5_SUFFIXES)


def list_h5_files(source, roots=()):
    """The .h5 files of an HDF5Data source: the file itself, or the files its list names.

    Caffe opens listed names as written (from its working directory); a name that
    does not exist there is also looked up beside the list and in `roots`.
    """
    source = os.fspath(source)
    if not os.path.exists(source):
        raise DataError(f"{source}: no such HDF5 file or list")
    if source.lower().endswith(H5_SUFFIXES):
        return [source]
    try:
        with open(source, encoding="utf-8") as f:
            names = [ln.strip() for ln in f if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{source}: cannot read the HDF5 file list: {e}") from None
    if not names:
        raise DataError(f"{source}: the HDF5 file list names no files")
    files = []
    for name in names:
        cands = [name] if os.path.isabs(name) else \
            [name] + [os.path.join(r, name) for r in (os.path.dirname(source), *roots) if r]
        found = next((c for c in cands if os.path.exists(c)), None)
        if found is None:
            raise DataError(f"{source}: listed file '{name}' not found (looked in {os.getcwd()}, "
                            f"{os.path.dirname(source) or '.'}{''.join(', ' + r for r in roots if r)})")
        files.append(found)
    return files


def _label_width(shape):
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


class Hdf5Dataset(CaffeDataset):
    """Items of the HDF5Data files: the `data_name` dataset's rows, labels from `label_name`.

    label_name None: the "label" dataset when the files have one, else no labels.
    Only the shapes are read up front; each process opens the files on first use.
    """

    kind = "hdf5"

    def __init__(self, source, data_name="data", label_name=None, preprocess=None, limit=None, roots=()):
        super().__init__(preprocess, limit)
        h5py = _h5py()
        self.source = os.fspath(source)
        self.files = list_h5_files(self.source, roots)
        self.data_name = data_name
        self.label_name = label_name
        counts, item_shape = [], None
        for path in self.files:
            try:
                with h5py.File(path, "r") as h5:
                    n, shape = self._check_file(h5, path)
            except OSError as e:
                raise DataError(f"{path}: not a readable HDF5 file: {e}") from None
            if item_shape is not None and shape != item_shape:
                raise DataError(f"{path}: '{data_name}' items are {list(shape)}, those of "
                                f"{self.files[0]} are {list(item_shape)} (HDF5Data needs one shape)")
            item_shape = shape
            counts.append(n)
        self.item_shape = item_shape
        self.ends = np.cumsum(counts, dtype=np.int64)
        self.n = _limited(int(self.ends[-1]), limit)
        self.has_labels = self.label_name is not None
        self._open = {}       # path -> (pid, h5py.File)

    def _check_file(self, h5, path):
        if self.data_name not in h5:
            raise DataError(f"{path}: no dataset '{self.data_name}' (the data top's name); it has "
                            f"{sorted(h5.keys())}")
        data = h5[self.data_name]
        if not hasattr(data, "shape") or len(data.shape) < 1:
            raise DataError(f"{path}: '{self.data_name}' is not an array with items along its first axis")
        n = int(data.shape[0])
        if self.label_name is None and "label" in h5 and self.data_name != "label":
            self.label_name = "label"
        if self.label_name is not None:
            if self.label_name not in h5:
                raise DataError(f"{path}: no dataset '{self.label_name}' (the label top's name); it has "
                                f"{sorted(h5.keys())}")
            label = h5[self.label_name]
            if len(label.shape) < 1 or int(label.shape[0]) != n:
                raise DataError(f"{path}: '{self.label_name}' has {list(label.shape)[:1]} items, "
                                f"'{self.data_name}' has {n}")
            if _label_width(label.shape) != 1:
                raise DataError(f"{path}: '{self.label_name}' holds {list(label.shape[1:])} values per "
                                f"item; evaluation takes one class label per item")
        return n, tuple(int(d) for d in data.shape[1:])

    def __len__(self):
        return self.n

    def _locate(self, i):
        f = int(np.searchsorted(self.ends, i, side="right"))
        start = int(self.ends[f - 1]) if f else 0
        return f, i - start

    def name(self, i):
        f, row = self._locate(i)
        return f"{self.files[f]}[{row}]"

    def _file(self, path):
        got = self._open.get(path)
        if got is not None and got[0] == os.getpid():
            return got[1]
        h5 = _h5py().File(path, "r")
        self._open[path] = (os.getpid(), h5)
        return h5

    def close(self):
        for path, (pid, h5) in list(self._open.items()):
            if pid == os.getpid():
                h5.close()
        self._open.clear()

    def load(self, i):
        f, row = self._locate(i)
        h5 = self._file(self.files[f])
        img = np.asarray(h5[self.data_name][row], dtype=np.float32)   # Caffe reads HDF5 as float
        if self.label_name is None:
            return img, NO_LABEL
        value = float(np.asarray(h5[self.label_name][row]).reshape(-1)[0])
        if not np.isfinite(value):
            raise DataError(f"label {value} is not a number")
        return img, int(value)    # Caffe's loss and accuracy layers cast the float label to int

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"] = {}       # h5py handles do not cross processes
        return state

    def describe(self):
        d = super().describe()
        d.update(files=len(self.files), dataset=self.data_name, item_shape=list(self.item_shape))
        return d
