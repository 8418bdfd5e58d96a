"""mitmul/caffe's Augment layer (branch nvidia 34e2573, src/caffe/layers/augment_layer.cpp), which
mitmul/ssai's road and building extraction nets put after their input.

Augment (augment_param: crop_size and binarize, one per bottom; flip, rotate; subtract and divide, one
per channel of bottom 0; mean_normalize, stddev_normalize): as many tops as bottoms, top i (N, C_i, s_i,
s_i) for crop_size s_i.  Per item, in every phase:
- each bottom's centre s x s patch, from column W / 2 - s / 2 and row H / 2 - s / 2 (integer halves);
- with binarize, each value becomes 1 where it is above 0.5, else 0 (OpenCV's THRESH_BINARY);
- bottom 0 only: with mean_normalize each channel less its own mean over the patch, then with
  stddev_normalize divided by that channel's standard deviation (OpenCV's meanStdDev over the patch as
  it stands then: sqrt(max(E[x^2] - E[x]^2, 0)), both in double, taken once before the subtraction);
  then `subtract` and `divide` (one constant per channel).
flip and rotate draw a random flip / angle at every forward, at TEST too: caffeq sizes such a layer and
refuses to run it.  The fork reads binarize per bottom and fails without it; caffeq reads it as false.

PatchTransformer (mitmul/caffe ssai branch 95db65c, src/caffe/layers/patch_transformer.cpp; deepbasu007/caffe-fcn
eb073b1 adds a vertical flip) is the same layer under its earlier name, its patch_transformer_param the same
fields: the ssai and ssai-fcn predict.prototxt files.
"""
import torch

from .registry import AT_LEAST, Layer, LayerError, need_blobs, register_layer


def augment_crop(x, size: int, binarize: bool):
    """The centre size x size patch of x (N, C, H, W), binarized at 0.5 when asked."""
    top, left = x.shape[2] // 2 - size // 2, x.shape[3] // 2 - size // 2
    patch = x[:, :, top:top + size, left:left + size]
    return (patch > 0.5).to(x.dtype) if binarize else patch


def augment_normalize(x, mean_normalize: bool, stddev_normalize: bool, subtract: list[float], divide: list[float]):
    """Bottom 0's patch normalization: each item's channels less their mean, over their deviation (both
    taken before either applies, in double), then less `subtract`, over `divide` (per channel)."""
    flat = x.to(torch.float64).reshape(x.shape[0], x.shape[1], -1)
    mean = flat.mean(dim=2)
    std = torch.sqrt(torch.clamp((flat * flat).mean(dim=2) - mean * mean, min=0.0))
    shape = (x.shape[0], x.shape[1], 1, 1)
    if mean_normalize:
        x = x - mean.to(x.dtype).reshape(shape)
    if stddev_normalize:
        x = x * (1.0 / std).to(x.dtype).reshape(shape)
    if subtract:
        x = x - torch.tensor(subtract, dtype=x.dtype, device=x.device).reshape(1, -1, 1, 1)
    if divide:
        x = x * (1.0 / torch.tensor(divide, dtype=torch.float64, device=x.device)).to(x.dtype).reshape(1, -1, 1, 1)
    return x


