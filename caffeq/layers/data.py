"""Data layers of train_val nets: they become graph inputs with the shapes Caffe gives them.

The evaluation and fine-tuning code feeds them (caffeq.data); here we only
work out their top shapes, without the dataset wherever the prototxt tells
enough.  In order: shapes the user gives (`--input-shape`, applied by the
graph builder through `top_shapes`), then `transform_param` (crop_size, the
mean file's channels and size, force_color/gray, mean_value's count) and the
layer's own size fields, then the first record of the source if it happens to
exist (as Caffe's setup reads it), else an error that names `--input-shape`.
"""
import os

from ..data import datum_shape
from ..data.images import first_image_shape, min_grown_size, scaled_shorter_size, shorter_side_size
from ..data.transform import load_mean_file
from ..errors import DataError
from ..fs import resolve_source
from .common import given_or_fixed, input_param_shapes
from .registry import Layer, LayerError, need_blobs, needs_input_shape, positive_field, register_layer


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
        # JigsawPuzzleSolver's puzzle: siamese_size tiles of patch_size a side on the channels
        "siamese": (int(t.siamese_size), int(t.patch_size)) if t.siamese_size > 1 else None,
        # sanpingzhou/Person-Re-ID: a crop_size_h x crop_size_w window when crop_size is 0
        "crop_hw": (int(t.crop_size_h), int(t.crop_size_w)) if not t.crop_size and t.crop_size_h and t.crop_size_w
        else None,
    }


def _with_crop(attrs, c, h, w):
    crop = attrs["transform"]["crop_size"]
    ch, cw = attrs["transform"].get("crop_hw") or (crop, crop)
    if ch:
        if ch > h or cw > w:
            raise LayerError(f"a {ch}x{cw} crop exceeds the {h}x{w} data")
        return c, ch, cw
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
        lines.append("random horizontal flips (mirror: true; Caffe flips in either phase, caffeq's eval does not)")
    if t.get("mean_file"):
        lines.append(f"subtract the per-pixel mean image {t['mean_file']!r} (cropped like the data)")
    if t.get("mean_value"):
        vals = ", ".join(f"{v:g}" for v in t["mean_value"])
        what = "from every channel" if len(t["mean_value"]) == 1 else "per channel, in blob order"
        lines.append(f"subtract mean_value [{vals}] {what}")
    if t.get("scale", 1.0) != 1.0:
        lines.append(f"multiply by scale {t['scale']:.9g} (after the mean subtraction)")
    return lines


def _mean_file_shape(attrs):
    """(C, H, W) of the transform's mean file when it exists, else None."""
    mean = attrs["transform"]["mean_file"]
    if not mean:
        return None
    path = resolve_source(mean, attrs.get("base_dir"))
    if not os.path.exists(path):
        return None
    return tuple(load_mean_file(path).shape)


def _channels_from_transform(t):
    if t["force_color"]:
        return 3
    if t["force_gray"]:
        return 1
    if len(t["mean_value"]) > 1:
        return len(t["mean_value"])   # Caffe requires one value per channel then
    return None


#: LRCN's lisa-caffe-public DataParameter fields: a Data layer that sets one reads video clips
_LISA_CLIP_FIELDS = ("clip_length", "clip_mode", "weight_loss", "clip_order", "LSTM_clip", "LSTM_clip_length",
                     "sLSTM", "batch_videos", "clip_collapse_labels", "clip_sub_sample", "max_train_item",
                     "max_test_item")


class DataLayer(Layer):
    is_data = True

    def infer(self, attrs, in_shapes):
        return self.top_shapes(attrs, {})

    def top_shapes(self, attrs, given):
        """Top shapes, `given` {top index: shape} by the user taking precedence."""
        data = given.get(0) or self.data_shape(attrs)
        shapes = [tuple(data)]
        if attrs["num_tops"] > 1:
            shapes.append(tuple(given.get(1) or (data[0],)))
        return shapes

    def guessed_label_tops(self, attrs, given):
        return (1,) if attrs["num_tops"] > 1 and 1 not in given else ()

    def data_shape(self, attrs):
        raise NotImplementedError

    def preprocessing(self, attrs):
        """Lines describing what Caffe does to the data before the net sees it."""
        lines = describe_transform(attrs.get("transform"))
        if not lines:
            lines = ["no transform_param: the stored values as they are"]
        return lines


