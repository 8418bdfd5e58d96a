"""What the SSD layers share: constants, Caffe's legacy height/width, DetectionOutput's ONNX top."""
import numpy as np
import torch

from ..registry import Layer

FLT_MAX = float(np.finfo(np.float32).max)
CORNER, CENTER_SIZE, CORNER_SIZE = 1, 2, 3
CODE_NAMES = {CORNER: "CORNER", CENTER_SIZE: "CENTER_SIZE", CORNER_SIZE: "CORNER_SIZE"}


def proto_field(param, name, default=None):
    """A fork field's value, `default` when unset or when this schema lacks the field."""
    if name not in param.DESCRIPTOR.fields_by_name or not param.HasField(name):
        return default
    return getattr(param, name)


def prior_run_sizes(feat, img, img_h: int, img_w: int):
    """(map h, map w, image h, image w) of PriorBox's bottoms at run time, as Caffe's legacy
    height()/width() read them (1 past the last axis); img_h and img_w, when set, replace the image's."""
    lh = feat.shape[2] if feat.dim() > 2 else 1
    lw = feat.shape[3] if feat.dim() > 3 else 1
    if img_h and img_w:
        return lh, lw, img_h, img_w
    return lh, lw, img.shape[2] if img.dim() > 2 else 1, img.shape[3] if img.dim() > 3 else 1


def prior_steps(step_h: float, step_w: float, lh: int, lw: int, ih: int, iw: int):
    """PriorBox's (step_h, step_w) as float32 tensors: the ones given (both set), else the image size over
    the feature map's, divided in float32 as SSD and the forks do."""
    f32 = torch.float32
    if step_h != 0.0 and step_w != 0.0:
        return torch.tensor(step_h, dtype=f32), torch.tensor(step_w, dtype=f32)
    return (torch.tensor(float(ih), dtype=f32) / torch.tensor(float(lh), dtype=f32),
            torch.tensor(float(iw), dtype=f32) / torch.tensor(float(lw), dtype=f32))


def prior_output(coords, variance: list[float], clip: bool):
    """PriorBox's top (1, 2, N * 4) from the flat float32 corners: clamped to [0, 1] with `clip`, then
    the variances (one value for all, or 4 per prior)."""
    if clip:
        coords = coords.clamp(0.0, 1.0)
    var = torch.tensor(variance, dtype=torch.float32)
    return torch.stack([coords, var.repeat(coords.numel() // var.numel())]).reshape(1, 2, -1)


def emit_prior_helpers(emit):
    """model.py: the shared PriorBox functions (sizes, steps, output) its prior modules call."""
    for helper in (prior_run_sizes, prior_steps, prior_output):
        emit.helper(helper)


def legacy_hw(shape):
    """Caffe's legacy height()/width(): axes 2 and 3, 1 where the blob has fewer axes."""
    shape = tuple(shape)
    h = shape[2] if len(shape) > 2 else 1
    w = shape[3] if len(shape) > 3 else 1
    return int(h), int(w)


def scalar_tensor(v):
    """A one-element float32 TensorProto (ConstantOfShape's value)."""
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array([v], np.float32))


def emit_detection_top(ctx, op, rows, batch_input, out, width: int, id_stride: int = 0):
    """ONNX: DetectionOutput's top (1, 1, R, width) from the (R, width) rows, or with no row at all
    SSD's one [i, -1, -1, ...] row per image of batch_input (the YOLO forks write the same).
    id_stride (tl_ssd): image i's id at flat index id_stride * i instead, the rest -1."""
    n1 = op("Slice", [op("Shape", [batch_input], "in_shape"), ctx.i64([0]), ctx.i64([1])], "n")
    nf = op("Cast", [op("Squeeze", [n1, ctx.i64([0])], "n_s")], "nf", to=1)
    ids = op("Unsqueeze", [op("Range", [ctx.f32(0.0), nf, ctx.f32(1.0)], "ids"), ctx.i64([1])], "ids_c")
    if id_stride:
        all_minus = op("Expand", [ctx.f32(np.full((1, width), -1.0, np.float32)),
                                  op("Concat", [n1, ctx.i64([width])], "fb_shape", axis=0)], "all_minus")
        flat = op("Reshape", [all_minus, ctx.i64([-1])], "flat")
        id_vals = op("Squeeze", [ids, ctx.i64([1])], "ids_v")
        id_at = op("Mul", [op("Cast", [id_vals], "ids_i", to=7), ctx.i64(id_stride)], "id_at")
        flat = op("ScatterElements", [flat, id_at, id_vals], "flat_ids", axis=0)
        fallback = op("Reshape", [flat, ctx.i64([-1, width])], "fallback")
    else:
        minus = op("Expand", [ctx.f32(np.full((1, width - 1), -1.0, np.float32)),
                              op("Concat", [n1, ctx.i64([width - 1])], "f_shape", axis=0)], "minus")
        fallback = op("Concat", [ids, minus], "fallback", axis=1)
    # the rows, or (none) the fallback: a Slice of both whose end is R, or N when R is 0
    r1 = op("Slice", [op("Shape", [rows], "rows_shape"), ctx.i64([0]), ctx.i64([1])], "r")
    none = op("Cast", [op("Equal", [r1, ctx.i64([0])], "none_b")], "none", to=7)
    end = op("Add", [r1, op("Mul", [none, n1], "n_if_none")], "end")
    both = op("Concat", [rows, fallback], "both", axis=0)
    picked = op("Slice", [both, ctx.i64([0]), end, ctx.i64([0])], "out2")
    ctx.add_node("Reshape", [picked, ctx.i64([1, 1, -1, width])], [out])


class SizeOnlyPriors(Layer):
    """A prior layer whose top depends on its bottoms' sizes only (PriorBoxClustered, PriorRBox): forward and
    ONNX (a constant) come from `boxes`; model.py builds `torch_module` (a torch_sources bundle whose last
    class takes the attrs named by `module_args`) and calls it on the two bottoms."""

    torch_module = None
    module_args = ()
    helpers = ()   # the shared functions torch_module calls, written into model.py before it

    @staticmethod
    def boxes(attrs, feat_shape, img_shape):
        raise NotImplementedError

    def forward(self, attrs, params, feat, img):
        return self.boxes(attrs, feat.shape, img.shape).to(device=feat.device, dtype=feat.dtype)

    def onnx(self, ctx, node):
        # the output depends only on the (static) spatial sizes, never on the batch or the values
        arr = self.boxes(node.attrs, ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])).numpy()
        ctx.add_node("Identity", [ctx.const(arr, node.name + "_priors")], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        args = ", ".join(f"{k}={emit.lit(node.attrs[k])}" for k in self.module_args)
        for helper in self.helpers:
            emit.helper(helper)
        m = emit.module(f"{emit.helper(self.torch_module)}({args})")
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"
