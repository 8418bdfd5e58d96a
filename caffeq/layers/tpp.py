"""zhujiagang/caffe-tpp-net (a4a3fd2; the Caffe of zhujiagang/DTPP): TPP, temporal pyramid pooling
(src/caffe/layers/tpp_layer.cpp, include/caffe/vision_layers.hpp; tpp_param in src/caffe/proto/caffe.proto:
pyramid_height = 1, pool = 2 [MAX]; 210 there, resize_nearest_neighbor_param here: 20210).

One (N, C, H, W) bottom (Reshape's CHECK: 4 axes; LayerSetUp's: H and W above 0).  Level l of the
pyramid_height levels is Caffe's own Pooling (never cuDNN) along H only: 2^l bins, kernel_h = stride_h =
ceil(H / 2^l), pad_h = (kernel_h * 2^l - H + 1) / 2, kernel_w = stride_w = 1, pad_w = 0, CEIL rounding, so
each level keeps W.  Each level's (N, C, h_l, W) is flattened and all are concatenated: the top is
(N, C W sum(h_l)).  Pooling's checks hold for every level: a padding below the kernel (2^l above H, or H = 5
with 4 bins, fails), and padding only for MAX and AVE.  pyramid_height must be set (0 leaves the fork's
Concat without bottoms).  STOCHASTIC is read and sized but not run: the fork builds its inner Pooling layers
from a LayerParameter without a phase (TRAIN), so they sample at random at TEST too.  torch, ONNX, model.py.
"""
import torch

from ..errors import ExportError
from .pooling import _TORCH_MODES, AVE, CEIL, MAX, STOCHASTIC, TORCH_POOL_FUNCTIONS, caffe_pool2d, window
from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer, torch_sources


def tpp_level(h: int, level: int):
    """(kernel_h, pad_h) of pyramid level `level` on H = h."""
    bins = 1 << level
    kernel = -(-h // bins)
    return kernel, (kernel * bins - h + 1) // 2


def temporal_pyramid_pool(x, levels: int, mode: str):
    """caffe-tpp-net's TPP of x (N, C, H, W): each level's Caffe pooling along H, flattened, concatenated."""
    h = x.shape[2]
    parts = []
    for level in range(levels):
        kernel, pad = tpp_level(h, level)
        parts.append(caffe_pool2d(x, mode, [kernel, 1], [kernel, 1], [pad, 0], True).flatten(1))
    return torch.cat(parts, dim=1)


TORCH_TPP = torch_sources(tpp_level, temporal_pyramid_pool)


@register_layer("TPP")
class TPP(Layer):
    def parse(self, lp):
        need_blobs(lp, "TPP", 1, 1)
        p = lp.tpp_param
        height = positive_field(p.pyramid_height, "tpp_param.pyramid_height")
        return {"name": lp.name, "height": height, "pool": int(p.pool)}

    @staticmethod
    def level_attrs(attrs, level, h):
        kernel, pad = tpp_level(h, level)
        return {"pool": attrs["pool"], "global": False, "round_mode": CEIL, "kernel": (kernel, 1),
                "stride": (kernel, 1), "pad": (pad, 0)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "TPP")
        if h <= 0 or w <= 0:
            raise LayerError(f"TPP needs a height and width above 0 (the fork's CHECKs), got {list(in_shapes[0])}")
        rows = 0
        for level in range(attrs["height"]):
            la = self.level_attrs(attrs, level, h)
            (kernel, _), (pad, _) = la["kernel"], la["pad"]
            if pad >= kernel:
                raise LayerError(f"TPP level {level} pools H = {h} into {1 << level} bins with kernel_h {kernel} and "
                                 f"pad_h {pad}; its Pooling needs the padding below the kernel (tpp_param."
                                 f"pyramid_height {attrs['height']} is too high for this input)")
            if pad and attrs["pool"] not in (MAX, AVE):
                raise LayerError(f"TPP level {level} pads H = {h} by {pad}: its Pooling pads only MAX and AVE, "
                                 f"not STOCHASTIC")
            rows += window(la, h, w)[3][0]
        return [(n, c * w * rows)]

    def cannot_run(self, attrs, in_shapes):
        if attrs["pool"] == STOCHASTIC:
            return ("pool STOCHASTIC: the fork's inner Pooling layers have no phase (TRAIN) and sample at random "
                    "even at TEST")

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape], LayerError)
        return temporal_pyramid_pool(x, attrs["height"], _TORCH_MODES[attrs["pool"]])

    def onnx(self, ctx, node):
        from ..backends.onnx_pooling import emit_pooling
        a = node.attrs
        x = node.inputs[0]
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(x)], ExportError, node.type)
        h = ctx.shape(x)[2]
        parts = []
        for level in range(a["height"]):
            pooled = ctx.tmp(f"{node.name}_level{level}")
            emit_pooling(ctx, node, self.level_attrs(a, level, h), x, pooled)
            parts.append(ctx.op("Flatten", [pooled], f"level{level}_flat", axis=1))
        ctx.add_node("Concat", parts, [node.outputs[0]], name=node.name, axis=1)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0)], ExportError, node.type)
        emit.helper(TORCH_POOL_FUNCTIONS)
        fn = emit.helper(TORCH_TPP)
        return f"{fn}({emit.inputs[0]}, {a['height']}, {_TORCH_MODES[a['pool']]!r})"
