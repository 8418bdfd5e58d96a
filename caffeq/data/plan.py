"""What eval, finetune and sensitivity read: the net's data layer, its source, transform and blobs,
planned without opening the dataset, and the dataset built from a plan."""
import os
from dataclasses import dataclass, field

from ..errors import DataError
from . import DataTransformer, Preprocess, detect_kind, open_dataset

TRANSFORM_KEYS = ("scale", "mean_file", "mean_value", "crop_size", "mirror", "force_color", "force_gray")
EVAL_DATA_LAYERS = ("Data", "ImageData", "HDF5Data")   # the data layers eval reads itself


@dataclass
class DataPlan:
    source: str
    kind: str
    batch_size: int
    transformer: DataTransformer
    data_blob: str
    label_blob: str = None
    layer: str = None               # the data layer it came from
    image: dict = field(default_factory=dict)   # root_folder, new_height, new_width, is_color
    resize: tuple = None
    channel_order: str = "BGR"
    roots: list = field(default_factory=list)   # where relative image paths are looked up
    notes: list = field(default_factory=list)


@dataclass
class LayerInfo:
    """A TEST-phase Data/ImageData layer: from a loaded graph node or straight from the prototxt."""
    type: str
    name: str
    tops: list
    attrs: dict


def data_layer(model):
    """The net's (TEST-phase) Data, ImageData or HDF5Data layer as a LayerInfo, or None for a deploy net."""
    for node in model.graph.nodes:
        if node.spec.is_data and node.type in EVAL_DATA_LAYERS:
            return LayerInfo(node.type, node.name, list(node.tops), node.attrs)
    return None


def phase_data_layer(net, phase, source, base_dir):
    """(LayerInfo, LayerParameter) of the net's Data/ImageData layer in `phase`, or (None, None).

    Its source is not opened.
    """
    from ..ir import filter_layers
    from ..layers import get_spec
    from ..layers.registry import LayerError
    for lp in filter_layers(net, phase, source=source):
        if lp.type in EVAL_DATA_LAYERS:
            try:
                attrs = get_spec(lp.type).parse(lp)
            except LayerError as e:
                raise LayerError(f"{source}: layer '{lp.name}' ({lp.type}): {e}") from None
            attrs["base_dir"] = base_dir
            return LayerInfo(lp.type, lp.name, list(lp.top), attrs), lp
    return None, None


def parse_resize(value):
    """'256x256', '256,256' or '256' -> (height, width)."""
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    text = str(value).lower().replace(",", "x")
    try:
        parts = [int(p) for p in text.split("x")]
    except ValueError:
        raise DataError(f"--resize {value!r}: expected HEIGHTxWIDTH, e.g. 256x256") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) < 1:
        raise DataError(f"--resize {value!r}: expected HEIGHTxWIDTH with positive sizes")
    return tuple(parts)


# fork data layers whose records or tops are not an image and its label, which eval reads:
# (layer type, the attribute that says so, why eval refuses; {value} is the attribute's value)
_MULTI_LABEL_LIST = ("its list lines hold {value} labels each (a multi-label fork's image_data_param); eval reads one "
                     "label per line")
_NOT_IMAGE_AND_LABEL = (
    ("ImageData", "label_dim", _MULTI_LABEL_LIST),
    ("ImageData", "label_size", _MULTI_LABEL_LIST),
    ("ImageData", "labels_only", "image_data_param.reference: false (RojunLin/R-3CNN) makes it a list of float "
                                 "labels, no images; eval reads images"),
    ("ImageData", "identities", "label_num / sample_num make its source a list of identity folders "
                                "(yuqj1991/caffe_train); eval reads a list of images, one label each"),
    ("Data", "label_size", "data_param.multi_label gives each record's class ids, {value} per item; eval reads one "
                           "label per record"),
    ("Data", "nlp_vocab", "data_param.nlp makes each record nlpcaffe's one-hot word pairs, not an image and a label; "
                          "eval reads images"),
    ("Data", "mirror_crop", "get_mirror_crop makes its second top each image's mirror and crop record (JAANet), not a "
                            "label; eval reads labels"),
)


