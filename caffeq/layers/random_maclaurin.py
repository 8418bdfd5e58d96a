"""He-Zhenwei/MAF (92c84ea) RandomMaclaurin: caffe-fast-rcnn/src/caffe/layers/random_maclaurin_layer.{cpp,cu},
random_maclaurin_param (RandomMaclaurionParameter, 8266698; proto/caffe.proto).

Random Maclaurin features of two bottoms x1 (N, K1), x2 (N, K2): top (N, num_output) =
(x1 W1) * (x2 W2) * float(1 / f), W1 (K1, num_output) and W2 (K2, num_output) the layer's two blobs, f the
normalize factor in float: num_output (bernoulli, the default: W entries 0 or 1), num_output std1 std2
(gaussian), num_output b1 b2 / 3 (uniform).  The matrices are the layer's blobs, saved in the caffemodel:
the fork draws them from Caffe's RNG at setup (before the weights are loaded over them) and again in the
Reshape that Layer::Forward runs, at forward epoch_size + 1 and every epoch_size + 1 forwards after, so a loaded
net computes with the stored ones for its first epoch_size forwards (none at the default epoch_size 0: a
reading note says so); caffeq always uses the stored blobs (with random_weights, random ones).
random_every_epoch, fixed_matrix, a1 and a2 (the uniform draw's lower bounds) leave the forward unchanged.  The GEMMs take K = shape(1) while the blobs
are sized count(1): caffeq needs the two to agree (2-axis bottoms, or trailing 1s).  Forward_gpu is the
forward (Forward_cpu is empty).
"""
import torch
import torch.nn as nn

from .registry import Layer, LayerError, count, need_blobs, positive_field, register_layer

_DISTRIBUTIONS = ("bernoulli", "gaussian", "uniform")


def maclaurin_scale(num_output: int, distribution: str, std1: float, std2: float, b1: float, b2: float):
    """float(1.0 / f), f the fork's normalize factor computed in float32."""
    f32 = torch.tensor
    if distribution == "bernoulli":
        f = f32(float(num_output), dtype=torch.float32)
    elif distribution == "gaussian":
        f = f32(float(num_output), dtype=torch.float32) * f32(std1, dtype=torch.float32) * f32(std2, dtype=torch.float32)
    else:
        f = f32(float(num_output), dtype=torch.float32) * f32(b1, dtype=torch.float32) * f32(b2, dtype=torch.float32) \
            / f32(3.0, dtype=torch.float32)
    if float(f) == 0:
        raise LayerError(f"random_maclaurin_param gives a normalize factor of 0 ({distribution}): the fork scales "
                         f"by 1 / 0")
    return float(torch.tensor(1.0 / float(f), dtype=torch.float32))


def random_maclaurin(x1, x2, w1, w2, scale: float):
    n = x1.shape[0]
    return torch.matmul(x1.reshape(n, -1), w1) * torch.matmul(x2.reshape(n, -1), w2) * scale


class RandomMaclaurinModule(nn.Module):
    def __init__(self, k1: int, k2: int, num_output: int, scale: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(k1, num_output))
        self.w2 = nn.Parameter(torch.zeros(k2, num_output))
        self.scale = scale

    def forward(self, x1, x2):
        return random_maclaurin(x1, x2, self.w1, self.w2, self.scale)


@register_layer("RandomMaclaurin")
class RandomMaclaurin(Layer):
    blob_names = ("w1", "w2")

    def parse(self, lp):
        need_blobs(lp, "RandomMaclaurin", 2, 1, "x1, x2", in_place=False)
        p = lp.random_maclaurin_param
        kind = str(p.distribution_type)
        if kind not in _DISTRIBUTIONS:
            raise LayerError(f"random_maclaurin_param.distribution_type must be one of {', '.join(_DISTRIBUTIONS)}, "
                             f"got {kind!r}")
        num = positive_field(p.num_output, "random_maclaurin_param.num_output")
        scale = maclaurin_scale(num, kind, float(p.std1), float(p.std2), float(p.b1), float(p.b2))
        a = {"num_output": num, "scale": scale}
        if int(p.epoch_size) == 0:
            a["reading_notes"] = ["RandomMaclaurin with epoch_size 0: the fork draws new matrices in the Reshape "
                                  "of every forward, so it never computes with stored ones; caffeq uses the "
                                  "layer's stored blobs"]
        return a

    def infer(self, attrs, in_shapes):
        for i, s in enumerate(in_shapes[:2]):
            if len(s) < 2 or s[1] != count(s, 1):
                raise LayerError(f"RandomMaclaurin bottom {i} {list(s)}: the fork's GEMM reads shape(1) values a "
                                 f"row and sizes its matrix by count(1); caffeq needs them equal")
        if in_shapes[0][0] != in_shapes[1][0]:
            raise LayerError(f"RandomMaclaurin bottoms need one batch, got {list(in_shapes[0])} and "
                             f"{list(in_shapes[1])}")
        return [(in_shapes[0][0], attrs["num_output"])]

    def param_shapes(self, attrs, in_shapes):
        return [(count(s, 1), attrs["num_output"]) for s in in_shapes[:2]]

    def forward(self, attrs, params, x1, x2):
        return random_maclaurin(x1, x2, params[0], params[1], attrs["scale"])

    def onnx(self, ctx, node):
        a = [ctx.op("Flatten", [x], f"x{i}", axis=1) for i, x in enumerate(node.inputs)]
        p1 = ctx.op("MatMul", [a[0], ctx.weight(node, 0)], "p1")
        p2 = ctx.op("MatMul", [a[1], ctx.weight(node, 1)], "p2")
        ctx.add_node("Mul", [ctx.op("Mul", [p1, p2], "product"), ctx.f32(node.attrs["scale"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.instance(RandomMaclaurinModule, count(emit.in_shape(0), 1), count(emit.in_shape(1), 1),
                          node.attrs["num_output"], node.attrs["scale"], needs=[random_maclaurin])
        emit.param("w1", 0)
        emit.param("w2", 1)
        return f"{m}({', '.join(emit.inputs)})"


__all__ = ["RandomMaclaurin", "random_maclaurin"]
