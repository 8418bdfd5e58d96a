"""`.npy` / `.npz` arrays of images (N x C x H x W, or N x H x W), labels optional.

Arrays are memory-mapped, never loaded whole: `.npy` through numpy's mmap and
the members of an uncompressed `.npz` at their offset inside the zip file
(numpy's own npz reader would decompress a member fully).
"""
import os
import struct
import zipfile

import numpy as np

from ..errors import DataError
from .base import NO_LABEL, CaffeDataset, _limited, resize_chw

DATA_KEYS = ("data", "images", "x", "inputs")
LABEL_KEYS = ("label", "labels", "y", "targets")


def _not_arrays(path, error):
    """The DataError for a file numpy cannot read as arrays; numpy's own message for a file without
    an .npy header suggests unpickling it, which caffeq never does with input files."""
    reason = "no .npy header" if "pickle" in str(error) else str(error)
    return DataError(f"{path}: not a numpy .npy/.npz file: {reason}")


def load_arrays(path):
    """An .npy file's array, or an .npz file's {name: array} (read whole, never unpickled)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DataError(f"{path}: is a folder, not an .npy/.npz file")
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise _not_arrays(path, e) from None


def net_inputs(path, model):
    """{input blob: float32 array} from an .npy (a net with one input) or an .npz by blob name,
    each the shape the net takes but for the batch."""
    arrays = load_arrays(path)
    names = list(model.inputs)
    if isinstance(arrays, np.ndarray):
        if len(names) != 1:
            raise DataError(f"{path}: the net has {len(names)} inputs {names}; pass a .npz with one array "
                            f"per input blob")
        arrays = {names[0]: arrays}
    missing = [n for n in names if n not in arrays]
    if missing:
        raise DataError(f"{path}: no array for input blob(s) {', '.join(missing)}; it holds "
                        f"{', '.join(arrays) or 'nothing'}")
    for n in names:
        want, got = model.inputs[n], arrays[n].shape
        if len(got) != len(want) or tuple(got[1:]) != tuple(want[1:]):
            raise DataError(f"{path}: '{n}' is {list(got)}; the net takes {['N'] + list(want[1:])}")
    return {n: np.asarray(arrays[n], np.float32) for n in names}


def _npz_member(path, key):
    """A memory map of one uncompressed npz member, or a loaded array when it is compressed."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(key + ".npy")
        if info.compress_type != zipfile.ZIP_STORED:
            with z.open(info) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise DataError(f"{path}: member {key}: bad zip local header")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        if dtype.hasobject:
            raise DataError(f"{path}: member {key} holds Python objects; caffeq reads numeric arrays only")
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                     order="F" if fortran else "C")


def _open_arrays(path, data_key=None):
    """-> (data array (mmap), labels array or None, data key)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: array file not found")
    try:
        if path.endswith(".npy"):
            data = np.load(path, mmap_mode="r", allow_pickle=False)
            return data, None, None
        with zipfile.ZipFile(path) as z:
            keys = [n[:-4] for n in z.namelist() if n.endswith(".npy")]
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise _not_arrays(path, e) from None
    if not keys:
        raise DataError(f"{path}: holds no arrays")
    if data_key is not None and data_key not in keys:
        data_key = None
    if data_key is None:
        data_key = next((k for k in DATA_KEYS if k in keys), None)
    label_key = next((k for k in LABEL_KEYS if k in keys), None)
    if data_key is None:
        rest = [k for k in keys if k != label_key]
        if len(rest) != 1:
            raise DataError(f"{path}: which array is the data? name it one of {list(DATA_KEYS)} "
                            f"(it holds {keys})")
        data_key = rest[0]
    try:
        data = _npz_member(path, data_key)
        labels = np.asarray(_npz_member(path, label_key)) if label_key else None
    except (ValueError, OSError, KeyError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: cannot read arrays: {e}") from None
    return data, labels, data_key


class ArrayDataset(CaffeDataset):
    """Images from a .npy/.npz (raw pixels, transformed like a Datum's)."""

    kind = "array"

    def __init__(self, path, preprocess=None, limit=None, data_key=None, resize=None):
        super().__init__(preprocess, limit)
        self.path = os.fspath(path)
        data, labels, self.data_key = _open_arrays(self.path, data_key)
        if data.ndim not in (3, 4):
            raise DataError(f"{self.path}: data of shape {list(data.shape)}; expected N x C x H x W "
                            f"or N x H x W")
        if labels is not None:
            labels = labels.reshape(labels.shape[0], -1) if labels.ndim > 1 else labels
            if labels.ndim != 1 and labels.shape[1] != 1:
                raise DataError(f"{self.path}: labels of shape {list(labels.shape)}; expected one per image")
            labels = labels.reshape(-1)
            if len(labels) != len(data):
                raise DataError(f"{self.path}: {len(labels)} labels for {len(data)} images")
            if not np.all(np.isfinite(labels)) or not np.all(labels == np.round(labels)):
                raise DataError(f"{self.path}: labels must be integers")
            labels = labels.astype(np.int64)
        self.n = _limited(len(data), limit)
        self.shape = data.shape
        self.labels = labels
        self.has_labels = labels is not None
        self.resize = resize
        self._data = data

    def __len__(self):
        return self.n

    def name(self, i):
        return f"{os.path.basename(self.path)}[{i}]"

    def load(self, i):
        img = np.array(self._data[i])            # copy out of the map
        if img.dtype != np.uint8:
            img = img.astype(np.float32)
        if img.ndim == 2:
            img = img[None]
        if self.resize:
            img = resize_chw(img, self.resize, self.name(i))
        return img, int(self.labels[i]) if self.labels is not None else NO_LABEL

    def __getstate__(self):
        # memmaps pickle as copies: reopen in the worker instead
        state = dict(self.__dict__)
        state["_data"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._data, _, _ = _open_arrays(self.path, self.data_key)
