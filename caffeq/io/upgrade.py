"""Upgrade legacy Caffe nets to the current (V2) format, by BVLC Caffe's rules.

Caffe (src/caffe/util/upgrade_proto.cpp, UpgradeNetAsNeeded) applies, in order:
  1. V0 -> V1: `layers { layer { type: "conv" ... } }`; padding layers fold
     into the conv/pool layer that reads them;
  2. deprecated transform fields of V1 data layers -> transform_param;
  3. V1 -> V2: `layers { type: CONVOLUTION }` -> `layer { type: "Convolution" }`,
     blobs_lr / weight_decay / param / blob_share_mode -> ParamSpec;
  4. `input:` + `input_dim:` / `input_shape:` headers -> one Input layer;
  5. three-ParamSpec BatchNorm layers get lr_mult = decay_mult = 0.
We do the same, in place, and return short notes saying what changed.
Where Caffe would abort (LOG(FATAL)/CHECK) we raise ParseError naming the
file; where Caffe only logs an error and carries on, we carry on and say so
in a note.

`weights` is read_caffemodel's {layer name: [BlobData]}: layers that the
upgrade renames or removes are re-keyed / dropped so the dict keeps matching
the net's layer names.
"""
from ..errors import ParseError
from .coord_maps import resolve_auto_crops, resolve_coord_map_crops
from .schema import caffe_pb2
from .v0_forks import bsdh_fork_type, bsdh_ignored_fields, fill_bsdh_param, is_bsdh_net, upgrade_dsn_dropout

_ALL = "*"  # route a V0 field whatever the layer type

# V0 type name -> V1 enum name (UpgradeV0LayerType)
_V0_TYPES = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION",
    "data": "DATA", "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN", "hdf5_data": "HDF5_DATA", "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL", "images": "IMAGE_DATA", "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT", "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS", "pool": "POOLING",
    "relu": "RELU", "sigmoid": "SIGMOID", "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT", "tanh": "TANH", "window_data": "WINDOW_DATA",
}

# SPP_net's V0 dialect (ShaoqingRen/SPP_net model-defs, 2014): "inner_product" for "innerproduct",
# and whole V1 parameter messages inside the V0 layer; V0 field -> V1 field, applied after the flat
# fields (the message is the more specific).
_V0_TYPE_SPELLINGS = {"inner_product": "innerproduct"}
# V0 types of Min Lin's NIN Caffe and s9xie/DSN (065e498 layer_factory.cpp) that no V1 enum names: the
# V1 fork type they are read as (cccp: a grouped 1 x 1 convolution; the hinge losses only train)
_V0_FORK_TYPES = {"cccp": "CCCP", "squaredhingeloss": "SQUARED_HINGE_LOSS", "hingeloss": "HINGE_LOSS"}
_V0_MESSAGES = (("conv_param", "convolution_param"), ("lrn_param", "lrn_param"), ("pool_param", "pooling_param"),
                ("inner_product_param", "inner_product_param"), ("dropout_param", "dropout_param"),
                ("concat_param", "concat_param"))

# V0 type -> the V1 message that its own fields move into
_V0_PARAMS = {"conv": "convolution_param", "cccp": "convolution_param", "innerproduct": "inner_product_param",
              "elewise_product": "inner_product_param", "pool": "pooling_param",
              "dropout": "dropout_param", "lrn": "lrn_param", "concat": "concat_param", "data": "data_param",
              "hdf5_data": "hdf5_data_param", "images": "image_data_param", "window_data": "window_data_param",
              "infogain_loss": "infogain_loss_param", "hdf5_output": "hdf5_output_param"}
# V0 fields whose V1 name differs (det_* lose their prefix); hdf5_output_param is the whole message
_V0_RENAMED = {"biasterm": "bias_term", "kernelsize": "kernel_size", "meanfile": "mean_file",
               "batchsize": "batch_size", "cropsize": "crop_size", "shuffle_images": "shuffle",
               "hdf5_output_param": None}
_CONV_IP, _CONV_POOL, _LRN, _IMAGES, _WINDOW = ("conv", "innerproduct", "cccp"), ("conv", "pool"), ("lrn",), ("images",), \
    ("window_data",)
