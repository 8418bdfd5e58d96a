"""Image decoding as Caffe does it (OpenCV: BGR channel order)."""
import os

import numpy as np

from ..errors import DataError


def _cv2():
    try:
        import cv2
    except ImportError:
        raise DataError("decoding images needs opencv-python-headless (pip install 'caffeq[data]')") from None
    return cv2


def decode_image_bytes(data, where="image", is_color=True):
    """Encoded bytes -> CHW float32 (BGR for colour), like Caffe's DecodeDatumToCVMat."""
    cv2 = _cv2()
    buf = np.frombuffer(data, np.uint8)
    flag = cv2.IMREAD_COLOR if is_color else cv2.IMREAD_GRAYSCALE
    img = cv2.imdecode(buf, flag)
    if img is None:
        raise DataError(f"{where}: cannot decode image bytes")
    if img.ndim == 2:
        img = img[:, :, None]
    return img.transpose(2, 0, 1).astype(np.float32)


def read_list_file(path):
    entries = []
    try:
        with open(path) as f:
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
                entries.append((line[:pos], label))
    except OSError as e:
        raise DataError(f"{path}: cannot read list file: {e.strerror}") from None
    return entries


def first_image_shape(list_path, root_folder="", base_dir=None):
    entries = read_list_file(list_path)
    if not entries:
        raise DataError(f"{list_path}: the image list is empty")
    cv2 = _cv2()
    path = os.path.join(root_folder, entries[0][0])
    img = cv2.imread(path, cv2.IMREAD_UNCHANGED)
    if img is None and base_dir and not os.path.isabs(path):
        img = cv2.imread(os.path.join(base_dir, path), cv2.IMREAD_UNCHANGED)
    if img is None:
        raise DataError(f"{list_path}: cannot read first image '{path}'")
    return img.shape[:2]
