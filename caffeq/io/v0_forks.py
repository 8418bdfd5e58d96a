"""V0 dialects of forks, applied while a V0 layer is upgraded (upgrade.py calls these hooks).

- s9xie/DSN's dropout `mean_on_test`.
- ruixuejianfei/BitScalableDeepHash (its bundled 2013 Caffe, 3a9b658): a net of this fork is told by its own
  fields (img_files, cropsize_h / cropsize_w, sigm_para, laplacian_beta) or types (elewise_product,
  euclidean_triplet_loss).  In such a net the data layer with img_files is its triplet image reader, and
  "sigmoid" is its own 2 / (1 + exp(-sigm_para x)) - 1, not the logistic (caffeq/layers/bsdh.py).
"""

#: BitScalableDeepHash's own V0 types -> the V1 fork type names they upgrade to
BSDH_TYPES = {"elewise_product": "ELEWISE_PRODUCT", "euclidean_triplet_loss": "EUCLIDEAN_TRIPLET_LOSS"}
_BSDH_MARKS = ("img_files", "cropsize_h", "cropsize_w", "sigm_para", "laplacian_beta", "class_per_iter",
               "triplet_per_class", "loss_threshold")


def is_bsdh_net(entries):
    """Whether V0 entries (V1 wrappers of V0 layers) are a BitScalableDeepHash net."""
    for entry in entries:
        v0 = entry.layer
        if v0.type in BSDH_TYPES or any(v0.HasField(f) for f in _BSDH_MARKS):
            return True
    return False


def bsdh_ignored_fields(vtype):
    """V0 fields this fork's layers never read: its 2013 conv has no pad (a separate padding layer pads)."""
    return ("pad",) if vtype == "conv" else ()


def bsdh_fork_type(v0, vtype):
    """The V1 fork type of a BitScalableDeepHash layer, or None where it is Caffe's own."""
    if vtype in BSDH_TYPES:
        return BSDH_TYPES[vtype]
    if vtype == "data" and v0.HasField("img_files"):
        return "BSDH_TRIPLET_DATA"
    if vtype == "sigmoid":
        return "BSDH_SIGMOID"
    return None


def fill_bsdh_param(v0, vtype, out):
    """Carry the fork's fields of the data layer and the sigmoid into bsdh_param."""
    p = out.bsdh_param
    if out.fork_type == "BSDH_TRIPLET_DATA":
        p.img_files, p.source = v0.img_files, v0.source
        p.batch_size, p.crop_size, p.scale = v0.batchsize, v0.cropsize, v0.scale
        if v0.cropsize:   # a flag there: without it the top takes the first image's size
            p.crop_h = v0.cropsize_h if v0.HasField("cropsize_h") else v0.cropsize
            p.crop_w = v0.cropsize_w if v0.HasField("cropsize_w") else v0.cropsize
        if v0.HasField("meanfile"):
            p.mean_file = v0.meanfile
        p.class_per_iter, p.triplet_per_class = v0.class_per_iter, v0.triplet_per_class
        p.img_counts_per_class_per_iter = v0.img_counts_per_class_per_iter
    elif out.fork_type == "BSDH_SIGMOID":
        p.sigm_para = v0.sigm_para


def upgrade_dsn_dropout(v0, vtype, out, where, notes):
    """s9xie/DSN's dropout (dropout_layer.cpp): kept units are never scaled up in training, and with
    mean_on_test (its default) TEST multiplies by 1 - dropout_ratio: Faster R-CNN's `scale_train: false`.
    A file that sets the field is DSN's; without it nothing tells DSN's nets from BVLC's."""
    if vtype != "dropout" or not v0.HasField("mean_on_test"):
        return
    out.dropout_param.scale_train = False
    if not v0.mean_on_test:
        notes.append(f"{where}: layer '{v0.name}': DSN's dropout with mean_on_test false drops units at random "
                     f"at TEST too; read as its expectation, x * (1 - dropout_ratio)")


__all__ = ["BSDH_TYPES", "bsdh_fork_type", "bsdh_ignored_fields", "fill_bsdh_param", "is_bsdh_net", "upgrade_dsn_dropout"]
