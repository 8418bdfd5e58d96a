"""Unknown fields of a prototxt: which ones cannot matter for the net being read, and how each is reported.

An unknown field is an error (naming file, line, column, field and layer) unless it can
only matter for training, where it is skipped with a warning:
  - anywhere inside a layer that is not part of the net being read (by default the TEST
    net: `include { phase: TRAIN }` or `exclude { phase: TEST }`);
  - reading the TEST net, anywhere inside `transform_param` (data augmentation) or a loss
    parameter (`loss_param`, `*_loss_param`), or an unknown `*_loss_param` itself;
  - a fork field listed in _KNOWN_FORK_FIELDS by message and name: memory, cuDNN and multi-GPU
    knobs (any phase), training hyper-parameters and data augmentation (reading the TEST net).
`ignore_unknown=True` (--ignore-unknown) turns every unknown field into a warning.
"""
import difflib

from ..errors import ParseError
from .schema import caffe_pb2
from .upgrade import v1_type_string


def _rule_is_only_phase(rule, phase):
    """True when the NetStateRule names this phase and nothing else (no level / stage)."""
    return (rule.HasField("phase") and rule.phase == phase and not rule.HasField("min_level")
            and not rule.HasField("max_level") and not rule.stage and not rule.not_stage)


def _left_out(layer, phase):
    """True when Caffe never puts this layer in the net of the given phase."""
    # MyCaffe's RUN phase is the net caffeq reads as TEST (caffeq/layers/mycaffe.py): a layer it includes
    # there is in the TEST net, one it excludes there is left out
    run = (phase,) if phase != caffe_pb2.TEST else (phase, caffe_pb2.RUN)
    include = list(getattr(layer, "include", ()))
    if include and all(r.HasField("phase") and r.phase not in run for r in include):
        return True
    return any(_rule_is_only_phase(r, p) for r in getattr(layer, "exclude", ()) for p in run)


