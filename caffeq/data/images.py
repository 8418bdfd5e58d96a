"""Image files as Caffe reads them (OpenCV, BGR channel order): ImageData lists and class folders."""
import math
import os

import numpy as np

from ..errors import DataError
from .base import CaffeDataset, StringTable, _limited, chw, resize_chw

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".pbm", ".tif", ".tiff", ".webp",
                    ".jpe", ".jp2", ".pnm", ".ras", ".sr", ".exr", ".hdr", ".pic")


def _cv2():
    try:
        import cv2
    except ImportError:
        raise DataError("decoding images needs opencv-python-headless (pip install 'caffeq[data]')") from None
    return cv2


def _flag(cv2, is_color):
    if is_color is None:
        return cv2.IMREAD_UNCHANGED          # Caffe's DecodeDatumToCVMatNative (imdecode(.., -1))
    return cv2.IMREAD_COLOR if is_color else cv2.IMREAD_GRAYSCALE


def decode_image_hwc(data, where="image", is_color=True):
    """Encoded bytes -> H x W x C uint8 (BGR for colour), as cv::imdecode gives it."""
    cv2 = _cv2()
    buf = np.frombuffer(data, np.uint8)
    if buf.size == 0:
        raise DataError(f"{where}: empty image data")
    try:
        img = cv2.imdecode(buf, _flag(cv2, is_color))
    except cv2.error as e:
        raise DataError(f"{where}: cannot decode image: {str(e).strip().splitlines()[-1]}") from None
    if img is None:
        raise DataError(f"{where}: cannot decode image bytes (corrupt or not an image)")
    if img.dtype != np.uint8:
        # Caffe's DataTransformer CHECKs CV_8U
        raise DataError(f"{where}: {img.dtype} pixels; Caffe reads 8-bit images only")
    if img.ndim == 2:
        img = img[:, :, None]
    return img


def decode_image_bytes(data, where="image", is_color=True):
    """Encoded bytes -> C x H x W float32 (BGR for colour), like Caffe's DecodeDatumToCVMat.

    is_color: True (colour), False (grey) or None (the file's own channels, native).
    """
    return np.ascontiguousarray(chw(decode_image_hwc(data, where, is_color))).astype(np.float32)


def read_image(path, is_color=True, resize=None, where=None, shorter_side=0, bicubic=False, min_size=None,
               scaled_shorter_side=0):
    """Caffe's ReadImageToCVMat: imread(is_color), then cv::resize (bilinear) when both sizes
    are given -> C x H x W uint8.

    shorter_side: yihui-he/caffe-pro's `new_dim` (io.cpp ReadImageToCVMat with min_dim): the
    shorter side becomes shorter_side and the other round(scale * side), bicubic or bilinear.
    min_size: LRCN lisa-caffe-public's (min_height, min_width): a smaller image grows (min_grown_size).
    scaled_shorter_side: cvjena/caffe_pp2's smaller_side_size, after the rest: cv::resize by the factor
    float32(S / shorter side) both ways (bilinear), OpenCV rounding the sizes (scaled_shorter_size)."""
    where = where or path
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"{where}: cannot read image: {e.strerror}") from None
    img = decode_image_hwc(data, where, is_color)
    if shorter_side:
        resize = shorter_side_size(img.shape[:2], shorter_side)
    elif min_size and not resize:
        resize = min_grown_size(img.shape[:2], *min_size)
    if resize:
        h, w = resize
        if img.shape[:2] != (h, w):
            cv2 = _cv2()
            out = cv2.resize(img, (int(w), int(h)),
                             interpolation=cv2.INTER_CUBIC if bicubic else cv2.INTER_LINEAR)
            img = out[:, :, None] if out.ndim == 2 else out
    if scaled_shorter_side:
        cv2 = _cv2()
        ratio = float(shorter_side_ratio(img.shape[:2], scaled_shorter_side))
        out = cv2.resize(img, None, fx=ratio, fy=ratio, interpolation=cv2.INTER_LINEAR)
        img = out[:, :, None] if out.ndim == 2 else out
    return chw(img)


def shorter_side_ratio(hw, side):
    """cvjena/caffe_pp2's factor: float(side * 1.0 / min(height, width)), a double quotient stored in a float."""
    return np.float32(int(side) / min(int(hw[0]), int(hw[1])))