@register_layer("Data")
class Data(DataLayer):
    def preprocessing(self, attrs):
        if attrs.get("input_shapes"):
            return ["none: an Input layer's blob, fed as it is (the layer is typed Data but gives input_param)"]
        lines = [(f"Datum records of {attrs['backend']} {attrs['source']!r} (convert_imageset "
                  f"stores OpenCV's BGR, 0-255 values)")]
        if attrs.get("lisa_clips"):
            lines.append("video clips, frame-major (LRCN's lisa-caffe-public: frames of batch_videos videos "
                         "interleaved; clip markers 0 at a clip's first frame, else 1)")
        if attrs.get("label_size"):
            lines.append(f"labels: each record's class ids (1-based) padded with 0 to {attrs['label_size']} "
                         f"(data_param.multi_label)")
        if attrs.get("nlp_vocab"):
            return lines + [f"nlpcaffe's word pairs: each Datum's int_data holds (word, next word) ids; a row per "
                            f"pair of {attrs['nlp_vocab'] + 1} values, the first id one-hot and the next id last "
                            f"(data_param.nlp, vocab_size {attrs['nlp_vocab']})"]
        return lines + describe_transform(attrs.get("transform"))

    def parse(self, lp):
        p = lp.data_param
        if not lp.HasField("data_param") and len(lp.input_param.shape):
            return self._as_input(lp)
        # no source is fine for reading (DIGITS writes its train_val nets without one and fills it in
        # when it trains): only the shapes that the dataset alone could tell need it; the same goes for
        # the batch size (Caffe needs one to train, an --input-shape replaces it)
        backend = "LMDB" if p.backend == 1 else "LEVELDB"
        lisa = len(lp.top) > 2 or any(p.HasField(f) for f in _LISA_CLIP_FIELDS)
        if lisa:
            need_blobs(lp, "Data (LRCN's lisa-caffe: data[, label[, clip_markers[, weight_loss]]])", 0, (1, 2, 3, 4))
            if p.batch_videos < 1 or p.batch_size % p.batch_videos:
                raise LayerError(f"data_param.batch_size {p.batch_size} must be divisible by batch_videos "
                                 f"{p.batch_videos}")
        if p.nlp and p.vocab_size < 1:
            raise LayerError("data_param.nlp needs a vocab_size >= 1 (nlpcaffe's word ids are checked against it)")
        return {"source": p.source, "batch_size": int(p.batch_size), "backend": backend, "lisa_clips": lisa,
                "transform": transform_attrs(lp), "num_tops": len(lp.top), "top": lp.top[0] if lp.top else "",
                "mirror_crop": bool(p.get_mirror_crop), "nlp_vocab": int(p.vocab_size) if p.nlp else 0,
                "label_size": int(p.label_size) if p.multi_label else 0}

    def _clip_top_shapes(self, attrs, given):
        """LRCN's lisa-caffe-public Data: the label, clip markers and loss weights are (batch_size, 1, 1, 1)."""
        if not attrs.get("lisa_clips"):
            return super().top_shapes(attrs, given)
        data = tuple(given.get(0) or self.data_shape(attrs))
        return [data] + [tuple(given.get(i) or (data[0], 1, 1, 1)) for i in range(1, attrs["num_tops"])]

    @staticmethod
    def _as_input(lp):
        """A "Data" layer that gives an input_param and no data_param (dgschwend/zynqnet's nets, written
        for its own tools): the shapes of an Input layer, as OpenCV's importer reads a Data layer."""
        shapes = input_param_shapes(lp)
        return {"input_shapes": shapes, "num_tops": len(lp.top), "tops": list(lp.top), "transform": transform_attrs(lp),
                "reading_notes": [f"typed Data but with input_param and no data_param: read as an Input layer of "
                                  f"shape {' and '.join(str(list(x)) for x in shapes)}"]}

    def top_shapes(self, attrs, given):
        if attrs.get("input_shapes"):
            return given_or_fixed(attrs, attrs["input_shapes"], given)
        shapes = self._clip_top_shapes(attrs, given)
        if attrs.get("mirror_crop") and len(shapes) > 1 and 1 not in given:   # JAANet's data_layer.cpp
            shapes[1] = (shapes[0][0], 4, 1, 1)
        if attrs.get("label_size") and len(shapes) > 1 and 1 not in given:   # caffe-cvpr17's multi_label
            shapes[1] = (shapes[0][0], attrs["label_size"], 1, 1)
        return shapes

    def guessed_label_tops(self, attrs, given):
        if attrs.get("input_shapes"):
            return ()
        return tuple(i for i in super().guessed_label_tops(attrs, given)
                     if not (i == 1 and (attrs.get("mirror_crop") or attrs.get("label_size"))))

    def data_shape(self, attrs):
        t = attrs["transform"]
        n = attrs["batch_size"]
        if n < 1:
            raise needs_input_shape(attrs, attrs["top"], f"data_param.batch_size must be >= 1, got {n}",
                                    "without a batch size")
        if attrs.get("nlp_vocab"):
            # nlpcaffe: (batch_size, pairs x (vocab_size + 1), 1, 1); its Datum's int_data (field 7) is BVLC's
            # `encoded` here, so the pair count is not read from the database
            raise needs_input_shape(attrs, attrs["top"], f"nlpcaffe's word pairs (data_param.nlp) are "
                                    f"(batch_size, pairs x {attrs['nlp_vocab'] + 1}, 1, 1), the pairs per record "
                                    f"stored in its database")
        c = _channels_from_transform(t)
        mean = _mean_file_shape(attrs)
        if mean is not None:
            c = c or mean[0]
        if t.get("siamese"):   # DataTransformer::InferBlobShape of caffe-master-jps++: the datum's channels per tile
            tiles, patch = t["siamese"]
            if patch < 1:
                raise LayerError(f"transform_param.siamese_size {tiles} needs a patch_size, got {patch}")
            if not c:
                source = resolve_source(attrs["source"], attrs.get("base_dir"))
                if not os.path.exists(source):
                    raise needs_input_shape(attrs, attrs["top"], f"{attrs['backend']} '{attrs['source']}' not found")
                c = datum_shape(source, attrs["backend"])[0]
            return (n, c * tiles, patch, patch)
        if c and t["crop_size"]:
            return (n, c, t["crop_size"], t["crop_size"])
        if c and mean is not None and not t["crop_size"]:
            return (n, c) + mean[1:]   # Caffe checks the mean file matches the data's size
        source = resolve_source(attrs["source"], attrs.get("base_dir"))
        if not os.path.exists(source):
            raise needs_input_shape(attrs, attrs["top"], f"{attrs['backend']} '{attrs['source']}' not found"
                                    if attrs["source"] else "data_param names no source")
        c0, h, w = datum_shape(source, attrs["backend"])
        c, h, w = _with_crop(attrs, c or c0, h, w)
        return (n, c, h, w)


