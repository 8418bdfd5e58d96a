"""strawberryfg's 3-D human pose layers (integral regression on 3-D heatmaps): strawberryfg/c2f-3dhm-human-caffe
65da294, caffe_code/src/caffe/layers/DeepHumanModel/*.cpp and Operations/*.cpp, declarations in
caffe_code/include/caffe/deep_human_model_layers.hpp and operations.hpp, parameters in
caffe_code/src/caffe/proto/custom_layers_mine.proto (proto/caffe.proto; numbers in proto/README.md).  The fork
has no .cu files: every layer runs its CPU forward.  Its nets (and strawberryfg/int-3dhuman-I1's,
3dhuman-groupnorm's) read the image and the ground truth from disk by a sample index.

The prediction path at TEST, computed here (torch, ONNX where noted, model.py):
- DeepHumanModelSoftmax3DHM (deep_human_model_softmax_3d_hm_param joint_num [16], depth_dims [64]): top
  (N, J * D, G, G), G the bottom's axis 2; per sample and joint, the J-th run of D * G * G values of the flat
  bottom: exp(v) / sum(exp(v)) with no maximum subtracted; exp in float (the fork's `exp(v)` of a float v is
  std::exp(float): its h36m.h, which deep_human_model_layers.hpp includes, puts `using namespace std` at file
  scope; MSVC's <cmath> has the float overload at global scope too), so a value above about 88.72 gives inf
  and its cube NaN (inf / inf) at its maximum and 0 elsewhere, a cube all below about -103.97 gives 0 / 0;
  the float exps summed in double, the quotient in double rounded to float.  The bottom must hold
  N * J * D * G * G values.
- DeepHumanModelIntegralX / Y / Z: a 4-D bottom (N, C, H, W) summed in float over the other two axes: X -> (N, W),
  Y -> (N, H), Z -> (N, C); torch and model.py add one term at a time in the fork's loop order, ONNX's ReduceSum
  may add in another order (float rounding apart).
- DeepHumanModelIntegralVector (deep_human_model_integral_vector_param dim_lb [-1], dim_ub [1]): top (N, 1) =
  sum_c ((ub - lb) / C * (c + 0.5) + lb) * x[t, c], C the bottom's axis 1, positions in double, the float top
  accumulated one term at a time (float(top + position * x)); ONNX sums the double products, then rounds.
- DeepHumanModelArgmaxHM: top (N, 2C); per channel of a (N, C, G, G) bottom a row-major scan keeps a running
  maximum (double, from 0) that moves only where v - max > 1e-6; the top is ((col + 0.5) / G, (row + 0.5) / G)
  of the last move, (0.5, 0.5) where none.  No ONNX (a data-dependent scan).
- DeepHumanModelH36MChaGenJointFrXYZHeatmap (its param: depth_dims [101], map_size [224], x/y/z_lb [-1],
  x/y/z_ub [1], joint_num [16]): the same scan over each joint's D * M * M run of the flat bottom; the top
  (N, 3J) is (x, y, z) = ((i + 0.5) / n * (ub - lb) + lb) of the last move, the box centre where none.
- DeepHumanModelNormalizationResponseV0 (normalization_response_param.hm_threshold [1e-4], a float): per
  channel of a (N, C, G, G) bottom, sum = the double sum of the v with float(v - thr) > 1e-6; top v / sum where
  v > thr, else 0.  Where |sum| < 1e-6 the fork writes 1 / G / G into every channel of the sample, channels
  after it then overwrite theirs: channels up to the last such channel are uniform.
- DeepHumanModelNumericalCoordinateRegression: top (N, 2J) = (sum hm * col / S, sum hm * row / S) in double
  over a (N, J, S, S) bottom.
- MulRGB (mul_rgb_param.mul_factor [255]): top (N, 3, S, S) = x * factor in float.

Ground truth and evaluation only (read, shaped, classified; refused with one line if an inference graph
ever runs them): GenSequentialIndex, GenRandIndex (sample indexes, (batch_size, 1): ground-truth sources),
GenUnifiedDataAndLabel (the data layer: crops and augments the image its index names; its tops image
(N, 3, crop_size_y, crop_size_x) and label (N, 2 * num_parts) are graph inputs, its bottoms unread),
DeepHumanModelConvert2D / Convert3D (32 <-> 16 H36M joints), DeepHumanModelConvertDepth (depth against the true
root depth), DeepHumanModelH36MGenAug3D and H36MGenPredMono3D (camera files per index),
DeepHumanModelGen3DHeatmapInMoreDetailV3 and GenHeatmapAllChannels (rendered label heatmaps),
DeepHumanModelOutputJointOnSkeletonMapH36M (writes pictures; no tops: nothing computed).  Their losses
(Joint3DSquareRootLoss, JSRegularizationLoss, AdaptiveWeightEucLoss, SmoothL1Loss) are dropped as losses.
"""
import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, positive_field, register_layer, torch_sources