# Fork fields that Caffe builds the same net and the same numbers without, by message and name.
# They are skipped by name (not declared in caffe.proto) because their numbers clash between forks
# (Intel's bn_stats_batch_size = 11 is NVCaffe's default_forward_type; CMU's cpm_transform_param =
# 147 is swish_param).  {message: {field: (phases it cannot matter for, why)}}
_ANY_PHASE, _TEST_ONLY = ("TRAIN", "TEST"), ("TEST",)
# (message, the phases a field cannot matter for, why, the fields), one group per fork and reason
_FORK_FIELD_GROUPS = [
    # NVIDIA/caffe 87a2554 caffe.proto NetParameter 12-20
    ("NetParameter", _ANY_PHASE, "NVCaffe's memory sharing, multi-GPU reduction and cuDNN algorithm choice",
     "eltwise_mem_sharing", "reduce_buckets", "default_conv_algos_override"),
    # the loss scale multiplies the loss and divides the gradients again: in caffeq's float32 training
    # it cancels, as a precision only changes the rounding
    ("NetParameter", _ANY_PHASE, "NVCaffe's backward pass precision and gradient (loss) scaling; caffeq "
     "trains in float32", "default_backward_type", "default_backward_math", "global_grad_scale",
     "global_grad_scale_adaptive"),
    # NVCaffe runs the forward pass in this type; the function is the same, only the rounding
    ("NetParameter", _ANY_PHASE, "NVCaffe's forward precision; caffeq computes in float32",
     "default_forward_type", "default_forward_math"),
    # NVIDIA/caffe 87a2554 caffe.proto DataParameter 11-16, ImageDataParameter 14-17: how records
    # are read (threads, an in-memory cache, the share of a multi-node dataset), never what they hold
    # matex-org/caffe-intel 35c1a3d3's DataParameter.cache = 15 is a repeated block of cache levels of the same name
    ("DataParameter", _ANY_PHASE, "NVCaffe's data-reading threads and record cache (matex-org/caffe-intel's cache "
     "levels)", "threads", "parser_threads", "cache", "precache"),
    ("DataParameter", _TEST_ONLY, "NVCaffe's shuffling of training records", "shuffle"),
    ("ImageDataParameter", _ANY_PHASE, "NVCaffe's image-reading threads, cache and multi-node share",
     "threads", "cache", "precache", "dataset_share_per_node"),
    # intel/caffe 44d5363 caffe.proto NetParameter 9-11, 101
    ("NetParameter", _TEST_ONLY, "Intel Caffe's BatchNorm statistics batch and multi-node training",
     "bn_stats_batch_size", "multinode"),
    # its 9 is Cysu/caffe's richness below; the engine picks implementations of the same layers
    ("NetParameter", _ANY_PHASE, "Intel Caffe's engine for every layer (its choice of implementation)",
     "engine"),
    # Cysu/caffe ab98582 (domain-guided-dropout) NetParameter.richness = 9
    ("NetParameter", _ANY_PHASE, "Cysu/caffe's cuDNN workspace limit (MB)", "richness"),
    # yjxiong/caffe and Cysu/caffe@faster-rcnn: NetParameter.mem_param = 200
    # (MemoryOptimizationParameter {optimize_train, optimize_test, exclude_blob})
    ("NetParameter", _ANY_PHASE, "yjxiong/caffe's blob memory sharing; the same numbers without it", "mem_param"),
    # Tongcheng/caffe (DenseNet): AccuracyParameter.use_log = 4
    ("AccuracyParameter", _ANY_PHASE, "Tongcheng/caffe's Accuracy logging switch", "use_log"),
    # Tongcheng/DN_CaffeScript's train_test files: DataParameter.random_order (true at TRAIN, false at
    # TEST): the order records are read in, never what they hold
    ("DataParameter", _ANY_PHASE, "Tongcheng/caffe's order of reading the records", "random_order"),
    # Xilinx's Caffe (Vitis AI; 695kede/xilinx-edge-ai 230d89f caffe-master: DataParameter.multi_gpu_testing = 12)
    ("DataParameter", _ANY_PHASE, "Xilinx Caffe's split of the test records over GPUs", "multi_gpu_testing"),
    # Tyler-D/DeBlurNet's train net: ImageData `label: false` on both of its image lists (blurred
    # images, sharp targets), each layer with one top: the tops already say there is no label
    ("ImageDataParameter", _ANY_PHASE, "DeBlurNet's fork's switch for lists without labels (the layer's "
     "tops say it)", "label"),
    # Andrew-Qibin/caffe_dss (ImageLabelmapData): ImageDataParameter.normalize = 17
    ("ImageDataParameter", _ANY_PHASE, "caffe_dss's scaling of the label map, a training target", "normalize"),
    # wanggao1990/opencv_dnn_application's ENet for its own OpenCV BN layer: the values of the
    # scale and shift blobs when the weights have none, as scale_filler / shift_filler
    ("BNParameter", _ANY_PHASE, "the initial scale or shift blob value of an OpenCV port's BN layer (a filler)",
     "scale", "shift"),
    # wenwei202/caffe f54a74a ParamSpec.force_mult = 6
    ("ParamSpec", _TEST_ONLY, "wenwei202/caffe's multiplier of a training regulariser", "force_mult"),
    # longriyao/caffe_colorizer (README: ParamSpec.param_propagate_down = 6): no gradient into the blob
    ("ParamSpec", _TEST_ONLY, "caffe_colorizer's switch of gradients into a blob (GAN training)",
     "param_propagate_down"),
    # intel/caffe models/intel_optimized_models/int8 (its QuantizationParameter): the calibrated scales
    # of its int8 inference mode; its FP32 mode, the reference, runs the same layers without them
    ("QuantizationParameter", _ANY_PHASE, "Intel Caffe's int8 calibration scales (its int8 mode); caffeq "
     "computes the float32 net", "scale_in", "scale_out", "scale_params", "is_negative_input", "force_u8_input"),
    # tidsp/caffe-jacinto's NetParameter.quantize: its own quantized inference, of the same float net
    ("NetParameter", _ANY_PHASE, "TI caffe-jacinto's switch to its quantized inference; caffeq computes the "
     "float32 net", "quantize"),
    # Yahoo CaffeOnSpark's LayerParameter.source_class: the Java class Spark reads the data with
    ("LayerParameter", _ANY_PHASE, "CaffeOnSpark's data source class (Spark feeds the data)", "source_class"),
    # Yahoo CaffeOnSpark: the data Spark feeds; caffeq takes the shape from batch_size, channels,
    # height and width like MemoryData
    ("MemoryDataParameter", _ANY_PHASE, "CaffeOnSpark's data source and multi-GPU sharing; the shape comes "
     "from channels, height, width", "source", "share_in_parallel"),
    # NVIDIA/caffe 87a2554 caffe.proto LayerParameter 145-150 (145-150 are fork messages here): the
    # layer's own precision; the function is the same, only the rounding
    ("LayerParameter", _ANY_PHASE, "NVCaffe's per-layer forward precision; caffeq computes in float32",
     "forward_type", "forward_math", "cudnn_math_override", "debug"),
    ("LayerParameter", _ANY_PHASE, "NVCaffe's per-layer backward pass precision; caffeq trains in float32",
     "backward_type", "backward_math"),
    # zimenglan-sysu-512/pose_action_caffe d397a23 LayerParameter 404, 409: what its training logs show
    ("LayerParameter", _ANY_PHASE, "pose_action_caffe's display of training information",
     "is_disp_info", "train_net_output_disp"),
    # foss-for-synopsys-dwc-arc-processors/synopsys-caffe 977ba36 DataParameter.random = 22
    # (annotated_data_layer.cpp): darknet's multi-scale training, a new input size every 10 iterations
    ("DataParameter", _ANY_PHASE, "synopsys-caffe's darknet-style random resizing of training inputs, "
     "which caffeq does not apply", "random"),
    # CMU-Perceptual-Computing-Lab/caffe_train 76dd956: the CPMData layer's augmentation
    ("LayerParameter", _TEST_ONLY, "CPMData's data augmentation only matters for training", "cpm_transform_param"),
    # intel/caffe 44d5363 LayerParameter `optional string engine = 149` ("MKL2017", "MKLDNN", "CAFFE"):
    # which implementation runs the layer (Cambricon's enum engine holds the name here), never its numbers
    ("LayerParameter.Engine", _ANY_PHASE, "Intel Caffe's choice of implementation (MKL2017, MKLDNN); the same "
     "numbers", "engine"),
    # yuqj1991/caffe_train (its AnnotatedDataParameter): how its data layer reads and samples annotations for
    # training (YOLO-format boxes, crop policy, landmarks, anchor-based sampling); the tops' shapes are SSD's
    ("AnnotatedDataParameter", _ANY_PHASE, "yuqj1991/caffe_train's annotation reading and sampling for training",
     "yoloformat", "crop_type", "has_landmarks", "data_anchor_sampler", "bbox_sampler", "up_prob", "low_prob"),
    # intel/caffe 44d5363 ConvolutionParameter.conv_algorithm = 21 (string, "direct"; 21 is SkimCaffe's conv_mode here):
    # "winograd" picks MKL-DNN's Winograd kernels, the same convolution
    ("ConvolutionParameter", _ANY_PHASE, "Intel Caffe's MKL-DNN convolution algorithm (direct or Winograd), the "
     "same convolution", "conv_algorithm"),
    # jkokkin/UberNet b33344d caffe-fast-rcnn: LayerParameter 201-204 (201/202 are SSD's Permute numbers);
    # net.cpp frees a layer's bottoms after its forward when deletebottom is set, nothing reads the others
    ("LayerParameter", _ANY_PHASE, "UberNet's memory saving (blobs freed after use); the same numbers without it",
     "deletetop", "deletebottom", "pullsfrom", "eliminate"),
    # weleen/CADSTN.caffe's hand_mix LSTM (its Caffe, the weleen/caffe submodule d6b6882, is not public):
    # `fix_parameters: true`, the author's freeze of the recurrent weights in training (BVLC/caffe#5174)
    ("RecurrentParameter", _TEST_ONLY, "CADSTN's freeze of the recurrent weights while training", "fix_parameters"),
    # MyCaffe/MyCaffe b8922aa (param/OptionalParameter.cs): `option { active }` in its optional messages; its
    # DetectionOutputLayer.cs reads nms_param's thresholds whatever the switch says, and caffeq writes no files
    ("NonMaximumSuppressionParameter", _ANY_PHASE, "MyCaffe's optional-message switch, which its DetectionOutput "
     "never reads", "option"),
    ("SaveOutputParameter", _ANY_PHASE, "MyCaffe's switch for writing detections to files, which caffeq never does",
     "option"),
]