@register_layer("ImageData")
class ImageData(DataLayer):
    def preprocessing(self, attrs):
        if attrs.get("labels_only"):
            return ["no image read (R-3CNN's reference: false): both tops are each list line's float label"]
        lines = [f"images read with OpenCV ({'BGR colour' if attrs['is_color'] else 'gray'}, 0-255 values)"]
        if attrs["new_height"] and attrs["new_width"]:
            lines.append(f"resized to {attrs['new_height']}x{attrs['new_width']} (height x width)")
        if attrs.get("new_dim"):
            lines.append(f"shorter side resized to {attrs['new_dim']}, aspect kept "
                         f"({'bicubic' if attrs['bicubic'] else 'bilinear'}, yihui-he/caffe-pro new_dim)")
        if len(attrs.get("smaller_side", ())) in (1, 2):
            lines.append("then scaled by {} / its shorter side both ways (bilinear, cvjena/caffe_pp2's "
                         "smaller_side_size)".format(" to ".join(map(str, attrs["smaller_side"]))))
        if attrs.get("min_size"):
            lines.append("an image smaller than {} x {} grown to it, aspect kept (bilinear, LRCN's min_height / "
                         "min_width)".format(*attrs["min_size"]))
        if attrs.get("gps"):
            lines.append("use_gps (hyojinie/crn): each list line gives a latitude and a longitude, tops 2 and 3 "
                         "(batch_size,), in place of a label")
        elif attrs.get("identities"):
            lines.append("batches of {} identities x {} images each (yuqj1991/caffe_train): tops data, the "
                         "identities, each image's identity".format(*attrs["identities"]))
        elif attrs.get("windows"):
            lines.append("junhyukoh/caffe-lstm 711ecdab windows: each image scaled by a random factor in [{}, {}] "
                         "(shrunk to fit), written at the top left of a zero {} x {} canvas; top 3 (batch_size, 7): "
                         "label, the scaled box ymin, xmin, ymax, xmax, the original height and width"
                         .format(*attrs["window_scales"], *attrs["windows"]))
        elif attrs["num_tops"] > 2:
            lines.append("a third top, clip markers (apsvvfb/caffe_qi, LRCN): the batch holds batch_size / 16 "
                         "clips of 16 consecutive frames, interleaved frame by frame; 0 at a clip's first frame, "
                         "else 1")
        return lines + describe_transform(attrs.get("transform"))

    def parse(self, lp):
        p = lp.image_data_param
        if not p.reference:   # RojunLin/R-3CNN: no image read, each line's float label in both tops
            need_blobs(lp, "ImageData with reference: false (R-3CNN's writes top[1] whatever the tops: label, label)",
                       0, 2)
            if p.batch_size < 1:
                raise LayerError(f"image_data_param.batch_size must be >= 1, got {p.batch_size}")
            return {"labels_only": True, "source": p.source, "batch_size": int(p.batch_size),
                    "num_tops": len(lp.top), "top": lp.top[0] if lp.top else "", "label_dim": 0,
                    "reading_notes": ["image_data_param.reference: false (RojunLin/R-3CNN): no image is read; both "
                                      "tops are each list line's float label, (batch_size,)"]}
        need_blobs(lp, "ImageData (tops data[, label[, clip_markers]])", 0, (1, 2, 3))
        if p.new_dim and (p.new_height or p.new_width):   # caffe-pro image_data_layer.cpp:38
            raise LayerError("image_data_param.new_dim and new_height/new_width cannot be set together")
        if (p.min_height > 0) != (p.min_width > 0):   # lisa-caffe-public image_data_layer.cpp's CHECK
            raise LayerError("image_data_param.min_height and min_width must be set together")
        identities, label_size, windows = None, 0, None
        if any(p.HasField(f) for f in ("window_h", "window_w", "max_windows_h", "max_windows_w")):
            # junhyukoh/caffe-lstm 711ecdab image_data_layer.cpp: data (N, C, max_windows_h * window_h,
            # max_windows_w * window_w) whatever the image, label (N,), box (N, 7)
            need_blobs(lp, "ImageData with windows (junhyukoh/caffe-lstm: tops data, label, box)", 0, 3)
            windows = (p.max_windows_h * p.window_h, p.max_windows_w * p.window_w)
            if not all(windows):
                raise LayerError(f"image_data_param: max_windows_h x window_h and max_windows_w x window_w must be "
                                 f"positive, got {windows[0]} and {windows[1]}")
        if p.HasField("label_size"):
            label_size = positive_field(p.label_size, "image_data_param.label_size")
        if p.HasField("label_num") and not p.HasField("sample_num") and len(lp.top) <= 2:
            # the 2016 multi-label ImageData (lhmRyan/DSH 9ce1188, label_num = 13 there): label_num labels a line,
            # the label top (N, label_num, 1, 1), as label_size; yuqj1991's identity batches have three tops
            if p.HasField("label_size") or p.HasField("label_dim"):
                raise LayerError("image_data_param: label_num (labels a line) with label_size or label_dim: give one")
            label_size = positive_field(p.label_num, "image_data_param.label_num")
        elif p.HasField("label_num") or p.HasField("sample_num"):   # yuqj1991/caffe_train's DataLayerSetUp CHECKs
            identities = (int(p.label_num), int(p.sample_num))
            if identities[0] * identities[1] != p.batch_size:
                raise LayerError(f"image_data_param.label_num x sample_num ({identities[0]} x {identities[1]}) "
                                 f"must equal batch_size ({p.batch_size})")
            need_blobs(lp, "ImageData with label_num / sample_num (tops data, label, sample labels)", 0, 3)
        return {"source": p.source, "batch_size": int(p.batch_size), "new_height": int(p.new_height),
                "new_width": int(p.new_width),
                "is_color": bool(p.images_in_color if p.HasField("images_in_color") else p.is_color),
                "new_dim": int(p.new_dim), "bicubic": bool(p.bicubic),
                "min_size": (int(p.min_height), int(p.min_width)) if p.min_height else None,
                "root_folder": p.root_folder, "shuffle": bool(p.shuffle),
                "smaller_side": tuple(int(v) for v in p.smaller_side_size),
                "label_dim": int(p.label_dim) if p.HasField("label_dim") else 0, "gps": bool(p.use_gps),
                "identities": identities,
                "label_size": label_size, "windows": windows,
                "window_scales": (float(p.min_scale), float(p.max_scale)),
                "transform": transform_attrs(lp), "num_tops": len(lp.top), "top": lp.top[0] if lp.top else "",
                # CamlinZ/face_alignment's ImageData resizes to new_height x new_width only when shuffling
                "own_size_unshuffled": p.HasField("rate_height") or p.HasField("rate_width")}

    def top_shapes(self, attrs, given):
        """The multi-label recipe's label_dim labels a line make the label (N, label_dim);
        imistyrain/caffe-multilabel-txt's label_size labels make it (N, label_size, 1, 1), as the 2016
        multi-label reader's label_num without sample_num (lhmRyan/DSH).
        apsvvfb/caffe_qi's (and LRCN's lisa-caffe-public's) ImageData gives a third top, the clip
        markers of its 16-frame clips, (batch_size,) as its DataLayerSetUp shapes it.  yuqj1991/caffe_train's
        gives the batch's identities (label_num,), then each image's identity (batch_size,)."""
        if attrs.get("labels_only"):
            return [tuple(given.get(i) or (attrs["batch_size"],)) for i in range(attrs["num_tops"])]
        shapes = super().top_shapes(attrs, given)
        if attrs.get("identities") and 1 not in given:
            shapes[1] = (attrs["identities"][0],)
        if attrs["label_dim"] and len(shapes) > 1 and 1 not in given:
            shapes[1] = (shapes[0][0], attrs["label_dim"])
        if attrs.get("label_size") and len(shapes) > 1 and 1 not in given:
            shapes[1] = (shapes[0][0], attrs["label_size"], 1, 1)
        if attrs["num_tops"] > 2:
            shapes.append(tuple(given.get(2) or ((shapes[0][0], 7) if attrs.get("windows") else (shapes[0][0],))))
        return shapes

    def guessed_label_tops(self, attrs, given):
        if attrs.get("labels_only"):
            return ()   # the fork's code shapes them (batch_size,)
        return () if attrs["label_dim"] or attrs.get("label_size") else super().guessed_label_tops(attrs, given)

    def data_shape(self, attrs):
        c = 3 if attrs["is_color"] else 1
        n = max(1, attrs["batch_size"])
        if attrs.get("windows"):   # junhyukoh/caffe-lstm: the window grid's size replaces the image's
            return (n, c) + attrs["windows"]
        crop = attrs["transform"]["crop_size"] or bool(attrs["transform"].get("crop_hw"))
        sides = attrs.get("smaller_side", ())
        scaled = len(sides) in (1, 2) and not crop   # cvjena's: scaled after the read, each image's own size
        if scaled and len(sides) == 2:
            raise needs_input_shape(attrs, attrs["top"], "smaller_side_size draws each image's shorter side at random")
        if attrs.get("own_size_unshuffled") and not attrs["shuffle"] and not crop:
            raise needs_input_shape(attrs, attrs["top"], "CamlinZ/face_alignment's ImageData (rate_height / "
                                    "rate_width) keeps each image's own size unless it shuffles")
        if attrs["new_height"] and attrs["new_width"] and not (attrs.get("own_size_unshuffled") and not attrs["shuffle"]):
            h, w = attrs["new_height"], attrs["new_width"]
        elif crop:
            return (n, c) + (attrs["transform"].get("crop_hw") or (crop, crop))
        else:
            source = resolve_source(attrs["source"], attrs.get("base_dir"))
            if not os.path.exists(source):
                raise needs_input_shape(attrs, attrs["top"], f"image list '{attrs['source']}' not found")
            h, w = first_image_shape(source, attrs["root_folder"], attrs.get("base_dir"))
            if attrs.get("new_dim") and not scaled:
                h, w = shorter_side_size((h, w), attrs["new_dim"])
            elif attrs.get("min_size") and not scaled:
                h, w = min_grown_size((h, w), *attrs["min_size"])
        if scaled:
            h, w = scaled_shorter_size((h, w), sides[0])
        c, h, w = _with_crop(attrs, c, h, w)
        return (n, c, h, w)


