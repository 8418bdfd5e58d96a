"""Data layers of Caffe forks: graph inputs, shaped without their datasets where the prototxt can tell.

- AnnotatedData (SSD): images resized to `transform_param.resize_param` height x width (or
  cropped by crop_size); the label top holds SSD's (1, 1, boxes, 8) annotation rows, whose
  count only the data knows, so it is listed as one row.
- DenseImageData (SegNet): `dense_image_data_param` new_height/new_width, else
  crop_height/crop_width; the label top is a (N, 1, H, W) map.
- ImageSegData (DeepLab), ImageLabelmapData (HED), ImageLabelData, WindowSegData (DeconvNet's
  V1 WINDOW_SEG_DATA): an ImageData-style list of image and label-map pairs; shapes from
  crop_size or new_height/new_width.  tidsp/caffe-jacinto's ImageLabelData (caffe-0.17 2678b2b,
  image_label_data_layer.cpp) reads image_label_data_param instead: two databases, images and
  (N, 1, H, W) label maps, H = W = crop_size, else the records' size; maunzzz/caffe-crfgd's (c0cbacb)
  reads it too, two image lists, its label map (N, 1, label_slice dims).  CASENet's ImageSegData (merlresearch/CASENet c5312de caffe,
  label_type PIXELML) reads binary multi-label maps of image_data_param.num_label_chn channels (32
  classes' bits each): the label is (N, num_label_chn, H, W).
- WindowClsData, SelectSegBinary, WindowSegBinary (HyeonwooNoh/caffe d9e8494, DeconvNet and
  DecoupledNet's training files; V1 WINDOW_CLS_DATA, SELECT_SEG_BINARY, WINDOW_SEG_BINARY): an
  image list read by image_data_param; data (N, C, crop or new size), then, as each Reshape gives
  them, a (N, 1, H, W) segmentation map, a (N, label_dim, 1, 1) class label
  (window_cls_data_param.label_dim) or a (N, 1, 1, 2) image size.  maga33/TransferNet's
  SelectSrcTgkSegBinary (aaa32d7) shapes its tops as SelectSegBinary; it draws from a source and a
  target list (image_data_param.target).
- MultiLabelData (thuml/TAH): an image list with label_num labels a line; labels (N, label_num).
- Any other fork layer with no bottoms whose type ends in "Data" (BoxData, VideoData, ...)
  is a graph input whose shapes come from `--input-shape`, else from crop_size.

None of them reads its source while shapes are inferred: a top whose shape only the
dataset could tell raises MissingInputShape, which names `--input-shape`.
"""
from .data import DataLayer, transform_attrs
from .registry import LayerError, needs_input_shape, positive_field, register_layer


def _channels(t, is_color=True):
    if t["force_gray"]:
        return 1
    if t["force_color"]:
        return 3
    return 3 if is_color else 1


class ForkDataLayer(DataLayer):
    """Two-top fork data layers: data (N, C, H, W), then a label shaped by label_shape()."""

    def data_shape(self, attrs):
        if not attrs["hw"]:
            raise needs_input_shape(attrs, attrs["tops"][0], f"{attrs['type']} source "
                                    f"'{attrs['source'] or '?'}' is not read to infer shapes")
        return (attrs["batch_size"], attrs["channels"]) + tuple(attrs["hw"])

    def label_shape(self, attrs, data):
        return (data[0],)

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or self.data_shape(attrs))
        shapes = [data]
        for i in range(1, attrs["num_tops"]):
            shapes.append(tuple(given.get(i) or self.label_shape(attrs, data)))
        return shapes


def _crop_or(t, height, width):
    """Caffe's transformer crops last: crop_size wins over a resize."""
    if t["crop_size"]:
        return (t["crop_size"], t["crop_size"])
    if height and width:
        return (height, width)
    return None


