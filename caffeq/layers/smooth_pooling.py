"""wanglijun1989/caffe-cvpr17's SmoothPooling (3563995, smooth_pooling_layer.cpp / .cu; its weakly supervised
saliency nets): a smoothed max over each channel's H x W values.

For each item n and channel c, with mu = max(smoothness, 0.01) (the blob: one value, or one per channel with
unique_smooth false; or bottom 1's per item), v = x / (mu + FLT_MIN) in float, w is the Euclidean projection of
v onto the simplex {w >= 0, sum w = z}: w = max(v - theta, 0), theta = (sum of the kept v - z) / their count
(the fork's pivot search, in double).  With max_value > 0, a dummy entry of value max_value / mu joins when it
exceeds every v.  The top is (N, C, 1, 1):
    x . w + max_value * w_dummy - mu / 2 * (|w|^2 + w_dummy^2)   (the last term dropped with fix_smooth),
and an optional second top holds w (N, C, H, W).  mu -> 0 gives the max; a large mu spreads w out.
"""
import numpy as np
import torch

from .norm import onnx_reduce
from .pooling import FLT_MIN
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer, torch_sources


def simplex_theta(v, z: float, dummy):
    """The projection's threshold for each row of v (rows x dim, float32): theta in float64, as the fork's
    pivot search finds it (the kept values summed in double); dummy (rows,) joins a row where it is finite."""
    rows = torch.cat([dummy.unsqueeze(1), v], dim=1).double()
    u, _ = torch.sort(rows, dim=1, descending=True)
    sums = torch.cumsum(torch.where(torch.isneginf(u), torch.zeros_like(u), u), dim=1)   # an absent dummy adds 0
    counts = torch.arange(1, u.shape[1] + 1, dtype=torch.float64)
    kept = (sums - counts * u) < z                     # the fork's test; true for the kept values, then false
    rho = kept.sum(dim=1).clamp(min=1)
    return (sums.gather(1, (rho - 1).unsqueeze(1)).squeeze(1) - z) / rho.double()


def smooth_pool(x, mu, z: float, max_value: float, fix_smooth: bool):
    """SmoothPooling's forward: x (N, C, H, W), mu (N or 1, C or 1) -> (top (N, C, 1, 1), weights (N, C, H, W))."""
    n, c, h, w_ = x.shape
    mu = torch.clamp(mu, min=0.01).expand(n, c).reshape(-1)
    rows = x.reshape(n * c, h * w_)
    v = rows / (mu + 1.1754943508222875e-38).unsqueeze(1)
    dummy_value = (max_value / (mu + 1.1754943508222875e-38)).to(x.dtype)
    active = (dummy_value > 0) & (dummy_value > v.max(dim=1).values)
    dummy = torch.where(active, dummy_value, torch.full_like(dummy_value, float("-inf")))
    theta = simplex_theta(v, z, dummy)
    weights = torch.clamp(v.double() - theta.unsqueeze(1), min=0).to(x.dtype)
    dummy_w = torch.where(active, torch.clamp(dummy_value.double() - theta, min=0).to(x.dtype),
                          torch.zeros_like(dummy_value))
    top = (rows * weights).sum(dim=1) + max_value * dummy_w
    if not fix_smooth:
        top = top - 0.5 * mu * ((weights * weights).sum(dim=1) + dummy_w * dummy_w)
    return top.reshape(n, c, 1, 1), weights.reshape(n, c, h, w_)


TORCH_SMOOTH_POOL = torch_sources(simplex_theta, smooth_pool)