@register_layer("MemoryData")
class MemoryData(DataLayer):
    def parse(self, lp):
        p = lp.memory_data_param
        notes = [("memory_data_param.transpose: the fork's reader transposes each image it is given (rows "
                  "become columns); the blob stays (batch, channels, height, width): feed images transposed "
                  "as the fork's reader lays them out")] if p.transpose else []
        return {"batch_size": int(p.batch_size), "chw": (int(p.channels), int(p.height), int(p.width)),
                "dims": tuple(int(d) for d in p.dim), "transform": transform_attrs(lp), "num_tops": len(lp.top),
                "label_size": int(p.label_size), "reading_notes": notes}

    def data_shape(self, attrs):
        if attrs["dims"]:   # naibaf7/caffe's N-D form: the shape as given
            return attrs["dims"]
        c, h, w = _with_crop(attrs, *attrs["chw"])
        return (attrs["batch_size"], c, h, w)

    def top_shapes(self, attrs, given):
        shapes = super().top_shapes(attrs, given)
        if attrs["dims"] and len(shapes) > 1 and 1 not in given:
            # naibaf7/caffe labels an N-D batch (N, 1, ..., 1), one axis per data axis
            shapes[1] = (shapes[0][0],) + (1,) * (len(shapes[0]) - 1)
        elif attrs.get("label_size") and len(shapes) > 1 and 1 not in given:
            # xbpeng/DeepTerrainRL's MemoryData: label_size values per item, (batch_size, label_size, 1, 1)
            shapes[1] = (shapes[0][0], attrs["label_size"], 1, 1)
        if attrs["num_tops"] == 3:
            # DeepLab v2 memory readers (yilei0620's): a third top, each image's (height, width)
            shapes.append(tuple(given.get(2) or (shapes[0][0], 1, 1, 2)))
        return shapes

    def guessed_label_tops(self, attrs, given):
        return () if attrs.get("label_size") else super().guessed_label_tops(attrs, given)