# ---- torch functions (model.py gets the same code) ---------------------------------------------


def softmax_3dhm(x, joints: int, depth: int):
    n, g = x.shape[0], x.shape[2]
    v = x.reshape(n, joints, depth * g * g).float().exp().double()
    return (v / v.sum(dim=2, keepdim=True)).float().reshape(n, joints * depth, g, g)


def integral_axis(x, keep: int):
    """The fork's float sum, one term at a time in its loop order (X: z, y; Y: z, x; Z: y, x)."""
    c, h, w = x.shape[1], x.shape[2], x.shape[3]
    if keep == 3:
        terms = x.permute(1, 2, 0, 3).reshape(c * h, x.shape[0], w)
    elif keep == 2:
        terms = x.permute(1, 3, 0, 2).reshape(c * w, x.shape[0], h)
    else:
        terms = x.permute(2, 3, 0, 1).reshape(h * w, x.shape[0], c)
    acc = torch.zeros_like(terms[0])
    for i in range(terms.shape[0]):
        acc = acc + terms[i]
    return acc


def integral_vector(x, lb: float, ub: float):
    n, c = x.shape[0], x.shape[1]
    rows = x.reshape(-1)[: n * c].reshape(n, c).double()
    acc = torch.zeros(n, dtype=torch.float32, device=x.device)
    for i in range(c):
        acc = (acc.double() + ((ub - lb) / c * (i + 0.5) + lb) * rows[:, i]).float()
    return acc.reshape(n, 1)


def last_rise(v):
    """Per row of v (double): the index of the last move of a running maximum (from 0) that moves only where
    a value exceeds it by more than 1e-6, or -1 where it never moves."""
    rows, count = v.shape
    at = torch.full((rows,), -1, dtype=torch.long, device=v.device)
    best = torch.zeros(rows, dtype=torch.float64, device=v.device)
    idx = torch.arange(count, device=v.device)
    while True:
        ok = (idx.unsqueeze(0) > at.unsqueeze(1)) & ((v - best.unsqueeze(1)) > 1e-6)
        found = ok.any(dim=1)
        if not bool(found.any()):
            return at
        nxt = torch.where(ok, idx.unsqueeze(0), torch.full_like(ok, count, dtype=torch.long)).min(dim=1).values
        at = torch.where(found, nxt, at)
        best = torch.where(found, v.gather(1, nxt.clamp(max=count - 1).unsqueeze(1)).squeeze(1), best)


def argmax_hm(x):
    n, c, g = x.shape[0], x.shape[1], x.shape[2]
    at = last_rise(x.reshape(n * c, g * g).double())
    gx = ((at % g).double() + 0.5) / g
    gy = (torch.div(at, g, rounding_mode="floor").double() + 0.5) / g
    gx = torch.where(at < 0, torch.full_like(gx, 0.5), gx)
    gy = torch.where(at < 0, torch.full_like(gy, 0.5), gy)
    return torch.stack([gx, gy], dim=1).float().reshape(n, 2 * c)


def argmax_xyz(x, joints: int, depth: int, size: int, box: list):
    n = x.shape[0]
    at = last_rise(x.reshape(n * joints, depth * size * size).double())
    cells = [at % size, torch.div(at, size, rounding_mode="floor") % size,
             torch.div(at, size * size, rounding_mode="floor")]
    out = []
    for k, (cell, count) in enumerate(zip(cells, (size, size, depth))):
        lb, ub = box[2 * k], box[2 * k + 1]
        pos = (cell.double() + 0.5) / count * (ub - lb) + lb
        out.append(torch.where(at < 0, torch.full_like(pos, 0.5 * (ub - lb) + lb), pos))
    return torch.stack(out, dim=1).float().reshape(n, 3 * joints)


def normalize_response_v0(x, threshold: float):
    n, c, g = x.shape[0], x.shape[1], x.shape[2]
    v = x.reshape(n, c, g * g)
    counted = (v - threshold).double() > 1e-6
    total = torch.where(counted, v.double(), torch.zeros_like(v, dtype=torch.float64)).sum(dim=2, keepdim=True)
    kept = torch.where(v > threshold, v.double() / total, torch.zeros_like(total))
    empty = (total.abs() < 1e-6).flip(1).cumsum(dim=1).flip(1) > 0
    out = torch.where(empty, torch.full_like(kept, 1.0 / g / g), kept)
    return out.float().reshape(n, c, g, g)