@register_layer("SmoothPooling")
class SmoothPooling(Layer):
    blob_names = ("smooth",)

    def parse(self, lp):
        p = lp.smooth_pooling_param
        need_blobs(lp, "SmoothPooling", 1 if p.has_smooth_blobs else 2, (1, 2),
                   roles="data" if p.has_smooth_blobs else "data, smoothness")
        if not p.z > 0:
            raise LayerError(f"smooth_pooling_param.z must be > 0 (the simplex's sum), got {p.z:g}")
        return {"blob": bool(p.has_smooth_blobs), "unique": bool(p.unique_smooth), "z": float(p.z),
                "max_value": float(p.max_value), "fix_smooth": bool(p.fix_smooth), "num_tops": len(lp.top)}

    def blob_names_for(self, attrs):
        return ("smooth",) if attrs["blob"] else ()

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "SmoothPooling")
        if not attrs["blob"]:
            want = (n, 1 if attrs["unique"] else c, 1, 1)
            if tuple(in_shapes[1])[1:] != want[1:] or in_shapes[1][0] != n:
                raise LayerError(f"bottom 1 (the smoothness) must be {list(want)}, got {list(in_shapes[1])}")
        return [(n, c, 1, 1), (n, c, h, w)][:attrs["num_tops"]]

    def param_shapes(self, attrs, in_shapes):
        if not attrs["blob"]:
            return []
        return [(1, 1 if attrs["unique"] else in_shapes[0][1], 1, 1)]

    def init_params(self, attrs, shapes, rng):
        return [np.ones(s, np.float32) for s in shapes]   # a smoothness of 1 (the nets' constant filler)

    def _mu(self, attrs, params, bottoms):
        mu = params[0] if attrs["blob"] else bottoms[1]
        return mu.reshape(1 if attrs["blob"] else mu.shape[0], -1)

    def forward(self, attrs, params, *bottoms):
        x = bottoms[0]
        top, weights = smooth_pool(x.reshape(x.shape[0], x.shape[1], x.shape[2], -1), self._mu(attrs, params, bottoms),
                                   attrs["z"], attrs["max_value"], attrs["fix_smooth"])
        return (top, weights) if attrs["num_tops"] == 2 else top

    def onnx(self, ctx, node):
        a = node.attrs
        n, c, h, w = ctx.shape(node.inputs[0])
        rows = ctx.op("Reshape", [node.inputs[0], ctx.i64([n * c, h * w])], "rows")
        mu = ctx.weight(node, 0) if a["blob"] else node.inputs[1]
        mu = ctx.op("Reshape", [mu, ctx.i64([1 if a["blob"] else n, -1, 1])], "mu_nc")
        mu = ctx.op("Reshape", [ctx.op("Expand", [mu, ctx.i64([n, c, 1])], "mu_all"), ctx.i64([n * c, 1])], "mu_rows")
        mu = ctx.op("Max", [mu, ctx.f32(0.01)], "mu")
        den = ctx.op("Add", [mu, ctx.f32(FLT_MIN)], "den")
        v = ctx.op("Div", [rows, den], "v")
        dummy_value = ctx.op("Div", [ctx.f32(a["max_value"]), den], "dummy_value")
        active = ctx.op("And", [ctx.op("Greater", [dummy_value, ctx.f32(0.0)], "positive"),
                                ctx.op("Greater", [dummy_value, onnx_reduce(ctx, "ReduceMax", v, [1], True)], "above")],
                        "active")
        dummy = ctx.op("Where", [active, dummy_value, ctx.f32(-np.inf)], "dummy")
        values = ctx.op("Cast", [ctx.op("Concat", [dummy, v], "with_dummy", axis=1)], "values64", to=11)
        u = ctx.add_node("TopK", [values, ctx.i64([h * w + 1])], [ctx.tmp(f"{node.name}_sorted"),
                                                                   ctx.tmp(f"{node.name}_order")], axis=1)[0]
        finite = ctx.op("Where", [ctx.op("IsInf", [u], "absent", detect_positive=0), ctx.const(np.float64(0)), u],
                        "finite")
        sums = ctx.op("CumSum", [finite, ctx.i64(1)], "sums")
        z = ctx.const(np.float64(a["z"]))
        counts = ctx.const(np.arange(1, h * w + 2, dtype=np.float64))
        kept = ctx.op("Less", [ctx.op("Sub", [sums, ctx.op("Mul", [counts, u], "level")], "excess"), z], "kept")
        rho = ctx.op("Max", [onnx_reduce(ctx, "ReduceSum", ctx.op("Cast", [kept], "kept64", to=11), [1], True),
                             ctx.const(np.float64(1))], "rho")
        index = ctx.op("Cast", [ctx.op("Sub", [rho, ctx.const(np.float64(1))], "last")], "index", to=7)
        theta = ctx.op("Div", [ctx.op("Sub", [ctx.op("GatherElements", [sums, index], "kept_sum", axis=1), z],
                                      "theta_num"), rho], "theta")

        def weight_of(values, hint):
            shifted = ctx.op("Sub", [ctx.op("Cast", [values], f"{hint}64", to=11), theta], f"{hint}_shifted")
            return ctx.op("Cast", [ctx.op("Max", [shifted, ctx.const(np.float64(0))], f"{hint}_clipped")], hint, to=1)
        weights = weight_of(v, "weights")
        dummy_w = ctx.op("Where", [active, weight_of(dummy_value, "dummy_weight"), ctx.f32(0.0)], "dummy_w")
        top = ctx.op("Add", [onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [rows, weights], "xw"), [1], True),
                             ctx.op("Mul", [dummy_w, ctx.f32(a["max_value"])], "dummy_term")], "pooled")
        if not a["fix_smooth"]:
            norm = ctx.op("Add", [onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [weights, weights], "w2"), [1], True),
                                  ctx.op("Mul", [dummy_w, dummy_w], "d2")], "norm")
            top = ctx.op("Sub", [top, ctx.op("Mul", [ctx.op("Mul", [mu, ctx.f32(0.5)], "half_mu"), norm], "penalty")],
                         "smoothed")
        ctx.add_node("Reshape", [top, ctx.i64([n, c, 1, 1])], [node.outputs[0]], name=node.name)
        if a["num_tops"] == 2:
            ctx.add_node("Reshape", [weights, ctx.i64([n, c, h, w])], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(TORCH_SMOOTH_POOL)
        x = emit.inputs[0]
        if a["blob"]:
            m = emit.module(f"nn.Parameter(torch.ones{tuple(node.blobs[0].shape)})")
            emit.param("", 0, attr=m[len("self."):])
            mu = f"{m}.reshape(1, -1)"
        else:
            mu = f"{emit.inputs[1]}.reshape({emit.inputs[1]}.shape[0], -1)"
        call = f"{fn}({x}, {mu}, {a['z']!r}, {a['max_value']!r}, {a['fix_smooth']})"
        return call if a["num_tops"] == 2 else f"{call}[0]"


__all__ = ["SmoothPooling"]