@register_layer("Augment")
class Augment(Layer):
    #: the LayerParameter field holding the layer's AugmentParameter
    param_field = "augment_param"

    def parse(self, lp):
        need_blobs(lp, self.types[0], range(1, AT_LEAST), len(lp.bottom) or 1)
        f = self.param_field
        p = getattr(lp, f)
        sizes = [int(s) for s in p.crop_size]
        if len(sizes) != len(lp.bottom):
            raise LayerError(f"{f} needs one crop_size per bottom ({len(lp.bottom)}), got {len(sizes)}")
        binarize = [bool(b) for b in p.binarize] or [False] * len(sizes)
        if len(binarize) != len(sizes):
            raise LayerError(f"{f} needs one binarize per bottom ({len(sizes)}), got {len(binarize)}")
        return {"name": lp.name, "sizes": sizes, "binarize": binarize, "random": bool(p.flip or p.rotate),
                "mean_normalize": bool(p.mean_normalize), "stddev_normalize": bool(p.stddev_normalize),
                "subtract": [float(v) for v in p.subtract], "divide": [float(v) for v in p.divide]}

    def infer(self, attrs, in_shapes):
        tops = []
        for i, (shape, size) in enumerate(zip(in_shapes, attrs["sizes"])):
            if len(shape) != 4:
                raise LayerError(f"{self.types[0]} reads (N, C, H, W) bottoms, bottom {i} is {list(shape)}")
            n, c, h, w = shape
            if not 0 < size <= min(h, w):
                raise LayerError(f"{self.param_field}.crop_size {size} does not fit bottom {i}'s {h} x {w}")
            tops.append((n, c, size, size))
        c0 = in_shapes[0][1]
        for field in ("subtract", "divide"):
            if attrs[field] and len(attrs[field]) != c0:
                raise LayerError(f"{self.param_field}.{field} needs one value per channel of bottom 0 ({c0}), "
                                 f"got {len(attrs[field])}")
        return tops

    def _check_runs(self, attrs):
        if attrs["random"]:
            raise LayerError(f"layer '{attrs['name']}' ({self.types[0]}): flip / rotate draw a random flip or angle at every "
                             f"forward, in every phase; caffeq does not run it")

    def forward(self, attrs, params, *bottoms):
        self._check_runs(attrs)
        tops = [augment_crop(x, s, b) for x, s, b in zip(bottoms, attrs["sizes"], attrs["binarize"])]
        tops[0] = augment_normalize(tops[0], attrs["mean_normalize"], attrs["stddev_normalize"], attrs["subtract"],
                                    attrs["divide"])
        return tops[0] if len(tops) == 1 else tuple(tops)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self._check_runs(a)
        crop = emit.helper(augment_crop)
        tops = [f"{crop}({x}, {s}, {b})" for x, s, b in zip(emit.inputs, a["sizes"], a["binarize"])]
        args = [emit.lit(a[k]) for k in ("mean_normalize", "stddev_normalize", "subtract", "divide")]
        tops[0] = f"{emit.helper(augment_normalize)}({tops[0]}, {', '.join(args)})"
        return tops[0] if len(tops) == 1 else tops

    def onnx(self, ctx, node):
        from .norm import onnx_reduce
        a, name = node.attrs, node.name
        self._check_runs(a)
        for i, (x, top, size, binarize) in enumerate(zip(node.inputs, node.outputs, a["sizes"], a["binarize"])):
            _, c, h, w = ctx.shape(x)
            r0, c0 = h // 2 - size // 2, w // 2 - size // 2
            out = top if (i or not _normalizes(a)) and not binarize else ctx.tmp(f"{name}_crop{i}")
            ctx.add_node("Slice", [x, ctx.i64([r0, c0]), ctx.i64([r0 + size, c0 + size]), ctx.i64([2, 3])], [out],
                         name=name if i == 0 else None)
            if binarize:
                last = top if i or not _normalizes(a) else ctx.tmp(f"{name}_binary{i}")
                ctx.add_node("Cast", [ctx.op("Greater", [out, ctx.f32(0.5)], f"above{i}")], [last], to=1)
                out = last
            if i or not _normalizes(a):
                continue
            y = out
            if a["mean_normalize"] or a["stddev_normalize"]:
                wide = ctx.op("Cast", [out], "wide", to=11)
                mean = onnx_reduce(ctx, "ReduceMean", wide, [2, 3], True)
                square = onnx_reduce(ctx, "ReduceMean", ctx.op("Mul", [wide, wide], "sq"), [2, 3], True)
                var = ctx.op("Max", [ctx.op("Sub", [square, ctx.op("Mul", [mean, mean], "m2")], "var"),
                                     ctx.const(_f64(0.0))], "var0")
                if a["mean_normalize"]:
                    y = ctx.op("Sub", [y, ctx.op("Cast", [mean], "mean32", to=1)], "centred")
                if a["stddev_normalize"]:
                    inv = ctx.op("Div", [ctx.const(_f64(1.0)), ctx.op("Sqrt", [var], "std")], "inv_std")
                    y = ctx.op("Mul", [y, ctx.op("Cast", [inv], "inv_std32", to=1)], "scaled")
            if a["subtract"]:
                y = ctx.op("Sub", [y, ctx.f32([[[v]] for v in a["subtract"]])], "less")
            if a["divide"]:
                y = ctx.op("Mul", [y, ctx.f32([[[1.0 / v]] for v in a["divide"]])], "over")
            ctx.add_node("Identity", [y], [top])


@register_layer("PatchTransformer")
class PatchTransformer(Augment):
    """Augment under its ssai-branch name (see the module docstring); one or two bottoms (image, label)."""
    param_field = "patch_transformer_param"

    def parse(self, lp):
        need_blobs(lp, "PatchTransformer", (1, 2), len(lp.bottom) or 1, "image (, label)")
        return super().parse(lp)


def _normalizes(attrs):
    return bool(attrs["mean_normalize"] or attrs["stddev_normalize"] or attrs["subtract"] or attrs["divide"])


def _f64(v):
    import numpy as np
    return np.array(v, np.float64)