def plan_data(layer, inputs, base_dir, data=None, batch_size=None, transform=None, resize=None,
              channel_order=None, kind=None, prototxt=None):
    """Source, batch size, transform and blobs from the net's data layer (a LayerInfo, or None
    for a deploy net with `inputs` {blob: shape}) and the overrides."""
    from ..layers.data import resolve_source
    transform = {k: v for k, v in (transform or {}).items() if v is not None}
    unknown = set(transform) - set(TRANSFORM_KEYS)
    if unknown:
        raise DataError(f"unknown transform option(s) {sorted(unknown)}; expected {list(TRANSFORM_KEYS)}")
    notes = []
    image = {}
    if layer is not None:
        attrs = layer.attrs
        t = dict(attrs.get("transform") or {})     # HDF5Data has no transform_param
        if t.get("mean_file"):
            t["mean_file"] = resolve_source(t["mean_file"], base_dir)
        data_blob = layer.tops[0]
        label_blob = layer.tops[1] if len(layer.tops) > 1 else None
        if data is None:
            source = resolve_source(attrs["source"], base_dir)
            if not os.path.exists(source):
                raise DataError(f"layer '{layer.name}' ({layer.type}): source '{attrs['source']}' not found "
                                f"(looked in {base_dir} and {os.getcwd()}); pass --data")
            roots = [base_dir, os.getcwd()]
        else:
            source = os.fspath(data)
            roots = [os.getcwd(), base_dir]
        layer_bs = attrs.get("batch_size") or None
        if t.get("crop_hw"):
            raise DataError(f"layer '{layer.name}': transform_param crop_size_h / crop_size_w (Person-Re-ID's "
                            f"rectangular crop) are not applied by eval; evaluate its deploy net on images cropped to "
                            f"{t['crop_hw'][0]}x{t['crop_hw'][1]}")
        for layer_type, key, why in _NOT_IMAGE_AND_LABEL:
            if layer.type == layer_type and attrs.get(key):
                raise DataError(f"layer '{layer.name}' ({layer_type}): " + why.format(value=attrs[key]))
        if layer.type == "ImageData":
            image = {"root_folder": attrs.get("root_folder", ""), "new_height": attrs.get("new_height", 0),
                     "new_width": attrs.get("new_width", 0), "is_color": attrs.get("is_color", True),
                     "new_dim": attrs.get("new_dim", 0), "bicubic": attrs.get("bicubic", False),
                     "min_size": attrs.get("min_size"), "smaller_side": attrs.get("smaller_side", ())}
            if attrs.get("shuffle"):
                notes.append(f"layer '{layer.name}': shuffle ignored (the evaluation reads in list order)")
        layer_name = layer.name
    else:
        if data is None:
            raise DataError(f"{prototxt or 'the model'}: a deploy net (no TEST-phase Data/ImageData "
                            f"layer); pass the data to evaluate (--data)")
        names = list(inputs)
        if len(names) != 1:
            raise DataError(f"the net has {len(names)} inputs {names}; eval feeds one image blob "
                            f"(use a net with one input, or a train_val net with a Data layer)")
        data_blob, label_blob, layer_bs, layer_name = names[0], None, None, None
        source = os.fspath(data)
        roots = [os.getcwd(), base_dir]
        t = {}
    # flags replace the layer's values; a mean of one kind replaces the other kind
    if "mean_file" in transform:
        t.pop("mean_value", None)
    if "mean_value" in transform:
        t.pop("mean_file", None)
    t.update(transform)
    if t.get("mirror"):
        notes.append("mirror ignored at TEST (Caffe would flip at random; the evaluation stays deterministic)")
    transformer = DataTransformer(scale=t.get("scale", 1.0), mean_file=t.get("mean_file"),
                                  mean_value=t.get("mean_value") or (), crop_size=t.get("crop_size", 0) or 0,
                                  mirror=t.get("mirror", False), force_color=t.get("force_color", False),
                                  force_gray=t.get("force_gray", False), phase="TEST")
    if layer is None and transformer.is_identity:
        notes.append("no mean or scale given: the net sees raw pixel values (see --mean-file, --mean-value, "
                     "--scale)")
    if not image:
        if t.get("force_color") or t.get("force_gray"):
            is_color = bool(t.get("force_color"))
        elif layer is not None:
            is_color = None      # a Data layer decodes images natively (DecodeDatumToCVMatNative)
        else:
            shape = inputs.get(data_blob)
            is_color = not (shape is not None and len(shape) > 1 and shape[1] == 1)
        image = {"is_color": is_color}
    if not kind and layer is not None and layer.type == "HDF5Data":
        kind = "hdf5"
    kind = kind or detect_kind(source)
    bs = int(batch_size or layer_bs or 64)
    if bs < 1:
        raise DataError(f"--batch-size must be >= 1, got {bs}")
    return DataPlan(source=source, kind=kind, batch_size=bs, transformer=transformer, data_blob=data_blob,
                    label_blob=label_blob, layer=layer_name, image=image, resize=parse_resize(resize),
                    channel_order=(channel_order or "BGR").upper(), roots=roots, notes=notes)


