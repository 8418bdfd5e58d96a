"""zlmzju/caffe's GuidedFilter (He et al.'s guided image filter, ECCV 2010): map branch d967511 (the corpus file's
commit 5a5f860 has the same layer), src/caffe/layers/guidedfilter_layer.cpp, include/caffe/vision_layers.hpp,
src/caffe/test/test_guidedfilter_layer.cpp; guided_filter_param (src/caffe/proto/caffe.proto:
GuidedFilterParameter window_size = 1 [32], epsilon = 2 [1e-8], float; 131 there, prelu_param here: 10131).

Bottoms: the guide I (N, C, H, W) and the coarse map p (1, 1, H, W); the top is shaped like I.  Reshape CHECKs
that p has one channel.  Every mean is Caffe's AVE pooling of one H x W map with kernel window_size + 1, stride 1,
pad window_size / 2: for an even window_size each output divides its zero-padded window's sum by the whole
kernel area.  Per channel of each image, in float32 as the fork:
  mean_I, mean_p, corr_Ip = mean(I p), corr_II = mean(I I);
  a = (corr_Ip - mean_I mean_p) / ((corr_II - mean_I mean_I) + epsilon); b = mean_p - a mean_I;
  q = mean(a) I + mean(b).
Every channel is filtered with the same p (the fork never offsets p by image).  The fork's loop reads each
channel of I as p's count of values at I's channel offset and writes that many into the top, so:
- an odd window_size makes the pooled map one pixel smaller (kernel 2r + 2, pad r): the rest of the buffer the
  fork reads is uninitialized memory;
- p with N > 1 gives a count of N H W per channel: the fork reads and writes past the blobs;
- I's H x W must hold as many values as p's (a channel of another H and W of that count is read flat as p's H x W);
- a window_size of 46340 or more makes the kernel's area, the int pool_size Caffe's AVE pooling divides by, overflow.
Those cases are refused at run time (cannot_run); a window_size past 2^31 - 1 wraps negative in the fork's int and
fails the pooling's kernel_size > 0 CHECK: refused when read.  The GPU forward copies to the host and runs the
same steps.
"""
import torch
import torch.nn.functional as F

from ..errors import ExportError
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer

INT_MAX = 2 ** 31 - 1


