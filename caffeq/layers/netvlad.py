"""NetVLAD in Caffe, as hyojinie/crn (a88e0b3, "Learned Contextual Feature Reweighting for Image
Geo-Localization") implements it: caffe/src/caffe/layers/netvlad_layer.cpp/.cu, intranorm_layer.cpp/.cu and
spfilter_layer.cpp/.cu.

- Netvlad (netvlad_param: cluster_num K, local_dim D, vlad_dim = K D): bottoms the soft assignment
  (N, K, H, W) and the local features (N, D, H, W); one blob, the cluster centres (K, D); top (N, K D) with
  top[n, k D + d] = sum over positions p of a[n, k, p] (x[n, d, p] + c[k, d]).  The fork adds the centre
  (its gemm's alpha is +1; the trained blobs hold the negated centres), on CPU and GPU alike.
- Intranorm (intranorm_param.cluster_num K): each item's values as K equal blocks, each scaled by
  (sum of its squares + 1e-12)^-0.5; the top keeps the bottom's shape.
- Spfilter: bottoms b_0 .. b_{m-1} and a selector (N, ...) of H W values per item; m tops, top t =
  b_t times the selector at each position, the same for every channel.
"""
import torch

from .norm import onnx_reduce
from .registry import AT_LEAST, Layer, LayerError, count, need_blobs, register_layer

INTRANORM_EPS = 1e-12


def netvlad(assign, features, centres):
    """crn's NetVLAD: (N, K D) = per cluster sum_p a (x + c) over the (N, K, P) assignment and (N, D, P) features."""
    n, k = assign.shape[0], assign.shape[1]
    a = assign.reshape(n, k, -1)
    x = features.reshape(n, features.shape[1], -1)
    v = torch.matmul(a, x.transpose(1, 2)) + a.sum(dim=2, keepdim=True) * centres
    return v.reshape(n, -1)


def intranorm(x, clusters: int, eps: float = 1e-12):
    """crn's Intranorm: each item's K blocks scaled by (sum of squares + eps)^-0.5 (the fork's 1e-12), shaped as x."""
    blocks = x.reshape(x.shape[0], clusters, -1)
    scale = torch.pow((blocks * blocks).sum(dim=2, keepdim=True) + eps, -0.5)
    return (blocks * scale).reshape(x.shape)


def spatial_filter(x, selector):
    """crn's Spfilter: x (N, C, H, W) times the selector's H W values of each item, every channel alike."""
    return x * selector.reshape(x.shape[0], 1, x.shape[2], x.shape[3])


@register_layer("Netvlad")
class Netvlad(Layer):
    blob_names = ("centres",)

    def parse(self, lp):
        need_blobs(lp, "Netvlad", 2, 1, "soft assignment, local features")
        p = lp.netvlad_param
        k, d, v = int(p.cluster_num), int(p.local_dim), int(p.vlad_dim)
        if v != k * d:
            raise LayerError(f"netvlad_param.vlad_dim {v} must be cluster_num x local_dim = {k} x {d}")
        return {"clusters": k, "local_dim": d}

    def infer(self, attrs, in_shapes):
        a, x = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(a) != 4 or len(x) != 4:
            raise LayerError(f"Netvlad reads (N, K, H, W) assignments and (N, D, H, W) features, got {list(a)} "
                             f"and {list(x)}")
        k, d = attrs["clusters"], attrs["local_dim"]
        if a[1] != k or x[1] != d:
            raise LayerError(f"Netvlad: the assignment's {a[1]} channels must be cluster_num {k} and the "
                             f"features' {x[1]} local_dim {d}")
        if a[0] != x[0] or a[2:] != x[2:]:
            raise LayerError(f"Netvlad: the two bottoms must share batch, height and width: {list(a)} and {list(x)}")
        return [(x[0], k * d)]

    def param_shapes(self, attrs, in_shapes):
        return [(attrs["clusters"], attrs["local_dim"])]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0]) * attrs["local_dim"]

    def forward(self, attrs, params, assign, features):
        return netvlad(assign, features, params[0])

    def pytorch_source(self, node, emit):
        attr = emit.extra_attr("centres")
        centres = emit.module(f"nn.Parameter(torch.zeros({attrs_shape(node)}))", attr=attr)
        emit.param("", 0, attr=attr)
        return f"{emit.helper(netvlad)}({emit.inputs[0]}, {emit.inputs[1]}, {centres})"

    def onnx(self, ctx, node):
        assign, features = node.inputs
        n, k, h, w = ctx.shape(assign)
        d = node.attrs["local_dim"]
        a = ctx.add_node("Reshape", [assign, ctx.i64([0, k, h * w])], [ctx.tmp(node.name + "_a")], name=node.name)[0]
        x = ctx.op("Reshape", [features, ctx.i64([0, d, h * w])], "x")
        ax = ctx.op("MatMul", [a, ctx.op("Transpose", [x], "xt", perm=[0, 2, 1])], "ax")
        mass = onnx_reduce(ctx, "ReduceSum", a, [2], True)
        v = ctx.op("Add", [ax, ctx.op("Mul", [mass, ctx.weight(node, 0)], "ac")], "v")
        ctx.add_node("Reshape", [v, ctx.i64([0, k * d])], [node.outputs[0]])