def build_dataset(plan, limit=None, defer_normalize=True, seed=0):
    pre = Preprocess(plan.transformer, plan.channel_order, defer_normalize=defer_normalize, seed=seed)
    t = plan.transformer
    img = plan.image
    if plan.kind == "image_list":
        from . import ImageListDataset
        nh, nw = img.get("new_height", 0), img.get("new_width", 0)
        if not (nh or nw or img.get("new_dim")) and plan.resize:
            nh, nw = plan.resize
        return ImageListDataset(plan.source, pre, root_folder=img.get("root_folder", ""), new_height=nh,
                                new_width=nw, is_color=img.get("is_color", True), roots=plan.roots,
                                limit=limit, new_dim=img.get("new_dim", 0), bicubic=img.get("bicubic", False),
                                min_size=img.get("min_size"), smaller_side=img.get("smaller_side", ()))
    if plan.kind == "hdf5":
        from . import Hdf5Dataset
        # Caffe's HDF5Data applies no transform (items may be any rank); flags still apply
        return Hdf5Dataset(plan.source, plan.data_blob, plan.label_blob, None if t.is_identity else pre,
                           limit, roots=plan.roots)
    return open_dataset(plan.source, plan.kind, pre, limit, is_color=img.get("is_color", True),
                        force_color=t.force_color, force_gray=t.force_gray, resize=plan.resize)


PROBE_ITEMS = 16   # items read to learn the data's shape before a run


def probe_items(dataset, expected, plan):
    """The shape of the first readable item (of the first PROBE_ITEMS); fail early, with a hint, when
    the items cannot fit the net's input (`expected`, C x H x W, or None when the net takes any).

    eval and convert --calibrate share it, so that a size mismatch reads the same in both."""
    if len(dataset) == 0:
        raise DataError(f"{plan.source}: no items (the data source is empty)")
    first_err = None
    for i in range(min(len(dataset), PROBE_ITEMS)):
        _, img, _, err = dataset[i]
        if err is not None:
            first_err = first_err or err
            continue
        if expected is not None and tuple(img.shape) != tuple(expected):
            raise DataError(f"{plan.source}: items are {'x'.join(map(str, img.shape))} after preprocessing "
                            f"but the net's input '{plan.data_blob}' takes {'x'.join(map(str, expected))}; "
                            f"set --resize HxW / --crop-size (or the channel count: force_color/force_gray)")
        return tuple(img.shape)
    if first_err is not None:
        raise DataError(f"{plan.source}: none of the first {min(len(dataset), PROBE_ITEMS)} items can be read; "
                        f"the first: {first_err}")
    if expected is None:
        raise DataError(f"{plan.source}: no readable items")
    return tuple(expected)


def as_input_layer(lp, shapes):
    """Turn a data layer into an Input layer with these top shapes (its name, tops and phase rules kept)."""
    include = [type(r)() for r in lp.include]
    for new, old in zip(include, lp.include):
        new.CopyFrom(old)
    name, tops = lp.name, list(lp.top)
    lp.Clear()
    lp.name, lp.type = name, "Input"
    lp.top.extend(tops)
    for r in include:
        lp.include.add().CopyFrom(r)
    for shape in shapes:
        lp.input_param.shape.add().dim.extend(int(d) for d in shape)