@register_layer("AnnotatedData")
class AnnotatedData(ForkDataLayer):
    def parse(self, lp):
        t = transform_attrs(lp)
        tp = lp.transform_param
        # resize_param is repeated in MobileNet-YOLO's proto (optional in SSD's): the first one applies
        r = tp.resize_param[0] if len(tp.resize_param) else None
        hw = (int(tp.crop_h), int(tp.crop_w)) if tp.crop_h and tp.crop_w else \
            _crop_or(t, int(r.height) if r else 0, int(r.width) if r else 0)
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": lp.data_param.source, "batch_size": max(1, int(lp.data_param.batch_size)),
                "channels": _channels(t), "hw": hw}

    def label_shape(self, attrs, data):
        return (1, 1, 1, 8)   # SSD: one row per box, [item, label, instance, xmin, ymin, xmax, ymax, difficult]


@register_layer("DenseImageData")
class DenseImageData(ForkDataLayer):
    def parse(self, lp):
        p = lp.dense_image_data_param
        t = transform_attrs(lp)
        hw = (int(p.crop_height), int(p.crop_width)) if p.crop_height and p.crop_width else \
            _crop_or(t, int(p.new_height), int(p.new_width))
        positive_field(p.label_divide_factor, "dense_image_data_param.label_divide_factor")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": p.source, "batch_size": max(1, int(p.batch_size)),
                "channels": _channels(t, p.is_color), "hw": hw,
                # ENet's encoder trains on label maps this many times smaller (not with a crop)
                "label_divide": 1 if p.crop_height and p.crop_width else int(p.label_divide_factor)}

    def label_shape(self, attrs, data):
        f = attrs["label_divide"]
        return (data[0], 1) + tuple(d // f for d in data[2:])


@register_layer("ImageSegData", "ImageLabelmapData", "ImageLabelData", "WindowSegData")
class ImageLabelMapData(ForkDataLayer):
    def parse(self, lp):
        p = lp.image_data_param
        t = transform_attrs(lp)
        if lp.HasField("image_label_data_param"):
            # tidsp/caffe-jacinto: images and label maps from two databases; crop_size, else the records' size
            q = lp.image_label_data_param
            return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                    "source": q.image_list_path, "batch_size": max(1, int(q.batch_size)),
                    "channels": _channels(t), "hw": _crop_or(t, 0, 0), "label_channels": 1,
                    # maunzzz/caffe-crfgd's label_slice: the label map's rows and columns (its GetLabelSlice)
                    "label_hw": tuple(int(d) for d in q.label_slice.dim) if len(q.label_slice.dim) == 2 else None}
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": p.source, "batch_size": max(1, int(p.batch_size)),
                "channels": _channels(t, p.is_color), "hw": _crop_or(t, int(p.new_height), int(p.new_width)),
                # CASENet's multi-label edge maps: ceil(classes / 32) channels of bit masks
                "label_channels": positive_field(p.num_label_chn, "image_data_param.num_label_chn")}

    def label_shape(self, attrs, data):
        return (data[0], attrs.get("label_channels", 1)) + (attrs.get("label_hw") or tuple(data[2:]))

    def top_shapes(self, attrs, given):
        shapes = super().top_shapes(attrs, given)
        if attrs["type"] == "ImageSegData" and len(shapes) == 3 and 2 not in given:
            shapes[2] = (shapes[0][0], 1, 1, 2)   # DeepLab: each image's (height, width) before the crop
        return shapes


# HyeonwooNoh/caffe: what each top after the data holds, as its Reshape sizes them
_DECONVNET_TOPS = {"WindowClsData": ("class", "size"), "SelectSegBinary": ("map", "class"),
                   "WindowSegBinary": ("map", "size"), "SelectSrcTgkSegBinary": ("map", "class")}


@register_layer(*_DECONVNET_TOPS)
class DeconvNetData(ForkDataLayer):
    def parse(self, lp):
        p = lp.image_data_param
        t = transform_attrs(lp)
        if len(lp.top) > 3:
            raise needs_input_shape({"type": lp.type, "tops": list(lp.top)}, lp.top[3],
                                    f"{lp.type} makes at most 3 tops")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": p.source, "batch_size": max(1, int(p.batch_size)),
                "channels": _channels(t, p.is_color), "hw": _crop_or(t, int(p.new_height), int(p.new_width)),
                "label_dim": positive_field(lp.window_cls_data_param.label_dim, "window_cls_data_param.label_dim")}

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or self.data_shape(attrs))
        n = data[0]
        made = {"map": (n, 1) + data[2:], "class": (n, attrs["label_dim"], 1, 1), "size": (n, 1, 1, 2)}
        shapes = [data] + [made[kind] for kind in _DECONVNET_TOPS[attrs["type"]]]
        return [tuple(given.get(i) or shapes[i]) for i in range(attrs["num_tops"])]