def coordinate_regression(x):
    n, j, s = x.shape[0], x.shape[1], x.shape[2]
    hm = x.reshape(n, j, s, s).double()
    grid = torch.arange(s, dtype=torch.float64, device=x.device) / s
    px = (hm * grid.reshape(1, 1, 1, s)).sum(dim=(2, 3))
    py = (hm * grid.reshape(1, 1, s, 1)).sum(dim=(2, 3))
    return torch.stack([px, py], dim=2).float().reshape(n, 2 * j)


TORCH_3DHUMAN = torch_sources(softmax_3dhm, integral_axis, integral_vector, last_rise, argmax_hm, argmax_xyz,
                              normalize_response_v0, coordinate_regression)


def _count(shape):
    return int(np.prod(shape, dtype=np.int64))


def _need_axes(shape, axes, what):
    if len(shape) < axes:
        raise LayerError(f"{what} reads the bottom's axes 0-{axes - 1}; the bottom {list(shape)} has {len(shape)}")


def _square(shape, what):
    _need_axes(shape, 4, what)
    if int(shape[3]) != int(shape[2]):
        raise LayerError(f"{what} reads each channel as {shape[2]} x {shape[2]} (the bottom's axis 2, squared); "
                         f"the bottom {list(shape)} has width {shape[3]}")


def _f32(value):
    return float(np.float32(value))


# ---- the prediction path -------------------------------------------------------------------------

@register_layer("DeepHumanModelSoftmax3DHM")
class Softmax3DHM(Layer):
    def parse(self, lp):
        need_blobs(lp, "DeepHumanModelSoftmax3DHM", 1, 1)
        p = lp.deep_human_model_softmax_3d_hm_param
        return {"joints": positive_field(p.joint_num, "deep_human_model_softmax_3d_hm_param.joint_num"),
                "depth": positive_field(p.depth_dims, "deep_human_model_softmax_3d_hm_param.depth_dims")}

    def infer(self, attrs, in_shapes):
        shape = in_shapes[0]
        _need_axes(shape, 3, "DeepHumanModelSoftmax3DHM")
        n, g = int(shape[0]), int(shape[2])
        need = n * attrs["joints"] * attrs["depth"] * g * g
        if _count(shape) != need:
            raise LayerError(f"DeepHumanModelSoftmax3DHM reads N x joint_num x depth_dims x G x G = {need} values "
                             f"(G the bottom's axis 2); the bottom {list(shape)} has {_count(shape)}")
        return [(n, attrs["joints"] * attrs["depth"], g, g)]

    def forward(self, attrs, params, x):
        return softmax_3dhm(x, attrs["joints"], attrs["depth"])

    def onnx(self, ctx, node):
        a = node.attrs
        n, c, g, _ = (int(d) for d in ctx.shape(node.outputs[0]))
        x = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, a["joints"], -1])], "cubes")
        e = ctx.op("Cast", [ctx.op("Exp", [x], "exp")], "wide", to=11)
        s = ctx.op("ReduceSum", [e, ctx.i64([2])], "sum", keepdims=1)
        q = ctx.op("Cast", [ctx.op("Div", [e, s], "q")], "narrow", to=1)
        ctx.add_node("Reshape", [q, ctx.i64([n, c, g, g])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_3DHUMAN)
        return f"softmax_3dhm({emit.inputs[0]}, {node.attrs['joints']}, {node.attrs['depth']})"


class _Integral(Layer):
    keep = 0

    def parse(self, lp):
        need_blobs(lp, self.types[0], 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != 4:
            raise LayerError(f"{self.types[0]} reads a 4-D bottom (N, C, H, W); the bottom is {list(shape)}")
        return [(int(shape[0]), int(shape[self.keep]))]

    def forward(self, attrs, params, x):
        return integral_axis(x, self.keep)

    def onnx(self, ctx, node):
        axes = [d for d in (1, 2, 3) if d != self.keep]
        ctx.add_node("ReduceSum", [node.inputs[0], ctx.i64(axes)], [node.outputs[0]], name=node.name, keepdims=0)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_3DHUMAN)
        return f"integral_axis({emit.inputs[0]}, {self.keep})"


@register_layer("DeepHumanModelIntegralX")
class IntegralX(_Integral):
    keep = 3


@register_layer("DeepHumanModelIntegralY")
class IntegralY(_Integral):
    keep = 2


@register_layer("DeepHumanModelIntegralZ")
class IntegralZ(_Integral):
    keep = 1


@register_layer("DeepHumanModelIntegralVector")
class IntegralVector(Layer):
    def parse(self, lp):
        need_blobs(lp, "DeepHumanModelIntegralVector", 1, 1)
        p = lp.deep_human_model_integral_vector_param
        return {"lb": _f32(p.dim_lb), "ub": _f32(p.dim_ub)}

    def infer(self, attrs, in_shapes):
        _need_axes(in_shapes[0], 2, "DeepHumanModelIntegralVector")
        return [(int(in_shapes[0][0]), 1)]

    def forward(self, attrs, params, x):
        return integral_vector(x, attrs["lb"], attrs["ub"])

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        n, c = int(shape[0]), int(shape[1])
        lb, ub = node.attrs["lb"], node.attrs["ub"]
        pos = np.array([[(ub - lb) / c * (i + 0.5) + lb] for i in range(c)], np.float64)
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "flat")
        rows = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([n * c]), ctx.i64([0])], "head")
        rows = ctx.op("Cast", [ctx.op("Reshape", [rows, ctx.i64([n, c])], "rows")], "wide", to=11)
        dot = ctx.op("MatMul", [rows, ctx.const(pos, node.name + "_pos")], "dot")
        ctx.add_node("Cast", [dot], [node.outputs[0]], name=node.name, to=1)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_3DHUMAN)
        return f"integral_vector({emit.inputs[0]}, {emit.lit(node.attrs['lb'])}, {emit.lit(node.attrs['ub'])})"


