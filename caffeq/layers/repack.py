"""tinghuiz/learn-reflectance's Repack (31ab326: caffe/src/caffe/layers/repack_layer.cpp and .cu,
caffe/include/caffe/vision_layers.hpp, caffe/src/caffe/proto/caffe.proto RepackParameter, repack_param =
1050): moves the pixels of an s_h x s_w grid's offsets into the batch and back, so that a convolution on
the packed batch is a dilated convolution on the image.

repack_param { operation [PACK_IMAGE] stride [1] stride_h stride_w }.  stride_h set: the strides are
(stride_h, stride_w), stride_w's unset value being 0, which Caffe divides by; unset: both are `stride`
(stride_w alone is ignored).  Bottoms are read through num/channels/height/width (at most 4 axes, 1
past the last one); the top has 4 axes.

PACK_IMAGE (one bottom (N, C, H, W)): top (s_h s_w N, C, oh, ow), oh = (H - 1) / s_h + 1,
ow = (W - 1) / s_w + 1.  Top sample (y s_w + x) N + n at (j, i) is bottom sample n at
(j s_h + y, i s_w + x), 0 where that lies past the bottom's last row or column.

UNPACK_IMAGE (bottom (Nb, C, Hb, Wb), optional second bottom giving the size): top (Nb / (s_h s_w), C,
out_h, out_w), out_h = Hb s_h, out_w = Wb s_w, or the second bottom's height and width, which must lie
within 1 below those (Caffe's CHECKs).  With ih = (out_h - 1) / s_h + 1, iw = (out_w - 1) / s_w + 1,
the CPU loop reads the bottom's data as one flat array from its start, in the order (y, x, n, c, j, i)
with j < ih, i < iw, and writes top (n, c, j s_h + y, i s_w + x) wherever that lies inside the top:
the inverse of PACK_IMAGE.  ih is Hb unless s_h is 1 and the second bottom is one row shorter (then
Caffe reads its rows misaligned); samples past s_h s_w (Nb / (s_h s_w)) are never read.  Both are
reproduced (caffeq reads the same flat prefix).

This is the CPU forward.  The GPU kernels (repack_layer.cu, computeCoord) split the packed sample's
block index b the other way (row offset b % s_w, column offset b / s_w): for s_h == s_w the packed
batch comes out in transposed block order, and a PACK ... UNPACK chain of per-sample layers (the
fork's nets) gives the same final top on both devices; for s_h != s_w the GPU samples some offsets
twice and skips others.
"""
import torch.nn.functional as F

from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer
from .shape_ops import as_4d

PACK, UNPACK = 0, 1


def repack_pack(x, s_h: int, s_w: int):
    """PACK_IMAGE: (N, C, H, W) -> (s_h s_w N, C, ceil(H / s_h), ceil(W / s_w)), zero past the edges."""
    n, c, h, w = x.shape
    oh, ow = (h - 1) // s_h + 1, (w - 1) // s_w + 1
    x = F.pad(x, (0, ow * s_w - w, 0, oh * s_h - h))
    x = x.reshape(n, c, oh, s_h, ow, s_w).permute(3, 5, 0, 1, 2, 4)
    return x.reshape(s_h * s_w * n, c, oh, ow)


def repack_unpack(x, s_h: int, s_w: int, out_h: int, out_w: int):
    """UNPACK_IMAGE: the flat prefix of x read as (s_h, s_w, n, C, ih, iw), interleaved into
    (n, C, out_h, out_w), n = x.shape[0] // (s_h s_w)."""
    c = x.shape[1]
    n = x.shape[0] // (s_h * s_w)
    ih, iw = (out_h - 1) // s_h + 1, (out_w - 1) // s_w + 1
    flat = x.reshape(-1)[:s_h * s_w * n * c * ih * iw]
    y = flat.reshape(s_h, s_w, n, c, ih, iw).permute(2, 3, 4, 0, 5, 1)
    return y.reshape(n, c, ih * s_h, iw * s_w)[:, :, :out_h, :out_w]