def guided_filter(guide, coarse, window: int, epsilon: float):
    """The fork's guided filter of every channel of `guide` (N, C, ...) by the one map `coarse` (1, 1, H, W)
    (H W values per guide channel, read flat), float32 steps as the fork's; the top has guide's shape."""
    h, w = coarse.shape[2], coarse.shape[3]
    image = guide.reshape(-1, 1, h, w)
    p = coarse.reshape(1, 1, h, w)

    def mean(x):   # Caffe's AVE pooling, kernel window + 1, pad window / 2: the whole kernel area divides
        return F.avg_pool2d(x, window + 1, stride=1, padding=window // 2, count_include_pad=True)

    mean_i, mean_p = mean(image), mean(p)
    cov_ip = mean(image * p) - mean_i * mean_p
    var_i = mean(image * image) - mean_i * mean_i
    a = cov_ip / (var_i + torch.tensor(epsilon, dtype=var_i.dtype, device=var_i.device))
    b = mean_p - a * mean_i
    return (mean(a) * image + mean(b)).reshape(guide.shape)


@register_layer("GuidedFilter")
class GuidedFilter(Layer):
    def parse(self, lp):
        need_blobs(lp, "GuidedFilter", 2, 1, "guide image, coarse map")
        p = lp.guided_filter_param
        if p.window_size > INT_MAX:   # the fork's int wraps it negative: its pooling CHECKs kernel_size > 0
            raise LayerError(f"guided_filter_param.window_size {p.window_size} is past the fork's int "
                             f"({INT_MAX}): it wraps negative and the mean filter's kernel_size > 0 CHECK fails")
        return {"name": lp.name, "window": int(p.window_size), "epsilon": float(p.epsilon)}

    def infer(self, attrs, in_shapes):
        coarse = legacy_nchw(in_shapes[1], "GuidedFilter's coarse map (bottom 1)")
        if coarse[1] != 1:
            raise LayerError(f"GuidedFilter's coarse map (bottom 1) must have 1 channel (the fork's CHECK), "
                             f"got shape {list(in_shapes[1])}")
        return [tuple(in_shapes[0])]

    def cannot_run(self, attrs, in_shapes):
        guide, coarse = (tuple(s) for s in in_shapes)
        window = attrs["window"]
        if window % 2:
            return (f"guided_filter_param.window_size {window} is odd: the fork's mean filter (AVE pooling, kernel "
                    f"{window + 1}, pad {window // 2}) gives a smaller map and the fork reads the rest of its "
                    f"buffer uninitialized")
        if (window + 1) ** 2 > INT_MAX:
            return (f"guided_filter_param.window_size {window}: the fork's AVE pooling divides by the kernel's "
                    f"area {(window + 1) ** 2} as an int, which overflows")
        if len(guide) > 4:
            return f"the fork reads the guide {list(guide)} through num/channels/height/width (at most 4 axes)"
        n1, _, h1, w1 = legacy_nchw(coarse, "GuidedFilter's coarse map (bottom 1)")
        if n1 != 1:
            return (f"the coarse map {list(coarse)} has {n1} images: the fork filters {n1} x H x W values per "
                    f"channel and writes past the top (only N = 1 is defined)")
        _, _, h0, w0 = legacy_nchw(guide, "GuidedFilter")
        if h0 * w0 != h1 * w1:
            return (f"the guide's {h0} x {w0} channels do not hold the coarse map's {h1} x {w1} values the fork "
                    f"reads from each (it would read past them or leave the top partly unwritten)")
        return None

    def _args(self, attrs):
        return attrs["window"], float(torch.tensor(attrs["epsilon"], dtype=torch.float32))

    def forward(self, attrs, params, guide, coarse):
        self.refuse_if_cannot_run(attrs["name"], attrs, [guide.shape, coarse.shape], LayerError)
        legacy = legacy_nchw(coarse.shape, "GuidedFilter")
        return guided_filter(guide, coarse.reshape(legacy), *self._args(attrs))

    def macs(self, attrs, in_shapes, out_shapes):
        k = attrs["window"] + 1
        n, c, h, w = legacy_nchw(in_shapes[0], "GuidedFilter")
        return n * c * h * w * (6 * k * k + 10)

    def onnx(self, ctx, node):
        shapes = [ctx.shape(t) for t in node.inputs]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        window, epsilon = self._args(node.attrs)
        h, w = legacy_nchw(shapes[1], "GuidedFilter")[2:]
        image = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, 1, h, w])], "image")
        p = ctx.op("Reshape", [node.inputs[1], ctx.i64([1, 1, h, w])], "p")
        r = window // 2

        def mean(x, hint):
            return ctx.op("AveragePool", [x], hint, kernel_shape=[window + 1] * 2, strides=[1, 1], pads=[r] * 4,
                          count_include_pad=1)

        mean_i, mean_p = mean(image, "mean_i"), mean(p, "mean_p")
        cov = ctx.op("Sub", [mean(ctx.op("Mul", [image, p], "ip"), "corr_ip"),
                             ctx.op("Mul", [mean_i, mean_p], "mi_mp")], "cov_ip")
        var = ctx.op("Sub", [mean(ctx.op("Mul", [image, image], "ii"), "corr_ii"),
                             ctx.op("Mul", [mean_i, mean_i], "mi_mi")], "var_i")
        a = ctx.op("Div", [cov, ctx.op("Add", [var, ctx.f32(epsilon)], "var_eps")], "a")
        b = ctx.op("Sub", [mean_p, ctx.op("Mul", [a, mean_i], "a_mi")], "b")
        q = ctx.op("Add", [ctx.op("Mul", [mean(a, "mean_a"), image], "ma_i"), mean(b, "mean_b")], "q")
        ctx.add_node("Reshape", [q, ctx.i64(list(shapes[0]))], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0), emit.in_shape(1)], ExportError)
        window, epsilon = self._args(node.attrs)
        coarse = f"{emit.inputs[1]}.reshape{legacy_nchw(emit.in_shape(1), 'GuidedFilter')}"
        return (f"{emit.helper(guided_filter)}({emit.inputs[0]}, {coarse}, {window}, "
                f"{emit.lit(epsilon, exact=True)})")


__all__ = ["GuidedFilter", "guided_filter"]