# Fork fields that only one layer type's own tool drops, by (layer type, message): {field names}, why.
# BestDAHU/Atlas200DK writes Ascend's SSDDetectionOutput settings in SSD's message; Ascend/parser reads
# prototxts allowing unknown fields and its DetectionOutputParameter lacks these two.  In another
# layer (SSD's DetectionOutput, which caffeq runs) they stay errors.
_DROPPED_FOR_TYPE = {
    ("SSDDetectionOutput", "caffe.DetectionOutputParameter"): (
        {"iou_threshold", "eta"},
        "Huawei Ascend's SSDDetectionOutput settings in SSD's message, which Ascend's converter drops (it reads "
        "ssddetectionoutput_param)"),
}


def _by_message(groups):
    """{"caffe.Message": {field: (phases, why)}} from the groups."""
    table = {}
    for message, phases, why, *fields in groups:
        table.setdefault("caffe." + message, {}).update(dict.fromkeys(fields, (phases, why)))
    return table


_KNOWN_FORK_FIELDS = _by_message(_FORK_FIELD_GROUPS)
# enums whose fork declares the field a string instead: a quoted value is read as that fork's
QUOTED_ENUM_FORKS = {"caffe.LayerParameter.Engine"}


def _known_fork_field(unknown, phase):
    """Why a field of _KNOWN_FORK_FIELDS cannot matter for the `phase` net, or None."""
    phases, why = _KNOWN_FORK_FIELDS.get(unknown.message_type, {}).get(unknown.name, ((), None))
    return why if caffe_pb2.Phase.Name(phase) in phases else None