@register_layer("Repack")
class Repack(Layer):
    def parse(self, lp):
        p = lp.repack_param
        op = int(p.operation)
        need_blobs(lp, "Repack", 1 if op == PACK else (1, 2), 1,
                   "data" if op == PACK else "data, size reference", in_place=False)
        notes = []
        if p.HasField("stride_h"):
            s_h, s_w = int(p.stride_h), int(p.stride_w)
            if s_h < 1:
                raise LayerError(f"repack_param.stride_h must be > 0, got {s_h}")
            if s_w < 1:
                raise LayerError(f"repack_param.stride_w must be > 0 when stride_h is set, got {s_w}")
        else:
            s_h = s_w = int(p.stride)
            if s_h < 1:
                raise LayerError(f"repack_param.stride must be > 0, got {s_h}")
            if p.HasField("stride_w"):
                notes.append(f"Repack: stride_w {p.stride_w} without stride_h is ignored, as by the fork "
                             f"(both strides are stride {s_h})")
        attrs = {"operation": op, "stride_h": s_h, "stride_w": s_w}
        if notes:
            attrs["reading_notes"] = notes
        return attrs

    def _sizes(self, attrs, in_shapes):
        """(bottom's legacy (N, C, H, W), top shape)."""
        s_h, s_w = attrs["stride_h"], attrs["stride_w"]
        n, c, h, w = legacy_nchw(tuple(int(d) for d in in_shapes[0]), "Repack")
        if attrs["operation"] == PACK:
            return (n, c, h, w), (s_h * s_w * n, c, (h - 1) // s_h + 1, (w - 1) // s_w + 1)
        out_n, out_h, out_w = n // (s_h * s_w), h * s_h, w * s_w
        if out_n < 1:
            raise LayerError(f"Repack UNPACK_IMAGE: the bottom's batch {n} is smaller than stride_h x stride_w "
                             f"= {s_h * s_w}")
        if len(in_shapes) == 2:
            _, _, rh, rw = legacy_nchw(tuple(int(d) for d in in_shapes[1]), "Repack")
            for what, size, ref in (("height", out_h, rh), ("width", out_w, rw)):
                if not ref <= size <= ref + 1:
                    raise LayerError(f"Repack UNPACK_IMAGE: bottom[1] {what} {ref} should be within 1 below the "
                                     f"computed {what} {size}")
            out_h, out_w = rh, rw
        return (n, c, h, w), (out_n, c, out_h, out_w)

    def infer(self, attrs, in_shapes):
        return [self._sizes(attrs, in_shapes)[1]]

    def forward(self, attrs, params, x, *ref):
        s_h, s_w = attrs["stride_h"], attrs["stride_w"]
        x = as_4d(x)
        if attrs["operation"] == PACK:
            return repack_pack(x, s_h, s_w)
        out_h, out_w = (x.shape[2] * s_h, x.shape[3] * s_w) if not ref else tuple(as_4d(ref[0]).shape[2:])
        return repack_unpack(x, s_h, s_w, out_h, out_w)

    def onnx(self, ctx, node):
        a = node.attrs
        s_h, s_w = a["stride_h"], a["stride_w"]
        in_shapes = [ctx.shape(t) for t in node.inputs]
        (_, c, h, w), (_, _, out_h, out_w) = self._sizes(a, in_shapes)
        x = node.inputs[0]
        rank = len(in_shapes[0])
        if rank < 4:
            x = ctx.op("Unsqueeze", [x, ctx.i64(list(range(rank, 4)))], "nchw")
        if a["operation"] == PACK:
            oh, ow = (h - 1) // s_h + 1, (w - 1) // s_w + 1
            if (oh * s_h, ow * s_w) != (h, w):
                x = ctx.op("Pad", [x, ctx.i64([0, 0, 0, 0, 0, 0, oh * s_h - h, ow * s_w - w])], "padded")
            grid = ctx.op("Reshape", [x, ctx.i64([-1, c, oh, s_h, ow, s_w])], "grid")
            blocks = ctx.op("Transpose", [grid], "blocks", perm=[3, 5, 0, 1, 2, 4])
            ctx.add_node("Reshape", [blocks, ctx.i64([-1, c, oh, ow])], [node.outputs[0]], name=node.name)
            return
        ih, iw = (out_h - 1) // s_h + 1, (out_w - 1) // s_w + 1
        # the flat prefix the fork's loop reads: (batch / (s_h s_w)) samples of s_h s_w C ih iw values
        batch = ctx.op("Gather", [ctx.op("Shape", [x], "shape"), ctx.i64([0])], "batch", axis=0)
        n = ctx.op("Div", [batch, ctx.i64([s_h * s_w])], "n")
        end = ctx.op("Mul", [n, ctx.i64([s_h * s_w * c * ih * iw])], "end")
        flat = ctx.op("Reshape", [x, ctx.i64([-1])], "flat")
        read = ctx.op("Slice", [flat, ctx.i64([0]), end, ctx.i64([0])], "read")
        blocks = ctx.op("Reshape", [read, ctx.i64([s_h, s_w, -1, c, ih, iw])], "blocks")
        grid = ctx.op("Transpose", [blocks], "grid", perm=[2, 3, 4, 0, 5, 1])
        if (ih * s_h, iw * s_w) == (out_h, out_w):
            ctx.add_node("Reshape", [grid, ctx.i64([-1, c, out_h, out_w])], [node.outputs[0]], name=node.name)
            return
        full = ctx.op("Reshape", [grid, ctx.i64([-1, c, ih * s_h, iw * s_w])], "full")
        ctx.add_node("Slice", [full, ctx.i64([0, 0]), ctx.i64([out_h, out_w]), ctx.i64([2, 3])],
                     [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        s_h, s_w = a["stride_h"], a["stride_w"]
        x = f"{emit.helper(as_4d)}({emit.inputs[0]})"
        if a["operation"] == PACK:
            return f"{emit.helper(repack_pack)}({x}, {s_h}, {s_w})"
        fn = emit.helper(repack_unpack)
        if len(emit.inputs) == 2:
            ref = f"{emit.helper(as_4d)}({emit.inputs[1]})"
            return f"{fn}({x}, {s_h}, {s_w}, {ref}.shape[2], {ref}.shape[3])"
        return f"{fn}({x}, {s_h}, {s_w}, {x}.shape[2] * {s_h}, {x}.shape[3] * {s_w})"