def scaled_shorter_size(hw, side):
    """(height, width) after cv::resize(fx = fy = shorter_side_ratio): each side times the factor, rounded
    half to even (OpenCV's saturate_cast<int>)."""
    ratio = float(shorter_side_ratio(hw, side))
    return round(int(hw[0]) * ratio), round(int(hw[1]) * ratio)


def shorter_side_size(hw, shorter_side):
    """(height, width) after caffe-pro's new_dim resize: the shorter side (the width when square)
    becomes shorter_side, the other is scaled in float32 and rounded half away from zero."""
    h, w = int(hw[0]), int(hw[1])
    scale = np.float32(shorter_side) / np.float32(min(h, w))

    def scaled(side):   # C's round() of a float product; float64 holds the float32 value exactly
        return math.floor(float(scale * np.float32(side)) + 0.5)
    if h >= w:
        return scaled(h), int(shorter_side)
    return int(shorter_side), scaled(w)


def min_grown_size(hw, min_height, min_width):
    """(height, width) of lisa-caffe-public's ReadImageToCVMat with min_height / min_width: an image
    smaller than either grows, aspect kept, to min_width wide when the width falls further short, else
    min_height high, the other side float(min) * (float(side) / float(other)) + 0.5 truncated."""
    h, w = int(hw[0]), int(hw[1])
    if not (h < min_height or w < min_width):
        return h, w
    f = np.float32
    if min_width - w > min_height - h:
        return int(f(f(min_width) * f(f(h) / f(w))) + f(0.5)), int(min_width)
    return int(min_height), int(f(f(min_height) * f(f(w) / f(h))) + f(0.5))


def read_list_file(path):
    """An ImageData list: `path label` per line (the label after the last space) -> [(path, label)]."""
    return list(iter_list_file(path))