def attrs_shape(node):
    return ", ".join(str(v) for v in (node.attrs["clusters"], node.attrs["local_dim"]))


@register_layer("Intranorm")
class Intranorm(Layer):
    bottoms = tops = 1

    def parse(self, lp):
        super().parse(lp)
        k = int(lp.intranorm_param.cluster_num)
        if k < 1:
            raise LayerError(f"intranorm_param.cluster_num must be >= 1, got {k}")
        return {"clusters": k}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if not s or count(s, 1) % attrs["clusters"]:
            raise LayerError(f"Intranorm: each item's {count(s, 1) if s else 0} values do not split into "
                             f"cluster_num {attrs['clusters']} blocks")
        return [s]

    def forward(self, attrs, params, x):
        return intranorm(x, attrs["clusters"], INTRANORM_EPS)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(intranorm)}({emit.inputs[0]}, {node.attrs['clusters']}, {emit.lit(INTRANORM_EPS)})"

    def onnx(self, ctx, node):
        x, k = node.inputs[0], node.attrs["clusters"]
        blocks = ctx.add_node("Reshape", [x, ctx.i64([0, k, -1])], [ctx.tmp(node.name + "_blocks")], name=node.name)[0]
        sse = onnx_reduce(ctx, "ReduceSumSquare", blocks, [2], True)
        scale = ctx.op("Pow", [ctx.op("Add", [sse, ctx.f32(INTRANORM_EPS)], "sse_eps"), ctx.f32(-0.5)], "scale")
        ctx.add_node("Reshape", [ctx.op("Mul", [blocks, scale], "scaled"), ctx.i64(list(ctx.shape(x)))],
                     [node.outputs[0]])


@register_layer("Spfilter")
class Spfilter(Layer):
    def parse(self, lp):
        need_blobs(lp, "Spfilter", range(2, AT_LEAST), len(lp.bottom) - 1 if len(lp.bottom) > 1 else 1,
                   "maps..., selector")
        return {}

    def infer(self, attrs, in_shapes):
        selector = tuple(in_shapes[-1])
        for i, s in enumerate(in_shapes[:-1]):
            if len(s) != 4:
                raise LayerError(f"Spfilter reads (N, C, H, W) maps, bottom {i} is {list(s)}")
            if selector[0] != s[0] or count(selector, 1) != s[2] * s[3]:
                raise LayerError(f"Spfilter: the selector {list(selector)} needs bottom {i}'s batch {s[0]} and one "
                                 f"value per position ({s[2]} x {s[3]})")
        return [tuple(s) for s in in_shapes[:-1]]

    def forward(self, attrs, params, *bottoms):
        tops = [spatial_filter(x, bottoms[-1]) for x in bottoms[:-1]]
        return tops[0] if len(tops) == 1 else tuple(tops)

    def pytorch_source(self, node, emit):
        fn = emit.helper(spatial_filter)
        calls = [f"{fn}({x}, {emit.inputs[-1]})" for x in emit.inputs[:-1]]
        return calls[0] if len(calls) == 1 else calls

    def onnx(self, ctx, node):
        selector = node.inputs[-1]
        for i, (x, top) in enumerate(zip(node.inputs[:-1], node.outputs)):
            _, _, h, w = ctx.shape(x)
            gate = ctx.add_node("Reshape", [selector, ctx.i64([0, 1, h, w])], [ctx.tmp(f"{node.name}_gate{i}")])[0]
            ctx.add_node("Mul", [x, gate], [top])

