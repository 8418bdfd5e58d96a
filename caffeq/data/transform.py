"""Caffe's DataTransformer (src/caffe/data_transformer.cpp), exactly.

For one image of C x H x W values (uint8 pixels or float_data):

- crop_size: a crop_size x crop_size window at (h_off, w_off), the centre
  ((H - crop) / 2, integer division) at TEST, random at TRAIN;
- mirror: flip the width axis of the *output*; the mean is indexed at the
  un-mirrored source position, so mirror(crop(data) - crop(mean));
- mean_file: one C x H x W mean of the *uncropped* size, cropped at the same
  offset as the data; mean_value: one value or one per channel;
- out = (pixel - mean) * scale, in float32 (scale alone when there is no mean).

Caffe draws its random numbers as `rng() % n` from a 32-bit Mersenne twister,
mirror first, then h_off, then w_off; CaffeRNG does the same.  Caffe mirrors at
random even at TEST when `mirror: true`; an evaluation must be deterministic,
so here mirroring only happens at TRAIN (a warning says so).
"""
import os

import numpy as np

from ..errors import DataError, ParseError
from ..io.caffemodel import read_blobproto


class CaffeRNG:
    """Caffe's Rand(n) = rng() % n over MT19937 (boost::mt19937 and numpy's legacy
    RandomState share the generator and the integer seeding)."""

    def __init__(self, seed=0):
        self._rs = np.random.RandomState(int(seed) % (1 << 32))

    def rand(self, n):
        return int(self._rs.randint(0, 1 << 32, dtype=np.uint64)) % int(n)


def item_seed(seed, index):
    """A per-item seed, so that random crops do not depend on worker scheduling."""
    return (int(seed) * 0x9E3779B1 + int(index) * 0x85EBCA77 + 1) % (1 << 32)


def load_mean_file(path):
    """A .binaryproto mean -> float32 C x H x W (Caffe's data_mean_)."""
    if not os.path.exists(path):
        raise DataError(f"{path}: mean file not found")
    try:
        arr = np.asarray(read_blobproto(path), dtype=np.float32)
    except ParseError as e:
        raise DataError(f"mean file {e}") from None
    if arr.ndim == 4:
        if arr.shape[0] != 1:
            raise DataError(f"{path}: the mean holds {arr.shape[0]} images; Caffe needs one "
                            f"(shape {list(arr.shape)})")
        arr = arr[0]
    elif arr.ndim == 2:
        arr = arr[None]
    elif arr.ndim != 3:
        raise DataError(f"{path}: a mean of shape {list(arr.shape)} is not C x H x W")
    return np.ascontiguousarray(arr)