@register_layer("MultiLabelData")
class MultiLabelData(ForkDataLayer):
    """thuml/TAH's MultiLabelData (multi_label_data_layer.cpp, 1ff33d9): an image list whose lines
    are a file and label_num integers; data (batch_size, C, crop or new size), labels (batch_size,
    label_num).  A MultiLabelData of another fork (no multi_label_data_param) is a fork data layer
    whose shapes come from --input-shape, else crop_size."""

    def parse(self, lp):
        if not lp.HasField("multi_label_data_param"):
            return {**UNKNOWN_FORK_DATA.parse(lp), "label_num": None}
        p = lp.multi_label_data_param
        t = transform_attrs(lp)
        if bool(p.new_height) != bool(p.new_width):
            raise LayerError("multi_label_data_param: new_height and new_width must be set together (the fork's CHECK)")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": p.source, "batch_size": positive_field(p.batch_size, "multi_label_data_param.batch_size"),
                "channels": _channels(t, p.is_color), "hw": _crop_or(t, int(p.new_height), int(p.new_width)),
                "label_num": int(p.label_num)}

    def guessed_label_tops(self, attrs, given):
        return () if attrs["label_num"] is not None else UNKNOWN_FORK_DATA.guessed_label_tops(attrs, given)

    def label_shape(self, attrs, data):
        return (data[0], attrs["label_num"]) if attrs["label_num"] is not None else (data[0],)


@register_layer("RSImageData")
class RSImageData(ForkDataLayer):
    """zhaoys87/LU's RSImageData (caffe-master rsimage_data_layer.cpp, 2016): an image list of multi-band
    remote-sensing images (ReadRSImageToCVMat) with one label a line; data (batch_size, bands, H, W), H and W
    from crop_size, else new_height / new_width.  The bands are the first image's, so the data's shape comes
    from --input-shape (a guess of 3 would hand the nets' Slice at 3 an empty rest)."""

    def parse(self, lp):
        p = lp.rsimage_data_param
        t = transform_attrs(lp)
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t, "source": p.source,
                "batch_size": positive_field(p.batch_size, "rsimage_data_param.batch_size"),
                "hw": _crop_or(t, int(p.new_height), int(p.new_width))}

    def data_shape(self, attrs):
        size = f", H x W {attrs['hw'][0]}x{attrs['hw'][1]}" if attrs["hw"] else ""
        raise needs_input_shape(attrs, attrs["tops"][0], f"RSImageData takes its channels from the bands of "
                                f"the first image of '{attrs['source'] or '?'}' (batch {attrs['batch_size']}{size})")


class UnknownForkData(ForkDataLayer):
    """A fork's data layer caffeq has no spec for: a graph input shaped by the user or crop_size."""

    types = ("fork data layer",)

    def parse(self, lp):
        t = transform_attrs(lp)
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": lp.data_param.source or lp.image_data_param.source,
                "batch_size": max(1, int(lp.data_param.batch_size or lp.image_data_param.batch_size or 1)),
                "channels": _channels(t), "hw": _crop_or(t, 0, 0)}

    def guessed_label_tops(self, attrs, given):
        # the data top too: its channels and size are Caffe's Data layer's, a guess for a fork's reader
        # (antran89/two-stream-fcan's FlowData stacks 2 x new_length flow maps)
        return tuple(i for i in (0, 1) if i < attrs["num_tops"] and i not in given)

    def top_shapes(self, attrs, given):
        # data and a label as Caffe's Data gives them; what a third top holds only the fork knows
        extra = [t for i, t in enumerate(attrs["tops"]) if i >= 2 and i not in given]
        if extra:
            raise needs_input_shape(attrs, extra[0], f"{attrs['type']} is a fork's data layer; its top "
                                    f"'{extra[0]}' has a shape only the fork's code knows")
        return super().top_shapes(attrs, given)


UNKNOWN_FORK_DATA = UnknownForkData()
