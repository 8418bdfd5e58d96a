"""Data layers of train_val nets: they become graph inputs with the shapes Caffe gives them.

The evaluation and fine-tuning code feeds them (caffeq.data); here we only
work out their top shapes, reading the first record of the source where Caffe
does (Data reads a Datum, ImageData an image).
"""
import os

from ..data.images import first_image_shape
from ..data.lmdb_source import first_datum_shape
from ..errors import DataError
from ..fs import resolve_source
from .registry import Layer, LayerError, register_layer


def transform_attrs(lp):
    t = lp.transform_param
    return {
        "scale": float(t.scale),
        "mirror": bool(t.mirror),
        "crop_size": int(t.crop_size),
        "mean_file": t.mean_file if t.HasField("mean_file") else None,
        "mean_value": [float(v) for v in t.mean_value],
        "force_color": bool(t.force_color),
        "force_gray": bool(t.force_gray),
    }


def _with_crop(attrs, c, h, w):
    crop = attrs["transform"]["crop_size"]
    if crop:
        if crop > h or crop > w:
            raise LayerError(f"crop_size {crop} exceeds the {h}x{w} data")
        return c, crop, crop
    return c, h, w


def describe_transform(t):
    """What Caffe's DataTransformer does to each image, in its order, as text lines."""
    if not t:
        return []
    lines = []
    if t.get("force_color"):
        lines.append("images decoded as 3-channel colour (force_color)")
    if t.get("force_gray"):
        lines.append("images decoded as 1-channel gray (force_gray)")
    if t.get("crop_size"):
        n = t["crop_size"]
        lines.append(f"crop {n}x{n}: the centre crop at TEST (a random one at TRAIN)")
    if t.get("mirror"):
        lines.append("random horizontal flips at TRAIN (mirror: true)")
    if t.get("mean_file"):
        lines.append(f"subtract the per-pixel mean image {t['mean_file']!r} (cropped like the data)")
    if t.get("mean_value"):
        vals = ", ".join(f"{v:g}" for v in t["mean_value"])
        what = "from every channel" if len(t["mean_value"]) == 1 else "per channel, in blob order"
        lines.append(f"subtract mean_value [{vals}] {what}")
    if t.get("scale", 1.0) != 1.0:
        lines.append(f"multiply by scale {t['scale']:.9g} (after the mean subtraction)")
    return lines


class DataLayer(Layer):
    is_data = True

    def preprocessing(self, attrs):
        """Lines describing what Caffe does to the data before the net sees it."""
        lines = describe_transform(attrs.get("transform"))
        if not lines:
            lines = ["no transform_param: the stored values as they are"]
        return lines

    def tops(self, attrs, data_shape, label_shape):
        shapes = [data_shape]
        if attrs["num_tops"] > 1:
            shapes.append(label_shape)
        return shapes