@register_layer("WindowData")
class WindowData(DataLayer):
    def parse(self, lp):
        p = lp.window_data_param
        crop = int(p.crop_size) or int(lp.transform_param.crop_size)
        if not crop:
            raise LayerError("window_data_param.crop_size (or transform_param.crop_size) is required")
        return {"batch_size": int(p.batch_size), "crop": crop, "num_tops": len(lp.top),
                "transform": transform_attrs(lp)}

    def data_shape(self, attrs):
        return (attrs["batch_size"], 3, attrs["crop"], attrs["crop"])


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

    def guessed_label_tops(self, attrs, given):
        return ()   # every shape is written out


@register_layer("RandVec")
class RandVec(DataLayer):
    """AtlantixJJ/caffe's RandVec (randvec_layer.cpp 75094d8; its GAN generators' noise): no bottom, a
    (batch_size, dim, height, width) blob ((batch_size, dim) when height or width is 0) drawn from N(0, 2^2) at every forward, TEST included.  Random, so
    a graph input here: feed the noise."""

    def parse(self, lp):
        need_blobs(lp, "RandVec", 0, 1)
        p = lp.randvec_param
        if p.batch_size < 1 or p.dim < 1:
            raise LayerError(f"randvec_param: batch_size and dim must be >= 1, got {p.batch_size} and {p.dim}")
        # the fork's top is (batch_size, dim), with height x width after it only when both are > 0
        shape = (int(p.batch_size), int(p.dim)) + ((int(p.height), int(p.width)) if p.height > 0 and p.width > 0
                                                     else ())
        return {"shapes": [shape], "num_tops": 1,
                "reading_notes": ["RandVec (AtlantixJJ/caffe) draws N(0, 2^2) noise at every forward: a graph "
                                  "input here, fed the noise you choose"]}

    def top_shapes(self, attrs, given):
        return [tuple(given.get(0) or attrs["shapes"][0])]

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        return ["none: RandVec's noise, N(0, 2^2) in the fork (fed as given here)"]


