"""FlowTransformer: MotionNet's warp of an image by an optical flow, as bryanyzhu/Hidden-Two-Stream
(f7f684a; src/caffe/layers/flow_transformer_layer.cpp / .cu, include/caffe/flow_transformer_layer.hpp)
writes it: daerduoCarey's SpatialTransformer sampler with the affine grid replaced by pixel + flow.
No parameters.

Bottom 0 is the image U (N, C, H, W), bottom 1 the flow (N, 2, H, W) in pixels: channel 0 moves along
the columns, channel 1 along the rows.  The fork CHECKs that the flow has the image's H and W and adds
N * 2 * H * W of its values to its (N, 2, H, W) pixel grid, so caffeq asks for exactly that shape.
The top is (N, C, H, W).  Output pixel (s, t) reads the image at

    x = s + flow[n, 1, s, t]      (a row),      y = t + flow[n, 0, s, t]      (a column),

from the taps (m, k) = (floor x, floor y), (floor x + 1, floor y), (floor x, floor y + 1), (floor x + 1,
floor y + 1), added in that order to 0, each weighted (1 - (x - m0)) or (1 - (m1 - x)) times (1 - (y - k0))
or (1 - (k1 - y)) as the kernel writes them, in float32; a tap outside [0, H) x [0, W) adds nothing
(zero padding, no clamping, no normalisation).  The CPU and GPU forwards agree on all of this (the
CPU's max(0, 1 - |x - m|) factors are the same numbers); caffeq follows the GPU kernel
(FlowTransformerForwardGPU) where they part: a NaN coordinate turns into tap index 0 (CUDA's
float-to-int conversion), so the top is NaN wherever such a tap lands inside, where the CPU's x86
conversion would put it outside.  nvcc may contract `V += w * pixel` into a fused multiply-add;
caffeq rounds every product, as the CPU forward does (a last-bit difference at most).  ONNX gathers
the four taps (GatherElements): GridSample's normalised coordinates would not round the same way.
"""
import torch

from .optical_flow import bilinear_taps, pixels_at
from .registry import Layer, LayerError, count, four_axes, need_blobs, register_layer
from .warp_onnx import OnnxImageSampler


def flow_transform(image, flow):
    """The fork's FlowTransformer forward (its GPU kernel): taps at (row + flow 1, column + flow 0)."""
    h, w = image.shape[2], image.shape[3]
    rows = torch.arange(h, dtype=image.dtype, device=image.device).reshape(1, 1, h, 1)
    cols = torch.arange(w, dtype=image.dtype, device=image.device).reshape(1, 1, 1, w)
    x = rows + flow[:, 1:2]    # (N, 1, H, W): rows
    y = cols + flow[:, 0:1]    # columns
    return bilinear_taps(image, x, y, True)


@register_layer("FlowTransformer")
class FlowTransformer(Layer):
    def parse(self, lp):
        # the fork zeroes its top before reading the image: in place it would read zeros
        need_blobs(lp, "FlowTransformer", 2, 1, "image, flow", in_place=False)
        return {}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "FlowTransformer", "image (bottom 0)")
        flow = four_axes(in_shapes[1], "FlowTransformer", "flow (bottom 1)")
        if flow[0] != image[0] or flow[1] != 2 or flow[2:] != image[2:]:
            raise LayerError(f"FlowTransformer's flow (bottom 1) must be (N, 2, H, W) of the image's N, H and W: "
                             f"image {list(image)}, flow {list(flow)}")
        return [tuple(image)]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * 4

    def forward(self, attrs, params, image, flow):
        return flow_transform(image, flow)

    def onnx(self, ctx, node):
        image, flow = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32 = s.op, s.f32
        y, x = s.plus_pixel_grid(s.channel(flow, 0, "fy", name=node.name), s.channel(flow, 1, "fx"))
        m0, k0 = op("Floor", [x], "m0"), op("Floor", [y], "k0")
        m1, k1 = op("Add", [m0, f32(1)], "m1"), op("Add", [k0, f32(1)], "k1")

        def weight(a, b, hint):   # 1 - (a - b), as the kernel writes each tap's factor
            return op("Sub", [f32(1), op("Sub", [a, b], "d" + hint)], "w" + hint)

        def index(v, hint):       # CUDA's (int) of a float: NaN becomes 0
            return op("Where", [op("IsNaN", [v], hint + "_nan"), f32(0), v], hint + "_i")

        wm0, wm1, wk0, wk1 = weight(x, m0, "m0"), weight(m1, x, "m1"), weight(y, k0, "k0"), weight(k1, y, "k1")
        im0, im1, ik0, ik1 = index(m0, "m0"), index(m1, "m1"), index(k0, "k0"), index(k1, "k1")
        total = None
        for t, (m, k, wm, wk) in enumerate(((im0, ik0, wm0, wk0), (im1, ik0, wm1, wk0), (im0, ik1, wm0, wk1),
                                            (im1, ik1, wm1, wk1))):
            inside = s.within(k, m, f"in{t}", True)      # 0 <= column < W, 0 <= row < H
            row = op("Where", [inside, m, f32(0)], f"row{t}")
            col = op("Where", [inside, k, f32(0)], f"col{t}")
            term = op("Mul", [op("Mul", [wm, wk], f"w{t}"), s.pixels(row, col, f"v{t}")], f"t{t}")
            term = op("Where", [inside, term, f32(0)], f"k{t}")
            total = term if total is None else op("Add", [total, term], f"s{t}")
        ctx.add_node("Identity", [total], [node.outputs[0]], name=node.name + "_out")

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        emit.helper(bilinear_taps)
        return f"{emit.helper(flow_transform)}({emit.inputs[0]}, {emit.inputs[1]})"