@register_layer("Data")
class Data(DataLayer):
    def preprocessing(self, attrs):
        lines = [(f"Datum records of {attrs['backend']} {attrs['source']!r} (convert_imageset "
                  f"stores OpenCV's BGR, 0-255 values)")]
        return lines + describe_transform(attrs.get("transform"))

    def parse(self, lp):
        p = lp.data_param
        if not p.source:
            raise LayerError("data_param.source is required")
        if p.batch_size < 1:
            raise LayerError("data_param.batch_size must be >= 1")
        backend = "LMDB" if p.backend == 1 else "LEVELDB"
        return {"source": p.source, "batch_size": int(p.batch_size), "backend": backend,
                "transform": transform_attrs(lp), "num_tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        source = resolve_source(attrs["source"], attrs.get("base_dir"))
        if attrs["backend"] != "LMDB":
            raise DataError(f"data source '{attrs['source']}': only LMDB databases are supported "
                            f"(backend LEVELDB)")
        c, h, w = first_datum_shape(source)
        t = attrs["transform"]
        if t["force_color"]:
            c = 3
        if t["force_gray"]:
            c = 1
        c, h, w = _with_crop(attrs, c, h, w)
        n = attrs["batch_size"]
        return self.tops(attrs, (n, c, h, w), (n,))


@register_layer("ImageData")
class ImageData(DataLayer):
    def preprocessing(self, attrs):
        lines = [f"images read with OpenCV ({'BGR colour' if attrs['is_color'] else 'gray'}, 0-255 values)"]
        if attrs["new_height"] and attrs["new_width"]:
            lines.append(f"resized to {attrs['new_height']}x{attrs['new_width']} (height x width)")
        return lines + describe_transform(attrs.get("transform"))

    def parse(self, lp):
        p = lp.image_data_param
        if not p.source:
            raise LayerError("image_data_param.source is required")
        return {"source": p.source, "batch_size": int(p.batch_size), "new_height": int(p.new_height),
                "new_width": int(p.new_width), "is_color": bool(p.is_color),
                "root_folder": p.root_folder, "shuffle": bool(p.shuffle),
                "transform": transform_attrs(lp), "num_tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        c = 3 if attrs["is_color"] else 1
        if attrs["new_height"] and attrs["new_width"]:
            h, w = attrs["new_height"], attrs["new_width"]
        else:
            source = resolve_source(attrs["source"], attrs.get("base_dir"))
            h, w = first_image_shape(source, attrs["root_folder"], attrs.get("base_dir"))
        c, h, w = _with_crop(attrs, c, h, w)
        n = max(1, attrs["batch_size"])
        return self.tops(attrs, (n, c, h, w), (n,))


@register_layer("MemoryData")
class MemoryData(DataLayer):
    def parse(self, lp):
        p = lp.memory_data_param
        return {"batch_size": int(p.batch_size), "chw": (int(p.channels), int(p.height), int(p.width)),
                "transform": transform_attrs(lp), "num_tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        c, h, w = _with_crop(attrs, *attrs["chw"])
        n = attrs["batch_size"]
        return self.tops(attrs, (n, c, h, w), (n,))


@register_layer("WindowData")
class WindowData(DataLayer):
    def parse(self, lp):
        p = lp.window_data_param
        crop = int(p.crop_size) or int(lp.transform_param.crop_size)
        if not crop:
            raise LayerError("window_data_param.crop_size (or transform_param.crop_size) is required")
        return {"batch_size": int(p.batch_size), "crop": crop, "num_tops": len(lp.top),
                "transform": transform_attrs(lp)}

    def infer(self, attrs, in_shapes):
        n, crop = attrs["batch_size"], attrs["crop"]
        return self.tops(attrs, (n, 3, crop, crop), (n,))


@register_layer("DummyData")
class DummyData(DataLayer):
    """Constant or random blobs; a graph input here (feed the values you want)."""

    def parse(self, lp):
        p = lp.dummy_data_param
        shapes = [tuple(int(d) for d in s.dim) for s in p.shape]
        if not shapes and p.num:
            k = max(len(p.num), len(p.channels), len(p.height), len(p.width))

            def pick(rep, i):
                return rep[i] if len(rep) > 1 else rep[0]
            shapes = [(pick(p.num, i), pick(p.channels, i), pick(p.height, i), pick(p.width, i))
                      for i in range(k)]
        if len(shapes) == 1:
            shapes = shapes * len(lp.top)
        if len(shapes) != len(lp.top):
            raise LayerError(f"dummy_data_param gives {len(shapes)} shapes for {len(lp.top)} tops")
        return {"shapes": shapes, "num_tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        return list(attrs["shapes"])


@register_layer("HDF5Data")
class HDF5Data(DataLayer):
    def parse(self, lp):
        p = lp.hdf5_data_param
        return {"source": p.source, "batch_size": int(p.batch_size), "tops": list(lp.top),
                "num_tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        try:
            import h5py
        except ImportError:
            raise DataError(f"HDF5Data '{attrs['source']}': reading its shapes needs h5py "
                            f"(pip install h5py)") from None
        source = resolve_source(attrs["source"], attrs.get("base_dir"))
        try:
            with open(source) as f:
                first = next((ln.strip() for ln in f if ln.strip()), None)
        except OSError as e:
            raise DataError(f"HDF5Data source '{source}': {e.strerror}") from None
        if first is None:
            raise DataError(f"HDF5Data source '{source}' lists no files")
        with h5py.File(resolve_source(first, os.path.dirname(source)), "r") as h5:
            return [(attrs["batch_size"],) + tuple(h5[t].shape[1:]) for t in attrs["tops"]]
