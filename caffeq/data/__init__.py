"""Datasets (Caffe LMDB, ImageData lists, image folders, arrays) and Caffe's transforms.

Every dataset is a torch map-style Dataset that reads one item at a time
(nothing is loaded whole), so a DataLoader with worker processes streams it.
"""
import os

from ..errors import DataError
from .arrays import ArrayDataset
from .base import (
    NO_LABEL,
    CaffeDataset,
    Collate,
    Preprocess,
    StridedSampler,
    StringTable,
    resize_chw,
    worker_init,
)
from .images import ImageFolderDataset, ImageListDataset, read_image
from .lmdb_source import LmdbDataset
from .transform import CaffeRNG, DataTransformer, Normalizer, load_mean_file

KINDS = ("lmdb", "image_list", "image_folder", "array")


def detect_kind(path):
    """What a data source is, from the file system: lmdb, image_list, image_folder or array."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: data source not found")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "data.mdb")):
            return "lmdb"
        if os.path.exists(os.path.join(path, "CURRENT")) and any(
                n.endswith((".ldb", ".log")) for n in os.listdir(path)):
            raise DataError(f"{path}: a LevelDB database; caffeq reads LMDB (convert it with Caffe's "
                            f"convert_imageset -backend lmdb)")
        if any(e.is_dir() for e in os.scandir(path)):
            return "image_folder"
        raise DataError(f"{path}: a folder that is neither an LMDB database (data.mdb) nor an image "
                        f"folder (one subfolder per class)")
    low = path.lower()
    if low.endswith((".npy", ".npz")):
        return "array"
    if low.endswith(".mdb"):
        return "lmdb"
    with open(path, "rb") as f:
        head = f.read(4096)
    if b"\x00" in head:
        raise DataError(f"{path}: a binary file that is not .npy/.npz or LMDB; expected an ImageData "
                        f"list (path label per line)")
    return "image_list"


def open_dataset(source, kind=None, preprocess=None, limit=None, *, root_folder="", new_height=0,
                 new_width=0, is_color=True, force_color=False, force_gray=False, resize=None,
                 base_dir=None):
    """A dataset for a source path.

    kind: one of KINDS (detected when None).  is_color applies to image files
    (ImageData's is_color); force_color/force_gray to encoded LMDB records
    (transform_param).  resize=(height, width): OpenCV bilinear, as ImageData's
    new_height/new_width (which take precedence for lists).
    """
    kind = kind or detect_kind(source)
    if kind == "lmdb":
        return LmdbDataset(source, preprocess, limit, force_color=force_color, force_gray=force_gray,
                           resize=resize)
    if kind == "image_list":
        nh, nw = (new_height, new_width) if new_height or new_width else (resize or (0, 0))
        return ImageListDataset(source, preprocess, root_folder=root_folder, new_height=nh, new_width=nw,
                                is_color=is_color, base_dir=base_dir, limit=limit)
    if kind == "image_folder":
        return ImageFolderDataset(source, preprocess, is_color=is_color, resize=resize, limit=limit)
    if kind == "array":
        return ArrayDataset(source, preprocess, limit, resize=resize)
    raise DataError(f"unknown data kind {kind!r}; expected one of {', '.join(KINDS)}")


__all__ = [
    "KINDS",
    "NO_LABEL",
    "ArrayDataset",
    "CaffeDataset",
    "CaffeRNG",
    "Collate",
    "DataTransformer",
    "ImageFolderDataset",
    "ImageListDataset",
    "LmdbDataset",
    "Normalizer",
    "Preprocess",
    "StridedSampler",
    "StringTable",
    "detect_kind",
    "load_mean_file",
    "open_dataset",
    "read_image",
    "resize_chw",
    "worker_init",
]
