"""What every dataset shares: compact string tables, Caffe's per-image pipeline, batching, sharding.

A dataset item is a tuple `(index, array or None, label, error or None)`:
decoding problems become an error message for that one item (the evaluation
counts and lists them) instead of an exception in a worker process.
"""
import contextlib
import importlib
import math
import os

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from ..errors import CaffeqError, DataError
from .transform import CaffeRNG, item_seed

NO_LABEL = -(1 << 62)


def optional_module(module, what):
    """Import an optional reader package (extra `data`), or one DataError saying what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} data needs the {module} package (pip install 'caffeq[data]')") from None


class ProcessHandles:
    """One open handle per database and process, opened on first use and kept open.

    A forked child must open its own: `opener(path, inherited)` gets the parent's handle
    (or None) for readers that may reuse it.
    """

    def __init__(self, opener):
        self.opener = opener
        self.handles = {}   # realpath -> (pid, handle)

    def get(self, path):
        key = os.path.realpath(path)
        got = self.handles.get(key)
        if got is not None and got[0] == os.getpid():
            return got[1]
        handle = self.opener(path, None if got is None else got[1])
        self.handles[key] = (os.getpid(), handle)
        return handle

    @contextlib.contextmanager
    def borrowed(self, path):
        """The handle for one quick read: one this process already holds stays open, one opened
        here is closed afterwards (reading a net's shapes leaves no database open)."""
        key = os.path.realpath(path)
        got = self.handles.get(key)
        held = got is not None and got[0] == os.getpid()
        handle = self.get(path)
        try:
            yield handle
        finally:
            if not held:
                self.close(path)

    def close(self, path=None):
        """Close this process's handle on `path` (all of them when None)."""
        keys = [os.path.realpath(path)] if path is not None else list(self.handles)
        for key in keys:
            got = self.handles.pop(key, None)
            if got is not None and got[0] == os.getpid():
                got[1].close()


class StringTable:
    """Many strings in two numpy arrays (one byte buffer + offsets).

    Python lists of str touched by forked DataLoader workers get copied page by
    page (reference counts), so a long list grows every worker's memory; numpy
    buffers are never written and stay shared.
    """

    def __init__(self, strings=()):
        encoded = [s if isinstance(s, bytes) else s.encode("utf-8", "surrogateescape") for s in strings]
        self._blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        self._ends = np.cumsum([len(e) for e in encoded], dtype=np.int64) if encoded else np.zeros(0, np.int64)

    def __len__(self):
        return len(self._ends)

    def raw(self, i):
        start = int(self._ends[i - 1]) if i else 0
        return self._blob[start:int(self._ends[i])].tobytes()

    def __getitem__(self, i):
        return self.raw(i).decode("utf-8", "surrogateescape")


def chw(img):
    """H x W or H x W x C (OpenCV) -> C x H x W view."""
    if img.ndim == 2:
        return img[None]
    return img.transpose(2, 0, 1)


def resize_chw(img, size, where="image"):
    """OpenCV bilinear resize to (height, width), as Caffe's cv::resize in ReadImageToCVMat."""
    from .images import _cv2
    cv2 = _cv2()
    h, w = size
    if img.shape[1:] == (h, w):
        return img
    hwc = np.ascontiguousarray(img.transpose(1, 2, 0))
    try:
        out = cv2.resize(hwc, (int(w), int(h)), interpolation=cv2.INTER_LINEAR)
    except cv2.error as e:
        raise DataError(f"{where}: cannot resize: {str(e).strip().splitlines()[-1]}") from None
    return chw(out)


class Preprocess:
    """Per image, after decoding: channel order, then Caffe's DataTransformer.

    defer_normalize: at TEST, return the cropped raw pixels (uint8 stays uint8)
    and let a Normalizer subtract the (fixed) cropped mean for the whole batch.
    """

    def __init__(self, transformer, channel_order="BGR", defer_normalize=False, seed=0):
        channel_order = (channel_order or "BGR").upper()
        if channel_order not in ("BGR", "RGB"):
            raise DataError(f"channel order must be BGR or RGB, got {channel_order!r}")
        if defer_normalize and transformer.random:
            raise DataError("random crops/mirrors need per-image normalization (defer_normalize=False)")
        self.transformer = transformer
        self.channel_order = channel_order
        self.defer_normalize = defer_normalize
        self.seed = seed

    def __call__(self, img, index, where):
        if img.ndim == 2:
            img = img[None]
        if img.ndim != 3:
            raise DataError(f"{where}: expected C x H x W data, got shape {list(img.shape)}")
        if self.channel_order == "RGB" and img.shape[0] >= 3:
            # OpenCV decodes to BGR(A); the net wants RGB(A)
            img = img[[2, 1, 0] + list(range(3, img.shape[0]))]
        t = self.transformer
        t.check(img.shape, where)
        rng = CaffeRNG(item_seed(self.seed, index)) if t.random else None
        h_off, w_off, mirror = t.geometry(img.shape, rng)
        raw = t.crop(img, h_off, w_off, mirror)
        if self.defer_normalize:
            return np.ascontiguousarray(raw)
        return t.normalize(raw, t.mean_for(img.shape, h_off, w_off, mirror))


class CaffeDataset(Dataset):
    """Base class: subclasses implement `__len__`, `load(i) -> (C x H x W array, label)`, `name(i)`."""

    kind = "dataset"
    has_labels = True

    def __init__(self, preprocess, limit=None):
        self.preprocess = preprocess
        self.limit = limit

    def name(self, i):
        return f"item {i}"

    def load(self, i):
        raise NotImplementedError

    def close(self):
        """Drop open handles (call before forking workers)."""

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.make_item(i, self.load)

    def make_item(self, i, load):
        """(index, array, label, None), or (index, None, NO_LABEL, message) when item i is unusable."""
        where = self.name(i)
        try:
            img, label = load(i)
            if self.preprocess is not None:
                img = self.preprocess(img, i, where)
            return (i, img, label, None)
        except CaffeqError as e:
            msg = str(e)
            return (i, None, NO_LABEL, msg if msg.startswith(where) else f"{where}: {msg}")
        except Exception as e:  # noqa: BLE001 -- a decoder may raise anything on corrupt data: one bad item
            return (i, None, NO_LABEL, f"{where}: {type(e).__name__}: {e}")

    def describe(self):
        return {"kind": self.kind, "items": len(self), "labels": self.has_labels}


def _limited(n, limit):
    return n if limit is None else min(n, max(0, int(limit)))


class StridedSampler(Sampler):
    """Rank r of N gets items r, r+N, r+2N, ...: every item exactly once, no padding duplicates
    (torch's DistributedSampler repeats items to even out the shards)."""

    def __init__(self, length, rank=0, world_size=1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of {world_size}")
        self.length, self.rank, self.world_size = int(length), int(rank), int(world_size)

    def __iter__(self):
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self):
        return max(0, math.ceil((self.length - self.rank) / self.world_size))


class Collate:
    """Items -> one batch dict: `index`, `data` (N x C x H x W), `label` (int64), `bad` [(index, message)].

    Items that failed, or whose shape is not `expected` (the net's C x H x W),
    leave the batch and are listed in `bad`.  With a normalizer the batch is
    normalized here (in the worker process); otherwise it stays raw for the
    device to normalize.
    """

    def __init__(self, expected=None, normalizer=None):
        self.expected = tuple(expected) if expected is not None else None
        self.normalizer = normalizer

    def __call__(self, items):
        good, bad = [], []
        for index, img, label, err in items:
            if err is not None:
                bad.append((index, err))
            elif self.expected is not None and tuple(img.shape) != self.expected:
                msg = (f"item {index}: shape {'x'.join(map(str, img.shape))} after preprocessing, "
                       f"the net takes {'x'.join(map(str, self.expected))}")
                bad.append((index, msg))
            else:
                good.append((index, img, label))
        if good:
            arrays = [g[1] for g in good]
            dtype = np.uint8 if all(a.dtype == np.uint8 for a in arrays) else np.float32
            data = np.stack([np.asarray(a, dtype) for a in arrays])
            if self.normalizer is not None:
                data = self.normalizer.numpy(data)
        else:
            shape = self.expected or (0, 0, 0)
            data = np.zeros((0,) + tuple(shape), np.float32)
        return {"index": torch.tensor([g[0] for g in good], dtype=torch.int64),
                "data": torch.from_numpy(data),
                "label": torch.tensor([g[2] for g in good], dtype=torch.int64),
                "bad": bad}


def worker_init(_worker_id):
    """No OpenCV thread pool in a worker process: the workers are the parallelism, and a pool
    inherited through fork from a parent that used it can deadlock."""
    try:
        import cv2
        cv2.setNumThreads(0)
    except ImportError:
        pass