@register_layer("DeepHumanModelArgmaxHM")
class ArgmaxHM(Layer):
    onnx_refusal = ("DeepHumanModelArgmaxHM keeps a running maximum that moves only by more than 1e-6, a "
                    "data-dependent scan")

    def parse(self, lp):
        need_blobs(lp, "DeepHumanModelArgmaxHM", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        _square(in_shapes[0], "DeepHumanModelArgmaxHM")
        return [(int(in_shapes[0][0]), 2 * int(in_shapes[0][1]))]

    def forward(self, attrs, params, x):
        return argmax_hm(x)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_3DHUMAN)
        return f"argmax_hm({emit.inputs[0]})"


@register_layer("DeepHumanModelH36MChaGenJointFrXYZHeatmap")
class ChaGenJointFrXYZHeatmap(Layer):
    onnx_refusal = ("DeepHumanModelH36MChaGenJointFrXYZHeatmap keeps a running maximum that moves only by more "
                    "than 1e-6, a data-dependent scan")

    def parse(self, lp):
        need_blobs(lp, "DeepHumanModelH36MChaGenJointFrXYZHeatmap", 1, 1)
        p = lp.deep_human_model_h36m_cha_gen_joint_fr_xyz_heatmap_param
        what = "deep_human_model_h36m_cha_gen_joint_fr_xyz_heatmap_param."
        return {"joints": positive_field(p.joint_num, what + "joint_num"),
                "depth": positive_field(p.depth_dims, what + "depth_dims"),
                "size": positive_field(p.map_size, what + "map_size"),
                "box": [_f32(v) for v in (p.x_lb, p.x_ub, p.y_lb, p.y_ub, p.z_lb, p.z_ub)]}

    def infer(self, attrs, in_shapes):
        shape = in_shapes[0]
        _need_axes(shape, 1, "DeepHumanModelH36MChaGenJointFrXYZHeatmap")
        n = int(shape[0])
        need = n * attrs["joints"] * attrs["depth"] * attrs["size"] ** 2
        if _count(shape) != need:
            raise LayerError(f"DeepHumanModelH36MChaGenJointFrXYZHeatmap reads N x joint_num x depth_dims x "
                             f"map_size^2 = {need} values; the bottom {list(shape)} has {_count(shape)}")
        return [(n, 3 * attrs["joints"])]

    def forward(self, attrs, params, x):
        return argmax_xyz(x, attrs["joints"], attrs["depth"], attrs["size"], attrs["box"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(TORCH_3DHUMAN)
        box = "[" + ", ".join(emit.lit(v) for v in a["box"]) + "]"
        return f"argmax_xyz({emit.inputs[0]}, {a['joints']}, {a['depth']}, {a['size']}, {box})"


@register_layer("DeepHumanModelNormalizationResponseV0")
class NormalizationResponseV0(Layer):
    def parse(self, lp):
        need_blobs(lp, "DeepHumanModelNormalizationResponseV0", 1, 1)
        return {"threshold": _f32(lp.normalization_response_param.hm_threshold)}

    def infer(self, attrs, in_shapes):
        _square(in_shapes[0], "DeepHumanModelNormalizationResponseV0")
        return [tuple(int(d) for d in in_shapes[0])]

    def forward(self, attrs, params, x):
        return normalize_response_v0(x, attrs["threshold"])

    def onnx(self, ctx, node):
        n, c, g, _ = (int(d) for d in ctx.shape(node.inputs[0]))
        thr = ctx.f32(node.attrs["threshold"])
        v = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, c, g * g])], "v")
        wide = ctx.op("Cast", [v], "wide", to=11)
        diff = ctx.op("Cast", [ctx.op("Sub", [v, thr], "diff")], "diff_wide", to=11)
        counted = ctx.op("Greater", [diff, ctx.const(np.array(1e-6), node.name + "_eps")], "counted")
        zero = ctx.const(np.array(0.0), node.name + "_zero")
        total = ctx.op("ReduceSum", [ctx.op("Where", [counted, wide, zero], "terms"), ctx.i64([2])], "total",
                       keepdims=1)
        kept = ctx.op("Where", [ctx.op("Greater", [v, thr], "above"), ctx.op("Div", [wide, total], "q"), zero],
                      "kept")
        small = ctx.op("Cast", [ctx.op("Less", [ctx.op("Abs", [total], "abs"),
                                                ctx.const(np.array(1e-6), node.name + "_eps2")], "small")],
                       "small_i", to=7)
        later = ctx.op("CumSum", [small, ctx.const(np.array(1, np.int64), node.name + "_axis")], "later",
                       reverse=1)
        empty = ctx.op("Greater", [later, ctx.const(np.array(0, np.int64), node.name + "_none")], "empty")
        out = ctx.op("Where", [empty, ctx.const(np.array(1.0 / g / g), node.name + "_u"), kept], "out")
        out = ctx.op("Cast", [out], "narrow", to=1)
        ctx.add_node("Reshape", [out, ctx.i64([n, c, g, g])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_3DHUMAN)
        return f"normalize_response_v0({emit.inputs[0]}, {emit.lit(node.attrs['threshold'])})"


@register_layer("DeepHumanModelNumericalCoordinateRegression")
class NumericalCoordinateRegression(Layer):
    def parse(self, lp):
        need_blobs(lp, "DeepHumanModelNumericalCoordinateRegression", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        _square(in_shapes[0], "DeepHumanModelNumericalCoordinateRegression")
        return [(int(in_shapes[0][0]), 2 * int(in_shapes[0][1]))]

    def forward(self, attrs, params, x):
        return coordinate_regression(x)

    def onnx(self, ctx, node):
        n, j, s, _ = (int(d) for d in ctx.shape(node.inputs[0]))
        hm = ctx.op("Cast", [ctx.op("Reshape", [node.inputs[0], ctx.i64([n * j, s * s])], "hm")], "wide", to=11)
        grid = np.zeros((s * s, 2), np.float64)
        for row in range(s):
            for col in range(s):
                grid[row * s + col] = (col / s, row / s)
        dot = ctx.op("MatMul", [hm, ctx.const(grid, node.name + "_grid")], "dot")
        out = ctx.op("Cast", [dot], "narrow", to=1)
        ctx.add_node("Reshape", [out, ctx.i64([n, 2 * j])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_3DHUMAN)
        return f"coordinate_regression({emit.inputs[0]})"


@register_layer("MulRGB")
class MulRGB(Layer):
    def parse(self, lp):
        need_blobs(lp, "MulRGB", 1, 1)
        return {"factor": _f32(lp.mul_rgb_param.mul_factor)}

    def infer(self, attrs, in_shapes):
        _square(in_shapes[0], "MulRGB")
        if int(in_shapes[0][1]) != 3:
            raise LayerError(f"MulRGB reads 3 channels; the bottom {list(in_shapes[0])} has {in_shapes[0][1]}")
        return [tuple(int(d) for d in in_shapes[0])]

    def forward(self, attrs, params, x):
        return x * attrs["factor"]

    def onnx(self, ctx, node):
        ctx.add_node("Mul", [node.inputs[0], ctx.f32(node.attrs["factor"])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]} * {emit.lit(node.attrs['factor'])}"