def lgm_hdf5_transform(p):
    """WeitaoVan/L-GM-loss (598582f, src/caffe/layers/hdf5_data_layer.cpp; HDF5DataParameter 4-8 of its
    caffe.proto): as each HDF5 file loads, its first dataset's (N, C, H, W) rows are cropped to crop_size
    (the centre at TEST, (H - crop) / 2 in integer division), each channel has its mean_value (one, or one per
    channel) added negated, then is mirrored at random (mirror, at any phase), then multiplied by scale:
    Caffe's DataTransformer's crop, (x - mean) * scale, which is how eval applies it at TEST.  At TEST, mirror
    (or crop_num > 1) makes the fork emit several crops per row: not applied here (a note)."""
    t = {"scale": float(p.scale), "mirror": False, "crop_size": int(p.crop_size), "mean_file": None,
         "mean_value": [float(v) for v in p.mean_value], "force_color": False, "force_gray": False,
         "siamese": None, "crop_hw": None}
    notes = []
    if p.mirror or p.crop_num > 1:
        notes.append("HDF5Data (WeitaoVan/L-GM-loss): at TEST, crop_num > 1 or mirror with crop_size gives "
                     "crop_num (x 2 with mirror) crops per row, and mirror without crop_size flips rows at random; "
                     "eval applies the centre crop, mean_value and scale only")
    return {"transform": t, "reading_notes": notes}