_DATA_LAYERS = ("data", "hdf5_data", "images", "window_data")
_CONV_IP_PRODUCT = _CONV_IP + ("elewise_product",)   # BitScalableDeepHash's elewise_product: an inner product's fields
# V0 field -> the V0 types that carry it (_ALL: any type, into transform_param), in Caffe's order.
# A V0 field set on a type not listed is dropped with a note (Caffe logs an error).
_V0_ROUTES = {
    "num_output": _CONV_IP_PRODUCT, "biasterm": _CONV_IP_PRODUCT, "weight_filler": _CONV_IP_PRODUCT,
    "bias_filler": _CONV_IP_PRODUCT,
    "pad": _CONV_POOL, "kernelsize": _CONV_POOL, "group": ("conv", "cccp"), "stride": _CONV_POOL,
    "pool": ("pool",), "dropout_ratio": ("dropout",),
    "local_size": _LRN, "alpha": _LRN, "beta": _LRN, "k": _LRN,
    "source": _DATA_LAYERS + ("infogain_loss",), "scale": _ALL, "meanfile": _ALL, "batchsize": _DATA_LAYERS,
    "cropsize": _ALL, "mirror": _ALL, "rand_skip": ("data", "images"),
    "shuffle_images": _IMAGES, "new_height": _IMAGES, "new_width": _IMAGES, "concat_dim": ("concat",),
    "det_fg_threshold": _WINDOW, "det_bg_threshold": _WINDOW, "det_fg_fraction": _WINDOW,
    "det_context_pad": _WINDOW, "det_crop_mode": _WINDOW,
    "hdf5_output_param": ("hdf5_output",),
}


def _v0_route(field, vtype):
    """(V1 sub-message, field or None for the whole message) where a V0 field of this type goes, or None."""
    types = _V0_ROUTES[field]
    if types == _ALL:
        sub_name = "transform_param"
    elif vtype in types:
        sub_name = _V0_PARAMS[vtype]
    else:
        return None
    return sub_name, _V0_RENAMED.get(field, field.removeprefix("det_"))


# V1 data layers whose own params carried transform fields before transform_param existed
_DATA_TRANSFORM_PARAMS = {"DATA": "data_param", "IMAGE_DATA": "image_data_param",
                          "WINDOW_DATA": "window_data_param"}