class DataTransformer:
    """transform_param as Caffe applies it.  Call it on one C x H x W array."""

    def __init__(self, scale=1.0, mean_file=None, mean_value=(), crop_size=0, mirror=False,
                 force_color=False, force_gray=False, phase="TEST", mean=None):
        if mean_file and len(mean_value):
            raise DataError("transform_param: cannot specify mean_file and mean_value at the same time")
        if force_color and force_gray:
            raise DataError("transform_param: cannot set both force_color and force_gray")
        if crop_size < 0:
            raise DataError(f"transform_param: crop_size must be >= 0, got {crop_size}")
        phase = phase.upper() if isinstance(phase, str) else phase
        if phase not in ("TEST", "TRAIN"):
            raise DataError(f"phase must be TEST or TRAIN, got {phase!r}")
        self.scale = float(scale)
        self.mean_file = os.fspath(mean_file) if mean_file else None
        self.mean_value = [float(v) for v in mean_value]
        self.crop_size = int(crop_size)
        self.mirror = bool(mirror)
        self.force_color = bool(force_color)
        self.force_gray = bool(force_gray)
        self.phase = phase
        self._mean = None if mean is None else np.asarray(mean, np.float32)
        if self.mean_file and self._mean is None:
            self._mean = load_mean_file(self.mean_file)   # missing mean file: fail now, once

    # -- description -----------------------------------------------------------------
    @property
    def mean(self):
        return self._mean

    @property
    def random(self):
        return self.phase == "TRAIN" and (self.mirror or self.crop_size > 0)

    @property
    def is_identity(self):
        return self.scale == 1.0 and self._mean is None and not self.mean_value and not self.crop_size \
            and not (self.mirror and self.phase == "TRAIN")

    def describe(self):
        return {"scale": self.scale, "mean_file": self.mean_file, "mean_value": list(self.mean_value),
                "crop_size": self.crop_size, "mirror": self.mirror, "force_color": self.force_color,
                "force_gray": self.force_gray, "phase": self.phase}

    # -- the steps ---------------------------------------------------------------------
    def check(self, shape, where="image"):
        """Caffe's CHECKs on one input: crop fits, mean file matches, mean_value count."""
        c, h, w = shape
        if self.crop_size and (h < self.crop_size or w < self.crop_size):
            raise DataError(f"{where}: {h}x{w} is smaller than crop_size {self.crop_size}")
        if self._mean is not None and tuple(self._mean.shape) != (c, h, w):
            raise DataError(f"{where}: is {c}x{h}x{w} but the mean file is "
                            f"{'x'.join(map(str, self._mean.shape))} (Caffe needs the same size; resize first)")
        if self.mean_value and len(self.mean_value) not in (1, c):
            raise DataError(f"{where}: {len(self.mean_value)} mean_value(s) for {c} channels "
                            f"(give one, or one per channel)")

    def geometry(self, shape, rng=None):
        """(h_off, w_off, mirror) as Caffe draws them: mirror first, then the offsets."""
        _, h, w = shape
        mirror = False
        if self.mirror and self.phase == "TRAIN":
            mirror = (rng or CaffeRNG(0)).rand(2) == 1
        h_off = w_off = 0
        if self.crop_size:
            if self.phase == "TRAIN":
                rng = rng or CaffeRNG(0)
                h_off = rng.rand(h - self.crop_size + 1)
                w_off = rng.rand(w - self.crop_size + 1)
            else:
                h_off = (h - self.crop_size) // 2
                w_off = (w - self.crop_size) // 2
        return h_off, w_off, mirror

    def crop(self, img, h_off, w_off, mirror):
        """The raw pixels of the output window (uint8 stays uint8)."""
        if self.crop_size:
            k = self.crop_size
            img = img[:, h_off:h_off + k, w_off:w_off + k]
        if mirror:
            img = img[:, :, ::-1]
        return img

    def mean_for(self, shape, h_off=None, w_off=None, mirror=False):
        """The mean that meets the output: cropped (and mirrored) like the data; None without one."""
        if self._mean is not None:
            if h_off is None:
                h_off, w_off, _ = self.geometry(shape)   # TEST: the centre
            return np.ascontiguousarray(self.crop(self._mean, h_off, w_off, mirror))
        if self.mean_value:
            c = shape[0]
            if len(self.mean_value) not in (1, c):
                raise DataError(f"{len(self.mean_value)} mean_value(s) for {c} channels "
                                f"(give one, or one per channel)")
            mv = self.mean_value * c if len(self.mean_value) == 1 else self.mean_value
            return np.asarray(mv, np.float32).reshape(c, 1, 1)
        return None

    def normalize(self, raw, mean):
        """(pixel - mean) * scale in float32, as Caffe's Dtype arithmetic."""
        x = np.asarray(raw, dtype=np.float32)
        if mean is not None:
            x = x - mean
        return np.multiply(x, np.float32(self.scale), dtype=np.float32)

    def __call__(self, img, rng=None, where="image"):
        """The whole transform of one C x H x W image -> float32 array."""
        img = np.asarray(img)
        if img.ndim == 2:
            img = img[None]
        if img.ndim != 3:
            raise DataError(f"{where}: expected C x H x W data, got shape {list(img.shape)}")
        self.check(img.shape, where)
        h_off, w_off, mirror = self.geometry(img.shape, rng)
        raw = self.crop(img, h_off, w_off, mirror)
        return self.normalize(raw, self.mean_for(img.shape, h_off, w_off, mirror))


class Normalizer:
    """The TEST-phase (pixel - mean) * scale for a whole batch, on numpy or torch tensors.

    At TEST every image of a given size has the same crop offset, so the cropped
    mean is one fixed array; subtracting it from a batch gives exactly the
    per-image result.  Doing it after the copy lets uint8 pixels travel to the
    GPU (4x fewer bytes).
    """

    def __init__(self, mean, scale):
        self.mean = None if mean is None else np.ascontiguousarray(mean, np.float32)
        self.scale = float(scale)
        self._cache = {}

    @property
    def is_identity(self):
        return self.mean is None and self.scale == 1.0

    def numpy(self, batch):
        x = np.asarray(batch, dtype=np.float32)
        if self.mean is not None:
            x = x - self.mean
        return np.multiply(x, np.float32(self.scale), dtype=np.float32)

    def torch(self, batch):
        import torch
        x = batch.to(torch.float32)
        if self.is_identity:
            return x
        key = x.device
        if key not in self._cache:
            mean = None if self.mean is None else torch.from_numpy(self.mean).to(x.device)
            self._cache[key] = (mean, torch.tensor(self.scale, dtype=torch.float32, device=x.device))
        mean, scale = self._cache[key]
        if mean is not None:
            x = x - mean
        return x * scale

    def __getstate__(self):
        return {"mean": self.mean, "scale": self.scale, "_cache": {}}