def _is_loss_param(name):
    # DeepLab's V1 files spell it softmaxloss_param
    return name.endswith("loss_param")


def _training_only(unknown, message, phase, known_layer=None):
    """Why an unknown field cannot matter for reading the `phase` net, or None.

    known_layer(LayerParameter) -> bool says whether caffeq has a spec that reads the layer's
    parameters: the parameters of a layer it has none for never matter (the layer is dropped as
    training-only, or the read stops on its type with one clear error)."""
    if unknown.solver:
        return "a solver setting only matters for training"
    if unknown.empty:
        return "an empty message, it sets nothing"
    if unknown.layer is not None and isinstance(message, caffe_pb2.NetParameter):
        kind, index = unknown.layer
        layers = getattr(message, kind)
        if index < len(layers) and _left_out(layers[index], phase):
            return f"the layer is not in the {caffe_pb2.Phase.Name(phase)} net"
    if unknown.placeholder:
        # fusionseg's templates: its demo.py replaces each placeholder's whole line, field name included
        return "its value is a template placeholder, and the script that fills the template in writes that line"
    known = _known_fork_field(unknown, phase)
    if known:
        return known
    lp = _as_v2_layer(message, unknown.layer)
    names, why = _DROPPED_FOR_TYPE.get((lp.type if lp is not None else None, unknown.message_type), ((), None))
    if unknown.name in names:
        return why
    if known_layer is not None and lp is not None:
        if lp.type and not known_layer(lp):
            return f"caffeq reads no parameters of type '{lp.type}' (dropped if it only trains, else refused)"
    if unknown.layer is None:
        return None
    inner = unknown.path[1:]  # below the layer
    if unknown.message_type == "caffe.FillerParameter" and phase == caffe_pb2.TEST:
        # FlowNet2's `diag_val`, PPR-FCN's fillers: how a training run starts, the weights replace it
        return "a weight filler only sets the weights a training run starts from"
    if "transform_param" in inner[:-1]:
        if phase != caffe_pb2.TEST:
            # a fork's augmentation (SSD's distort_param knobs...): caffeq's own training applies
            # crop, mirror, mean and scale only, so the field could not take effect anyway
            return "a fork's data augmentation (transform_param), which caffeq does not apply"
        return "data augmentation (transform_param) only matters for training"
    if any(_is_loss_param(p) for p in inner):
        if phase != caffe_pb2.TEST:
            return "a fork's loss parameters, which caffeq's fine-tuning does not apply"
        return "loss parameters only matter for training"
    return None