_V2_DATA_TRANSFORM_PARAMS = {"Data": "data_param", "ImageData": "image_data_param",
                             "WindowData": "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

# V1 enum name -> V2 type string (UpgradeV1LayerType)
V1_TYPE_STRINGS = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData", "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise",
    "EXP": "Exp", "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col", "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence",
    "SOFTMAX": "Softmax", "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice",
    "TANH": "TanH", "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

# V1 enum names that forks added (proto/README.md) -> the type string of caffeq's spec for that
# fork's layer.  These forks are V1-only, so the strings are caffeq's; each names the fork's layer
# as the later V2 forks did where one exists (BN, Unpooling, ImageSegData, Interp).
_V1_FORK_TYPES = {
    # HyeonwooNoh/caffe (DeconvNet)
    "CROP": "CoordMapCrop", "ELTWISE_ACCURACY": "EltwiseAccuracy", "UNPOOLING": "Unpooling",
    "BN": "BN", "RED_SOFTMAX_LOSS": "RedSoftmaxWithLoss", "RED_ACCURACY": "RedAccuracy",
    "IMAGE_SEG_DATA": "ImageSegData", "WINDOW_SEG_DATA": "WindowSegData",
    "WINDOW_INST_SEG_DATA": "WindowInstSegData", "BIN_ACCURACY": "BinaryAccuracy",
    "WINDOW_CLS_DATA": "WindowClsData", "WINDOW_SEG_BINARY": "WindowSegBinary",
    "SELECT_SEG_BINARY": "SelectSegBinary", "DROPOUT_CHANNEL": "DropoutChannel",
    # TheLegendAli/DeepLab-Context (DeepLab v1)
    "SEG_ACCURACY": "SegAccuracy", "INTERP": "Interp", "PADDING": "Padding", "MAT_WRITE": "MatWrite",
    "MAT_READ": "MatRead", "DENSE_CRF": "DenseCRF", "DOMINANT_CHANNEL": "DominantChannel",
    "BIAS_CHANNEL": "BiasChannel", "UNIQUE_LABEL": "UniqueLabel", "CENSOR_LABEL": "CensorLabel",
    "ADAPTIVE_BIAS_CHANNEL": "AdaptiveBiasChannel", "CHANNEL_AGGREGATOR": "ChannelAggregator",
    "IGNORE_OVERLAY": "IgnoreOverlay", "HISTOGRAM": "Histogram", "RELATIVE_ERROR": "RelativeError",
    "GAIN_CHANNEL": "GainChannel", "ONEHOT": "OneHot",
    # facebookarchive/C3D, C3D-v1.0 (its VIDEO_DATA reads image_data_param, unlike the V2 forks'
    # VideoData layers, hence its own name)
    "CONVOLUTION3D": "Convolution3D", "POOLING3D": "Pooling3D", "VOLUME_DATA": "VolumeData",
    "VIDEO_DATA": "C3DVideoData", "DECONVOLUTION3D": "Deconvolution3D",
    "VIDEO_SEGMENTATION_DATA": "VideoSegmentationData", "VOXEL_SOFTMAX": "VoxelSoftmax",
    "VOXEL_SOFTMAX_LOSS": "VoxelSoftmaxLoss", "VIDEO_WITH_VOXEL_TRUTH_DATA": "VideoWithVoxelTruthData",
    "VOXEL_CUSTOM_LOSS": "VoxelCustomLoss", "DOWN_SAMPLING": "DownSampling",
    # torrvision/crfasrnn caffe-crfrnn (CRF-RNN)
    "MULTI_STAGE_MEANFIELD": "MultiStageMeanfield",
    # dsisds/caffe-SPPNet
    "SPATIAL_PYRAMID_POOLING": "SpatialPyramidPooling",
    # liuxianming/caffe_feedback: ReLU with a feedback gate that every ordinary forward resets to 1
    "RELUPLUS": "ReLUPlus",
    # LRCN's lisa-caffe-public (its LSTM reads lstm_param; caffeq/layers/recurrent.py)
    "LSTM": "LSTM", "LSTM_UNIT": "LSTMUnit", "REDUCTION": "Reduction",
    # akanazawa/si-convnet (caffeq/layers/si_convnet.py; CCCP is NIN's, as V0's "cccp" reads)
    "UP": "Up", "DOWNPOOL": "Downpool", "TIEDCONV": "Tiedconv", "TICONV": "Ticonv", "CCCP": "Cccp",
    "PIXEL_ACCURACY": "PixelAccuracy",
    # Robert0812/deepsaldet caffe-sal (caffeq/layers/deepsaldet.py)
    "MCWINDOW_DATA": "MCWindowData", "NAMCWINDOW_DATA": "NAMCWindowData",
}
V1_TYPE_STRINGS.update(_V1_FORK_TYPES)

# Every `*_param` of V1LayerParameter has a same-named LayerParameter field;
# Caffe copies exactly these.
_V1_SUBPARAMS = tuple(f.name for f in caffe_pb2.V1LayerParameter.DESCRIPTOR.fields   # the ones V2 layers carry too
                      if f.name.endswith("_param") and f.name in caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name)


def _where(source):
    return source or "<net>"


def net_needs_upgrade(net):
    """True when upgrade_net would change anything (Caffe's NetNeedsUpgrade)."""
    return (len(net.layers) > 0 or len(net.input) > 0 or _needs_data_upgrade(net)
            or _needs_batchnorm_upgrade(net))


def upgrade_net(net, source="", weights=None, keep_shapeless_inputs=False):
    """Upgrade a NetParameter in place as Caffe's UpgradeNetAsNeeded does.

    source names the file in errors and notes; weights ({layer name: [blobs]})
    is kept consistent with any layer renames/removals. Returns notes ([str]).
    keep_shapeless_inputs: `input:` names without dims that layers read become an Input layer
    without a shape (given by --input-shape) instead of being dropped as Caffe drops them.
    """
    where = _where(source)
    if len(net.layer) and len(net.layers):
        # Caffe refuses this mix (UpgradeV1Net LOG(FATAL)); V0 would silently drop `layer`
        raise ParseError(f"{where}: defines both 'layer' (current format) and 'layers' (legacy "
                         f"V0/V1 format) fields; Caffe refuses to upgrade such a net: convert "
                         f"the 'layers' entries to 'layer {{ type: \"...\" }}' by hand")
    notes = []
    if any(lp.HasField("layer") for lp in net.layers):
        _upgrade_v0(net, where, weights, notes)
    if _needs_data_upgrade(net):
        moved = _upgrade_data_transformation(net)
        notes.append(f"moved deprecated transform fields of {moved} data layer(s) into transform_param")
    if len(net.layers):
        count = _upgrade_v1(net, where, notes)
        notes.append(f"upgraded {count} V1 'layers' entries to V2 'layer' definitions")
        if any(lp.type == "CoordMapCrop" for lp in net.layer):
            resolve_coord_map_crops(net, where, notes)
    if any(lp.type == "AutoCrop" for lp in net.layer):
        resolve_auto_crops(net, where, notes)
    if any(lp.type == "Warp" for lp in net.layer) and any(lp.type == "Grid" for lp in net.layer):
        _mark_coordinate_warps(net, notes)
    if any(lp.type == "ROIWarping" for lp in net.layer):
        _mark_mnc_fork_warps(net, notes)
    if any(lp.type == "Threshold" for lp in net.layer):
        _mark_bireal_thresholds(net, notes)
    if len(net.input):
        _upgrade_input(net, where, notes, keep_shapeless_inputs)
    if _needs_batchnorm_upgrade(net):
        count = _upgrade_batchnorm(net)
        notes.append(f"set lr_mult and decay_mult to 0 in the 3 param specs of {count} "
                     f"BatchNorm layer(s) (statistics are not learned)")
    _warn_v2_data_fields(net, where, notes)
    return notes


def _mark_coordinate_warps(net, notes):
    """Two forks name their layer "Warp": PWC-Net's reads a flow, LiteFlowNet's absolute coordinates,
    which its nets make by adding a Grid's pixel positions to the flow.  A Warp whose second bottom is
    a Grid's top, or the top of a layer reading one (LiteFlowNet's Eltwise sum), is LiteFlowNet's:
    mark it with caffeq's warp_param.absolute_coords (unless the layer says either way)."""
    writer = {}             # blob -> the layer that last wrote it
    grid_tops = set()
    marked = []
    for lp in net.layer:
        if lp.type == "Warp" and len(lp.bottom) == 2 and not lp.HasField("warp_param"):
            maker = writer.get(lp.bottom[1])
            if maker is not None and (maker.type == "Grid" or any(b in grid_tops for b in maker.bottom)):
                lp.warp_param.absolute_coords = True
                marked.append(lp.name)
        for top in lp.top:
            writer[top] = lp
            if lp.type == "Grid":
                grid_tops.add(top)
            else:
                grid_tops.discard(top)
    if marked:
        notes.append(f"read {len(marked)} Warp layer(s) ('{marked[0]}'{', ...' if len(marked) > 1 else ''}) "
                     f"as LiteFlowNet's: their coordinates come from a Grid")


MNC_FORK_MODULES = "multitask_network_cascades."


def _mark_mnc_fork_warps(net, notes):
    """caffe-mnc's ROIWarping has two forwards that no field tells apart (caffeq/layers/mnc.py).
    delftrobotics-forks/MNC, whose Python layers live under 'multitask_network_cascades.', pinned
    caffe-mnc 7a28ed65 while its nets used the ROIWarping type: mark its ROIWarping layers with
    caffeq's roi_warping_param.design MAX_OF_SAMPLES (unless the layer says either way)."""
    if not any(lp.type == "Python" and lp.python_param.module.startswith(MNC_FORK_MODULES) for lp in net.layer):
        return
    marked = []
    for lp in net.layer:
        if lp.type == "ROIWarping" and not lp.roi_warping_param.HasField("design"):
            lp.roi_warping_param.design = caffe_pb2.ROIWarpingParameter.MAX_OF_SAMPLES
            marked.append(lp.name)
    if marked:
        notes.append(f"read {len(marked)} ROIWarping layer(s) ('{marked[0]}'{', ...' if len(marked) > 1 else ''}) "
                     f"as caffe-mnc 7a28ed65's (the max over samples across each bin): the net's Python layers "
                     f"are delftrobotics-forks/MNC's, which ran that caffe-mnc")


BIREAL_TYPES = ("BinaryConvolutionTrain", "lClip")


def _mark_bireal_thresholds(net, notes):
    """Bi-Real-net's Caffes (caffeq/layers/bireal.py) change Threshold to give -1 where BVLC's gives 0,
    with the same text.  A net with their BinaryConvolutionTrain or lClip layers is theirs; so is one
    where a Threshold feeds a BinaryConvolution that sets neither HWGQ's binary_convolution_param nor
    caffe-zz's debug_param (their test Caffe's layer, which scales by the channel's mean |w|).  In such a
    net every Threshold gets caffeq's threshold_param.below_value -1 (unless the layer sets it) and every
    such BinaryConvolution use_alpha."""
    def plain_binary(lp):
        return lp.type == "BinaryConvolution" and not lp.HasField("binary_convolution_param") \
            and not lp.HasField("debug_param")
    writer, theirs = {}, any(lp.type in BIREAL_TYPES for lp in net.layer)
    for lp in net.layer:
        if plain_binary(lp) and any(b in writer and writer[b].type == "Threshold" for b in lp.bottom):
            theirs = True
        for top in lp.top:
            writer[top] = lp
    if not theirs:
        return
    for lp in net.layer:
        if plain_binary(lp):
            lp.binary_convolution_param.use_alpha = True
    marked = [lp for lp in net.layer if lp.type == "Threshold" and not lp.threshold_param.HasField("below_value")]
    for lp in marked:
        lp.threshold_param.below_value = -1
    if marked:
        notes.append(f"read {len(marked)} Threshold layer(s) ('{marked[0].name}'{', ...' if len(marked) > 1 else ''}) "
                     f"as Bi-Real-net's Caffes compute them: -1 at or below the threshold (BVLC's gives 0), as "
                     f"the net's binary layers show")


# -- V0 -> V1 -----------------------------------------------------------------

def _v0_key(entry):
    """The name read_caffemodel files a V0/V1 entry's blobs under."""
    return entry.name or (entry.layer.name if entry.HasField("layer") else "")


def _fold_padding_layers(net, where, weights, notes):
    """Drop V0 padding layers, moving their pad into the conv/pool that reads them
    (UpgradeV0PaddingLayers). Returns the surviving entries (copies)."""
    producer = {name: None for name in net.input}   # blob -> index of the entry writing it
    entries = list(net.layers)
    kept = []
    folded = 0
    for i, entry in enumerate(entries):
        v0 = entry.layer
        out = None
        if v0.type != "padding":
            out = caffe_pb2.V1LayerParameter()
            out.CopyFrom(entry)
            kept.append(out)
        for j, blob in enumerate(entry.bottom):
            if blob not in producer:
                raise ParseError(f"{where}: layer '{v0.name or entry.name}' reads blob '{blob}' "
                                 f"that no earlier layer or input produces")
            src = producer[blob]
            if src is None or entries[src].layer.type != "padding":
                continue
            pad_layer = entries[src]
            pad_name = pad_layer.layer.name or pad_layer.name
            if v0.type not in ("conv", "pool"):
                raise ParseError(f"{where}: padding layer '{pad_name}' feeds layer "
                                 f"'{v0.name or entry.name}' of type '{v0.type}'; a V0 padding "
                                 f"layer can only feed a conv or pool layer")
            if len(entry.bottom) != 1:
                raise ParseError(f"{where}: layer '{v0.name}' reads padding layer '{pad_name}' "
                                 f"but has {len(entry.bottom)} bottoms (needs exactly 1)")
            if len(pad_layer.bottom) != 1 or len(pad_layer.top) != 1:
                raise ParseError(f"{where}: padding layer '{pad_name}' must have exactly one "
                                 f"bottom and one top")
            if out is None:  # a padding layer fed by a padding layer fails the type check above
                continue
            out.layer.pad = pad_layer.layer.pad
            out.bottom[j] = pad_layer.bottom[0]
            folded += 1
        for blob in entry.top:
            producer[blob] = i
    if weights is not None:
        for entry in entries:
            if entry.layer.type == "padding":
                key = _v0_key(entry)
                if key in weights and not weights[key]:
                    del weights[key]
    padding = sum(1 for e in entries if e.layer.type == "padding")
    if padding:
        notes.append(f"folded {padding} V0 padding layer(s) into the pad of {folded} "
                     f"conv/pool layer(s)")
    return kept


def _set_field(msg, field, value):
    fd = msg.DESCRIPTOR.fields_by_name[field]
    if fd.is_repeated:
        getattr(msg, field).append(value)
    elif fd.message_type is not None:
        getattr(msg, field).CopyFrom(value)
    else:
        setattr(msg, field, value)


def _upgrade_v0_layer(entry, where, notes, bsdh=False):
    """One V0 entry (V1 wrapper holding a V0 `layer`) -> V1LayerParameter (UpgradeV0LayerParameter);
    bsdh: the net is BitScalableDeepHash's (v0_forks.py)."""
    out = caffe_pb2.V1LayerParameter()
    out.bottom.extend(entry.bottom)
    out.top.extend(entry.top)
    if not entry.HasField("layer"):
        if any(f.name not in ("bottom", "top") for f, _ in entry.ListFields()):
            notes.append(f"{where}: 'layers' entry '{entry.name}' has no V0 'layer' message in a V0 "
                         f"net; only its bottoms and tops were kept (as Caffe does)")
        return out
    v0 = entry.layer
    if v0.HasField("name"):
        out.name = v0.name
    vtype = _V0_TYPE_SPELLINGS.get(v0.type, v0.type)
    fork = bsdh_fork_type(v0, vtype) if bsdh else None
    if v0.HasField("type"):
        if fork:
            out.fork_type = fork
        elif vtype in _V0_FORK_TYPES:
            out.fork_type = _V0_FORK_TYPES[vtype]
        elif vtype not in _V0_TYPES:
            raise ParseError(f"{where}: layer '{v0.name}': unknown V0 layer type '{vtype}' "
                             f"(known: {', '.join(sorted(set(_V0_TYPES) | set(_V0_FORK_TYPES)))})")
        else:
            out.type = caffe_pb2.V1LayerParameter.LayerType.Value(_V0_TYPES[vtype])
    out.blobs.extend(v0.blobs)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    dropped = []
    for field in _V0_ROUTES:
        if not v0.HasField(field):
            continue
        route = None if bsdh and field in bsdh_ignored_fields(vtype) else _v0_route(field, vtype)
        if route is None:
            dropped.append(field)
            continue
        sub_name, target = route
        sub = getattr(out, sub_name)
        value = getattr(v0, field)
        if target is None:          # whole sub-message
            sub.CopyFrom(value)
        elif field == "pool":       # enum: same names in V0 and PoolingParameter
            sub.pool = caffe_pb2.PoolingParameter.PoolMethod.Value(
                caffe_pb2.V0LayerParameter.PoolMethod.Name(value))
        else:
            _set_field(sub, target, value)
    for field, target in _V0_MESSAGES:
        if v0.HasField(field):
            getattr(out, target).MergeFrom(getattr(v0, field))
    upgrade_dsn_dropout(v0, vtype, out, where, notes)
    if fork:
        fill_bsdh_param(v0, vtype, out)
    if dropped:
        notes.append(f"{where}: layer '{v0.name}' (V0 type '{vtype}'): dropped field(s) "
                     f"{', '.join(dropped)} that mean nothing for this type (as Caffe does)")
    return out


def _upgrade_v0(net, where, weights, notes):
    """V0 net -> V1 net (UpgradeV0Net): padding layers folded, then each layer upgraded."""
    old_keys = [_v0_key(e) for e in net.layers if e.layer.type != "padding"]
    kept = _fold_padding_layers(net, where, weights, notes)
    bsdh = is_bsdh_net(kept)
    upgraded = [_upgrade_v0_layer(e, where, notes, bsdh) for e in kept]
    # Caffe keeps only these header fields of a V0 net
    header_kept = ("name", "input", "input_dim", "force_backward", "layers")
    lost = [f.name for f, _ in net.ListFields() if f.name not in header_kept]
    name = net.name if net.HasField("name") else None
    inputs, dims = list(net.input), list(net.input_dim)
    force = net.force_backward if net.HasField("force_backward") else None
    net.Clear()
    if name is not None:
        net.name = name
    net.layers.extend(upgraded)
    net.input.extend(inputs)
    net.input_dim.extend(dims)
    if force is not None:
        net.force_backward = force
    if lost:
        notes.append(f"{where}: dropped net field(s) {', '.join(lost)} that a V0 net cannot carry "
                     f"(as Caffe does)")
    if weights is not None:
        _rekey(weights, old_keys, [e.name for e in upgraded])
    notes.append(f"upgraded {len(upgraded)} V0 layers to V1")


def _rekey(weights, old_keys, new_keys):
    """Rename weight entries whose layer changed name, keeping the first owner of a name."""
    moves = [(o, n) for o, n in zip(old_keys, new_keys) if o != n and o in weights]
    if not moves:
        return
    taken = {o: weights.pop(o) for o, _ in moves}
    for old, new in moves:
        weights.setdefault(new, taken[old])


# -- deprecated data-layer transform fields --------------------------------------

def _needs_data_upgrade(net):
    for lp in net.layers:
        sub = _DATA_TRANSFORM_PARAMS.get(caffe_pb2.V1LayerParameter.LayerType.Name(lp.type)
                                         if lp.HasField("type") else "")
        if sub and lp.HasField(sub) and any(getattr(lp, sub).HasField(f) for f in _TRANSFORM_FIELDS):
            return True
    return False


def _upgrade_data_transformation(net):
    """Move scale/mean_file/crop_size/mirror of V1 data layers into transform_param."""
    moved = 0
    for lp in net.layers:
        if not lp.HasField("type"):
            continue
        sub_name = _DATA_TRANSFORM_PARAMS.get(caffe_pb2.V1LayerParameter.LayerType.Name(lp.type))
        if not sub_name or not lp.HasField(sub_name):
            continue
        sub = getattr(lp, sub_name)
        present = [f for f in _TRANSFORM_FIELDS if sub.HasField(f)]
        for f in present:
            setattr(lp.transform_param, f, getattr(sub, f))
            sub.ClearField(f)
        moved += bool(present)
    return moved


def _warn_v2_data_fields(net, where, notes):
    """V2 data layers with the deprecated fields: Caffe ignores them (no upgrade for `layer`)."""
    for lp in net.layer:
        sub_name = _V2_DATA_TRANSFORM_PARAMS.get(lp.type)
        if not sub_name or not lp.HasField(sub_name):
            continue
        present = [f for f in _TRANSFORM_FIELDS if getattr(lp, sub_name).HasField(f)]
        if present:
            notes.append(f"{where}: layer '{lp.name}' ({lp.type}): {sub_name} "
                         f"{', '.join(present)} are deprecated and ignored by Caffe in 'layer' "
                         f"definitions; put them in transform_param")


# -- V1 -> V2 -------------------------------------------------------------------

# forks' V1 names whose V2 string (the fork's own UpgradeV1LayerType) is not the capitalized words
FORK_V1_RENAMES = {
    "HTANH": "HTanH",   # ypkang/caffe ffb2dd9 upgrade_proto.cpp (DjiNN and Tonic)
}


def fork_v1_type(name):
    """A fork's V1 enum name as its V2 type string, the way Caffe's own were renamed:
    NUSWIDE_DATA -> NuswideData, SOFTMAX_MULTILABEL_LOSS -> SoftmaxMultilabelLoss."""
    if name in FORK_V1_RENAMES:
        return FORK_V1_RENAMES[name]
    return "".join(word.capitalize() for word in name.split("_"))


def v1_type_string(v1):
    """The V2 type string of a V1 layer: Caffe's rename of its enum value, or a fork's."""
    if v1.HasField("fork_type"):
        return fork_v1_type(v1.fork_type)
    return V1_TYPE_STRINGS[caffe_pb2.V1LayerParameter.LayerType.Name(v1.type)]


def _upgrade_v1_layer(v1, where=""):
    """One V1LayerParameter -> LayerParameter (UpgradeV1LayerParameter)."""
    lp = caffe_pb2.LayerParameter()
    lp.bottom.extend(v1.bottom)
    lp.top.extend(v1.top)
    if v1.HasField("name"):
        lp.name = v1.name
    lp.include.extend(v1.include)
    lp.exclude.extend(v1.exclude)
    if v1.HasField("fork_type") or v1.HasField("type"):
        lp.type = v1_type_string(v1)
    lp.blobs.extend(v1.blobs)

    def spec(i):
        while len(lp.param) <= i:
            lp.param.add()
        return lp.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        spec(i).share_mode = caffe_pb2.ParamSpec.DimCheckMode.Value(
            caffe_pb2.V1LayerParameter.DimCheckMode.Name(mode))
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    lp.loss_weight.extend(v1.loss_weight)
    if v1.HasField("strict_dim"):   # DeepLab-Context's V1 field (weights loaded by count)
        lp.strict_dim = v1.strict_dim
    lp.transformations.extend(v1.transformations)   # si-convnet's, not a *_param
    for sub in _V1_SUBPARAMS:
        if v1.HasField(sub):
            getattr(lp, sub).CopyFrom(getattr(v1, sub))
    if v1.HasField("cccp_param"):   # amsword/caffe-parallel's V1 CCCP: the fields the Cccp layer reads
        if v1.HasField("convolution_param"):
            raise ParseError(f"{_where(where)}: layer '{v1.name}': cccp_param and convolution_param both set; "
                             "NIN's cccp reads one")
        c, conv = v1.cccp_param, lp.convolution_param
        conv.num_output, conv.bias_term, conv.group = c.num_output, c.bias_term, c.group
        for filler in ("weight_filler", "bias_filler"):
            if c.HasField(filler):
                getattr(conv, filler).CopyFrom(getattr(c, filler))
    if v1.HasField("label_size"):   # bogger/caffe-multigpu: label_size labels a line, as imistyrain's ImageData
        if v1.type != caffe_pb2.V1LayerParameter.IMAGE_DATA:
            raise ParseError(f"{_where(where)}: layer '{v1.name}': label_size (bogger/caffe-multigpu's) is read for IMAGE_DATA "
                             f"layers only")
        lp.image_data_param.label_size = v1.label_size
    return lp


def upgrade_mixed_layers(net, block_order):
    """A net holding both 'layer' and V1 'layers' entries: each V1 entry upgraded (its deprecated
    transform fields moved first, as for a V1 net) and put back among the 'layer' ones in
    block_order, the sequence of "layer" / "layers" blocks as the file wrote them.  Returns how many."""
    v1_net = caffe_pb2.NetParameter()
    v1_net.layers.extend(net.layers)
    if _needs_data_upgrade(v1_net):
        _upgrade_data_transformation(v1_net)
    upgraded = iter([_upgrade_v1_layer(v1) for v1 in v1_net.layers])
    current = iter(list(net.layer))
    if sorted(block_order) != sorted(["layer"] * len(net.layer) + ["layers"] * len(net.layers)):
        block_order = ["layer"] * len(net.layer) + ["layers"] * len(net.layers)   # not from a text file
    merged = [next(upgraded) if kind == "layers" else next(current) for kind in block_order]
    count = len(net.layers)
    net.ClearField("layers")
    net.ClearField("layer")
    net.layer.extend(merged)
    return count


def _upgrade_v1(net, where, notes):
    """V1 net -> V2 net (UpgradeV1Net). Returns the number of layers upgraded."""
    v1_layers = list(net.layers)
    new = []
    for i, v1 in enumerate(v1_layers):
        if v1.HasField("layer"):
            notes.append(f"{where}: 'layers' entry #{i} ('{v1.name}') still holds a V0 'layer' "
                         f"message; ignored (as Caffe does)")
        if not v1.HasField("fork_type") and (not v1.HasField("type") or v1.type == caffe_pb2.V1LayerParameter.NONE):
            # binary files: an enum value caffe.proto lacks parses as "no type"
            notes.append(f"{where}: 'layers' entry #{i} ('{v1.name}') has no layer type (or one "
                         f"this caffe.proto does not know); it upgrades to type \"\"")
        new.append(_upgrade_v1_layer(v1, where))
    net.ClearField("layers")
    net.ClearField("layer")
    net.layer.extend(new)
    return len(new)


# -- input headers -> Input layer ---------------------------------------------------

def _upgrade_input(net, where, notes, keep_shapeless):
    """`input:` + `input_shape:`/`input_dim:` -> one Input layer named "input" placed first
    (UpgradeNetInput). Inputs without any shape (old caffemodels) are simply dropped, unless
    keep_shapeless and a layer reads them."""
    names = list(net.input)
    has_shape, has_dim = len(net.input_shape) > 0, len(net.input_dim) > 0
    if has_shape or has_dim:
        lp = caffe_pb2.LayerParameter(name="input", type="Input")
        lp.top.extend(names)
        if has_shape:
            if len(net.input_shape) != len(names):
                raise ParseError(f"{where}: {len(names)} input(s) {names} but "
                                 f"{len(net.input_shape)} input_shape entries; give one per input")
            if has_dim:
                notes.append(f"{where}: both input_shape and input_dim are given; input_dim "
                             f"ignored (as Caffe does)")
            for shape in net.input_shape:
                lp.input_param.shape.add().CopyFrom(shape)
        else:
            dims = list(net.input_dim)
            per_input = 4
            if len(dims) == 5 * len(names) != 4 * len(names):
                # C3D v1.0's Net::Init (facebook/C3D, as chuckcho/C3D keeps it) reads five per input, each
                # from input_dim(4 i): num, channels, length, height, width
                per_input = 5
                notes.append(f"{where}: {len(dims)} input_dim values for {len(names)} input(s): read as C3D "
                             f"v1.0's 5-axis inputs (num, channels, length, height, width)")
            elif len(dims) != 4 * len(names):
                raise ParseError(f"{where}: {len(names)} input(s) {names} need "
                                 f"{4 * len(names)} input_dim values (4 per input), got {len(dims)}")
            for i in range(len(names)):
                lp.input_param.shape.add().dim.extend(dims[4 * i:4 * i + per_input])
        layers = [lp] + list(net.layer)
        net.ClearField("layer")
        net.layer.extend(layers)
        shapes = "; ".join(f"{n} {list(s.dim)}" for n, s in zip(names, lp.input_param.shape))
        notes.append(f"turned the input header into an Input layer 'input' ({shapes})")
    else:
        # Caffe drops shapeless inputs (a legacy caffemodel's header); a net whose layers read them
        # (OpenCV's GOTURN file) keeps them as inputs whose shapes the user gives
        made = {t for lp in net.layer for t in lp.top if t not in lp.bottom}   # in place: read, not made
        read = {b for lp in net.layer for b in lp.bottom}
        kept = [n for n in names if n in read and n not in made] if keep_shapeless else []
        if kept:
            lp = caffe_pb2.LayerParameter(name="input", type="Input")
            lp.top.extend(kept)
            net.layer.insert(0, lp)
            notes.append(f"{where}: input(s) {kept} have no shape in the file (Caffe drops such a header): "
                         f"read as inputs whose shape --input-shape gives")
        dropped = [n for n in names if n not in kept]
        if dropped:
            notes.append(f"dropped the shapeless input field(s) {dropped} (legacy caffemodel header)")
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")


# -- BatchNorm -----------------------------------------------------------------------

def _needs_batchnorm_upgrade(net):
    return any(lp.type == "BatchNorm" and len(lp.param) == 3 for lp in net.layer)


def _upgrade_batchnorm(net):
    """Old BatchNorm definitions listed 3 ParamSpecs; Caffe now pins them to lr 0, decay 0
    (UpgradeNetBatchNorm, BVLC master since a19357a: names and share modes are kept)."""
    count = 0
    for lp in net.layer:
        if lp.type == "BatchNorm" and len(lp.param) == 3:
            for spec in lp.param:
                spec.lr_mult = 0.0
                spec.decay_mult = 0.0
            count += 1
    return count


__all__ = ["net_needs_upgrade", "upgrade_net"]