def iter_list_file(path):
    try:
        f = open(path, encoding="utf-8", errors="surrogateescape")  # noqa: SIM115 -- closed below
    except OSError as e:
        raise DataError(f"{path}: cannot read list file: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            pos = line.rfind(" ")
            if pos < 0:
                raise DataError(f"{path}:{n}: expected 'path label'")
            try:
                label = int(line[pos + 1:])
            except ValueError:
                raise DataError(f"{path}:{n}: label '{line[pos + 1:]}' is not an integer") from None
            yield line[:pos].rstrip(), label


class PathResolver:
    """Relative image paths: the prototxt's folder, then the working directory, then the list's folder.

    The first root that holds an image is tried first for the next ones.
    """

    def __init__(self, roots):
        seen = []
        for r in roots:
            if r is None:
                continue
            r = os.path.abspath(r)
            if r not in seen:
                seen.append(r)
        self.roots = seen
        self._last = 0

    def __call__(self, path):
        if os.path.isabs(path) or not self.roots:
            return path
        order = [self._last] + [k for k in range(len(self.roots)) if k != self._last]
        for k in order:
            cand = os.path.join(self.roots[k], path)
            if os.path.exists(cand):
                self._last = k
                return cand
        return os.path.join(self.roots[0], path)


def first_image_shape(list_path, root_folder="", base_dir=None):
    """(height, width) of the first image of an ImageData list (what the layer's setup reads)."""
    first = next(iter_list_file(list_path), None)
    if first is None:
        raise DataError(f"{list_path}: the image list is empty")
    resolve = PathResolver([base_dir, os.getcwd(), os.path.dirname(os.path.abspath(list_path))])
    path = resolve(root_folder + first[0])
    img = read_image(path, is_color=None, where=f"{list_path}: first image '{root_folder + first[0]}'")
    return img.shape[1:]


class _ImageFilesDataset(CaffeDataset):
    """Items read from image files: subclasses fill paths (a StringTable), labels, is_color and
    resize, and say where a stored path lies on disk (file_path)."""

    shorter_side, bicubic = 0, False   # caffe-pro's new_dim resize (ImageListDataset)
    scaled_shorter_side = 0            # cvjena/caffe_pp2's smaller_side_size (ImageListDataset)
    min_size = None                    # lisa-caffe-public's min_height / min_width (ImageListDataset)

    def __len__(self):
        return len(self.paths)

    def name(self, i):
        return self.paths[i]

    def file_path(self, rel):
        raise NotImplementedError

    def load(self, i):
        rel = self.paths[i]
        return (read_image(self.file_path(rel), self.is_color, self.resize, where=rel,
                           shorter_side=self.shorter_side, bicubic=self.bicubic, min_size=self.min_size,
                           scaled_shorter_side=self.scaled_shorter_side),
                int(self.labels[i]))


class ImageListDataset(_ImageFilesDataset):
    """An ImageData source: `path label` lines, `root_folder` + path (string concatenation as
    in Caffe), read with is_color and resized to (new_height, new_width) when both are set."""

    kind = "image_list"

    def __init__(self, list_path, preprocess=None, root_folder="", new_height=0, new_width=0,
                 is_color=True, base_dir=None, limit=None, roots=None, new_dim=0, bicubic=False, min_size=None,
                 smaller_side=()):
        super().__init__(preprocess, limit)
        if (new_height > 0) != (new_width > 0):
            raise DataError(f"{list_path}: new_height and new_width must be set together "
                            f"(got {new_height} and {new_width})")
        if not os.path.isfile(list_path):
            raise DataError(f"{list_path}: image list file not found")
        self.path = os.fspath(list_path)
        paths, labels = [], []
        for p, label in iter_list_file(self.path):
            if limit is not None and len(paths) >= limit:
                break
            paths.append(root_folder + p)
            labels.append(label)
        self.paths = StringTable(paths)
        self.labels = np.asarray(labels, np.int64)
        if new_dim and new_height:
            raise DataError(f"{list_path}: new_dim and new_height/new_width cannot be set together")
        self.resize = (int(new_height), int(new_width)) if new_height > 0 else None
        self.shorter_side, self.bicubic = int(new_dim), bool(bicubic)
        self.min_size = tuple(min_size) if min_size and all(min_size) else None
        if len(smaller_side) == 2:
            raise DataError(f"{list_path}: smaller_side_size with two values draws each image's shorter side at "
                            f"random (cvjena/caffe_pp2); give one value to evaluate")
        self.scaled_shorter_side = int(smaller_side[0]) if len(smaller_side) == 1 else 0   # more: the fork ignores
        self.is_color = is_color
        # relative image paths: the given roots (default: the prototxt's folder, then the working
        # directory), then the list file's own folder
        roots = list(roots) if roots is not None else [base_dir, os.getcwd()]
        self.resolve = PathResolver(roots + [os.path.dirname(os.path.abspath(self.path))])

    def file_path(self, rel):
        return self.resolve(rel)


class ImageFolderDataset(_ImageFilesDataset):
    """root/<class>/<image>: labels are the sorted class folder names' positions."""

    kind = "image_folder"

    def __init__(self, root, preprocess=None, is_color=True, resize=None, limit=None):
        super().__init__(preprocess, limit)
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise DataError(f"{self.root}: image folder not found")
        classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise DataError(f"{self.root}: no class subfolders (expected root/<class>/<image>)")
        paths, labels = [], []
        for label, cls in enumerate(classes):
            folder = os.path.join(self.root, cls)
            for dirpath, dirnames, files in os.walk(folder):
                dirnames.sort()
                for f in sorted(files):
                    if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith("."):
                        paths.append(os.path.relpath(os.path.join(dirpath, f), self.root))
                        labels.append(label)
        n = _limited(len(paths), limit)
        self.classes = classes
        self.paths = StringTable(paths[:n])
        self.labels = np.asarray(labels[:n], np.int64)
        if not n and limit is None:
            raise DataError(f"{self.root}: no image files in the class folders")
        self.is_color = is_color
        self.resize = resize

    def file_path(self, rel):
        return os.path.join(self.root, rel)

    def describe(self):
        d = super().describe()
        d["classes"] = list(self.classes)
        return d


__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageFolderDataset",
    "ImageListDataset",
    "decode_image_bytes",
    "decode_image_hwc",
    "first_image_shape",
    "read_image",
    "read_list_file",
    "resize_chw",
    "shorter_side_size",
]