@register_layer("HDF5Data")
class HDF5Data(DataLayer):
    def parse(self, lp):
        p = lp.hdf5_data_param
        attrs = {"source": p.source, "batch_size": int(p.batch_size), "tops": list(lp.top),
                 "num_tops": len(lp.top)}
        if any(p.HasField(f) for f in ("scale", "mirror", "crop_size", "crop_num")) or len(p.mean_value):
            attrs.update(lgm_hdf5_transform(p))
        return attrs

    def guessed_label_tops(self, attrs, given):
        return ()   # every top's shape comes from the HDF5 file or the user

    def top_shapes(self, attrs, given):
        if len(given) == len(attrs["tops"]):
            return [given[i] for i in range(len(attrs["tops"]))]
        missing = next(t for i, t in enumerate(attrs["tops"]) if i not in given)
        source = resolve_source(attrs["source"], attrs.get("base_dir"))
        if not os.path.exists(source):
            raise needs_input_shape(attrs, missing, f"HDF5 list '{attrs['source']}' not found")
        shapes = self.infer(attrs, [])
        return [given.get(i, s) for i, s in enumerate(shapes)]

    def infer(self, attrs, in_shapes):
        try:
            import h5py
        except ImportError:
            raise DataError(f"HDF5Data '{attrs['source']}': reading its shapes needs h5py "
                            f"(pip install h5py), or give them with --input-shape") from None
        source = resolve_source(attrs["source"], attrs.get("base_dir"))
        if not os.path.exists(source):
            raise needs_input_shape(attrs, attrs["tops"][0], f"HDF5 list '{attrs['source']}' not found")
        try:
            with open(source) as f:
                first = next((ln.strip() for ln in f if ln.strip()), None)
        except OSError as e:
            raise DataError(f"HDF5Data source '{source}': {e.strerror}") from None
        if first is None:
            raise DataError(f"HDF5Data source '{source}' lists no files")
        with h5py.File(resolve_source(first, os.path.dirname(source)), "r") as h5:
            shapes = [(attrs["batch_size"],) + tuple(h5[t].shape[1:]) for t in attrs["tops"]]
        crop = (attrs.get("transform") or {}).get("crop_size")
        if crop and len(shapes[0]) == 4:   # L-GM-loss's crop of the first top
            shapes[0] = shapes[0][:2] + (crop, crop)
        return shapes