def _as_v2_layer(message, where):
    """The layer an unknown field sits in, as a LayerParameter: a V2 layer itself, a V1 layer by its
    name, type (Caffe's or a fork's) and blobs; None otherwise."""
    if where is None or not isinstance(message, caffe_pb2.NetParameter):
        return None
    kind, index = where
    layers = getattr(message, kind)
    if index >= len(layers):
        return None
    if kind == "layer":
        return layers[index]
    v1 = layers[index]
    if not v1.HasField("fork_type") and not v1.HasField("type"):
        return None   # V0: the type sits one level down
    return caffe_pb2.LayerParameter(name=v1.name, type=v1_type_string(v1), bottom=v1.bottom, top=v1.top)


def _layer_name(unknown, message):
    if unknown.layer is None or not isinstance(message, caffe_pb2.NetParameter):
        return None
    kind, index = unknown.layer
    layers = getattr(message, kind)
    if index >= len(layers):
        return None
    layer = layers[index]
    if kind == "layers" and not layer.name and layer.HasField("layer"):
        return layer.layer.name or None  # V0: the name sits one level down
    return layer.name or None


def _close_field(unknown):
    """'; did you mean 'x'?' for a field of the message in other capitals (`Convolution_param`) or one
    letter or two off (`num_ouput`), else '' (a field further off is as likely a fork's own)."""
    try:
        fields = list(caffe_pb2.DESCRIPTOR.pool.FindMessageTypeByName(unknown.message_type).fields_by_name)
    except KeyError:
        return ""
    hit = [f for f in fields if f.lower() == unknown.name.lower()] or \
        difflib.get_close_matches(unknown.name, fields, n=1, cutoff=0.9)
    if not hit and len(unknown.name) >= 4:   # short names: one letter lost, added or changed (`nput`)
        near = [f for f in fields if _one_edit_apart(unknown.name, f)]
        hit = near if len(near) == 1 else []
    return f"; did you mean '{hit[0]}'?" if hit else ""


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether b is a with one character inserted, deleted or replaced."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) > len(b):
        a, b = b, a
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    return a[i + (len(a) == len(b)):] == b[i + 1:]


def report_unknown_fields(unknowns, message, path, phase, ignore_unknown, warnings, known_layer=None):
    """Raise for the first unknown field that may matter; warn (once per field name) for the rest."""
    groups = {}
    for u in unknowns:
        reason = _training_only(u, message, phase, known_layer)
        if reason is None and not ignore_unknown:
            layer = _layer_name(u, message)
            where = f"{path}:{u.line}:{u.column}" if u.line else path
            ctx = f" in layer '{layer}'" if layer else ""
            if u.enum_value is not None:
                kind = "named" if u.enum_value.isidentifier() else "with number"
                raise ParseError(f"{where}: '{u.name}: {u.enum_value}'{ctx}: enum {u.message_type} has no "
                                 f"value {kind} {u.enum_value}")
            raise ParseError(
                f"{where}: unknown field '{u.name}'{ctx} (message {u.message_type} has no field "
                f"'{u.name}'{_close_field(u)}); pass --ignore-unknown to skip unknown fields with a warning")
        groups.setdefault((u.name, u.enum_value, reason), []).append(u)
    if warnings is None:
        return
    for (name, _, reason), members in groups.items():
        first = members[0]
        layer = _layer_name(first, message)
        where = f"{path}:{first.line}" if first.line else path
        more = f" (and {len(members) - 1} more)" if len(members) > 1 else ""
        what = (f"value {first.enum_value} of field" if first.enum_value is not None else "field")
        warnings.append(f"{where}: ignored unknown {what} '{name}'"
                        + (f" in layer '{layer}'" if layer else "") + more
                        + (f": {reason}" if reason else ""))
