"""Datasets (Caffe LMDB / LevelDB, HDF5Data files, ImageData lists, image folders, arrays) and
Caffe's transforms.

Every dataset is a torch map-style Dataset that reads one item at a time
(nothing is loaded whole), so a DataLoader with worker processes streams it.
"""
import os

from ..errors import DataError
from .arrays import ArrayDataset
from .base import NO_LABEL, CaffeDataset, Collate, Preprocess, StridedSampler, StringTable, resize_chw, worker_init
from .hdf5_source import H5_SUFFIXES, Hdf5Dataset, looks_like_h5_list
from .images import ImageFolderDataset, ImageListDataset, read_image
from .leveldb_source import LeveldbDataset, is_leveldb
from .lmdb_source import LmdbDataset
from .transform import CaffeRNG, DataTransformer, Normalizer, load_mean_file

KINDS = ("lmdb", "leveldb", "hdf5", "image_list", "image_folder", "array")


def detect_kind(path):
    """What a data source is, from the file system: one of KINDS."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: data source not found")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "data.mdb")):
            return "lmdb"
        if is_leveldb(path):
            return "leveldb"
        if any(e.is_dir() for e in os.scandir(path)):
            return "image_folder"
        raise DataError(f"{path}: a folder that is neither an LMDB (data.mdb) or LevelDB (CURRENT) "
                        f"database nor an image folder (one subfolder per class)")
    low = path.lower()
    if low.endswith((".npy", ".npz")):
        return "array"
    if low.endswith(".mdb"):
        return "lmdb"
    if low.endswith(H5_SUFFIXES) or looks_like_h5_list(path):
        return "hdf5"
    with open(path, "rb") as f:
        head = f.read(4096)
    if b"\x00" in head:
        raise DataError(f"{path}: a binary file that is not .npy/.npz or LMDB; expected an ImageData "
                        f"list (path label per line)")
    return "image_list"


def open_dataset(source, kind=None, preprocess=None, limit=None, *, root_folder="", new_height=0,
                 new_width=0, is_color=True, force_color=False, force_gray=False, resize=None,
                 base_dir=None, tops=("data", None)):
    """A dataset for a source path.

    kind: one of KINDS (detected when None).  is_color applies to image files
    (ImageData's is_color); force_color/force_gray to encoded LMDB records
    (transform_param).  resize=(height, width): OpenCV bilinear, as ImageData's
    new_height/new_width (which take precedence for lists).  tops=(data, label): the
    dataset names read from HDF5 files (label None: "label" when present).
    """
    kind = kind or detect_kind(source)
    if kind == "lmdb":
        return LmdbDataset(source, preprocess, limit, force_color=force_color, force_gray=force_gray,
                           resize=resize)
    if kind == "leveldb":
        return LeveldbDataset(source, preprocess, limit, force_color=force_color, force_gray=force_gray,
                              resize=resize)
    if kind == "hdf5":
        data_name, label_name = tops
        return Hdf5Dataset(source, data_name, label_name, preprocess, limit,
                           roots=(base_dir,) if base_dir else ())
    if kind == "image_list":
        nh, nw = (new_height, new_width) if new_height or new_width else (resize or (0, 0))
        return ImageListDataset(source, preprocess, root_folder=root_folder, new_height=nh, new_width=nw,
                                is_color=is_color, base_dir=base_dir, limit=limit)
    if kind == "image_folder":
        return ImageFolderDataset(source, preprocess, is_color=is_color, resize=resize, limit=limit)
    if kind == "array":
        return ArrayDataset(source, preprocess, limit, resize=resize)
    raise DataError(f"unknown data kind {kind!r}; expected one of {', '.join(KINDS)}")


def datum_shape(path, backend="LMDB"):
    """C x H x W of the first Datum of a Data layer's database (LMDB or LEVELDB)."""
    if str(backend).upper() == "LEVELDB":
        from .leveldb_source import first_datum_shape
    else:
        from .lmdb_source import first_datum_shape
    return first_datum_shape(path)


__all__ = [
    "KINDS",
    "NO_LABEL",
    "ArrayDataset",
    "CaffeDataset",
    "CaffeRNG",
    "Collate",
    "DataTransformer",
    "Hdf5Dataset",
    "ImageFolderDataset",
    "ImageListDataset",
    "LeveldbDataset",
    "LmdbDataset",
    "Normalizer",
    "Preprocess",
    "StridedSampler",
    "StringTable",
    "datum_shape",
    "detect_kind",
    "load_mean_file",
    "open_dataset",
    "read_image",
    "resize_chw",
    "worker_init",
]
