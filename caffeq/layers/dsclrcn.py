"""nian-liu/DSCLRCN's spatial-LSTM layers (fbbd35f, caffe-master/src/caffe/layers/spatialtransformer_layer.cpp
and .cu, srnnformat_layer.cpp; the LSTM's lstm_additional_forget_bias is in caffeq/layers/recurrent.py).

- SpatialTransformer with `spatialtransformer_param` (mirror [true], rotate NOROTATE / ROTATE90 (clockwise) /
  ROTATE180 / ROTATE270, operation TRANSFORM / UNTRANSFORM): each pixel moves.  TRANSFORM mirrors the
  columns, then rotates; UNTRANSFORM rotates the other way (90 and 270 swap), then mirrors, so it undoes
  TRANSFORM.  A quarter turn swaps H and W.  Other SpatialTransformer layers are daerduoCarey's or
  e2e_face's (caffeq/layers/spatial_transformer.py).
- SRNNFormat FORMAT: x (N, C, H, W) -> its rows as streams, (W, N * H, C) (time = column), a continuation
  indicator (W, N * H) (0 at the first column, 1 after) and a scalar holding H.  UNFORMAT: (T, N * H, C)
  and that scalar -> (N, C, H, T).  The UNFORMAT layer's shape takes H from the scalar's value, which
  the FORMAT layer's shapes give (Layer.top_values).
"""
import numpy as np
import torch

from .registry import Layer, LayerError, claim_layers, four_axes, need_blobs, register_layer

ROTATE90, ROTATE270 = 1, 3   # spatialtransformer_param.rotate's quarter turns


def mirror_rotate_sources(h: int, w: int, mirror: bool, rotate: int, undo: bool):
    """transform_cpu's move of an h x w map -> (out_h, out_w, the source index of each output pixel);
    rotate 0-3: none, 90 (clockwise), 180, 270."""
    if undo and rotate in (1, 3):
        rotate = 4 - rotate
    out_h, out_w = (w, h) if rotate in (1, 3) else (h, w)
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    hi, wi = hh, ww
    if mirror and not undo:
        wi = w - 1 - wi
    if rotate == 1:
        hi, wi = wi, h - 1 - hi
    elif rotate == 2:
        hi, wi = h - 1 - hi, w - 1 - wi
    elif rotate == 3:
        hi, wi = w - 1 - wi, hi
    if mirror and undo:
        wi = out_w - 1 - wi
    sources = torch.empty(out_h * out_w, dtype=torch.long)
    sources[(hi * out_w + wi).reshape(-1)] = torch.arange(h * w)
    return out_h, out_w, sources


def mirror_rotate(x, mirror: bool, rotate: int, undo: bool):
    n, c, h, w = x.shape
    out_h, out_w, sources = mirror_rotate_sources(h, w, mirror, rotate, undo)
    return x.reshape(n, c, h * w).index_select(2, sources.to(x.device)).reshape(n, c, out_h, out_w)


@claim_layers("SpatialTransformer", lambda lp: lp.HasField("spatialtransformer_param"))
class MirrorRotate(Layer):
    def parse(self, lp):
        need_blobs(lp, "SpatialTransformer", 1, 1)
        p = lp.spatialtransformer_param
        return {"mirror": bool(p.mirror), "rotate": int(p.rotate), "undo": p.operation == p.UNTRANSFORM}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "SpatialTransformer")
        return [(n, c, w, h) if attrs["rotate"] in (ROTATE90, ROTATE270) else (n, c, h, w)]

    def forward(self, attrs, params, x):
        return mirror_rotate(x, attrs["mirror"], attrs["rotate"], attrs["undo"])

    def onnx(self, ctx, node):
        a, x = node.attrs, node.inputs[0]
        _, c, h, w = ctx.shape(x)
        out_h, out_w, sources = mirror_rotate_sources(h, w, a["mirror"], a["rotate"], a["undo"])
        flat = ctx.add_node("Reshape", [x, ctx.i64([0, c, h * w])], ctx.tmp(node.name + "_flat"), name=node.name)
        moved = ctx.op("Gather", [flat, ctx.const(sources.numpy())], "moved", axis=2)
        ctx.add_node("Reshape", [moved, ctx.i64([0, c, out_h, out_w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(mirror_rotate_sources)
        return f"{emit.helper(mirror_rotate)}({emit.inputs[0]}, {a['mirror']}, {a['rotate']}, {a['undo']})"


def srnn_format(x):
    """SRNNFormat FORMAT: x (N, C, H, W) -> rows as streams (W, N H, C), the continuation indicator
    (W, N H) (0 at the first column) and the streams per image, H, as a scalar."""
    n, c, h, w = x.shape
    streams = x.permute(3, 0, 2, 1).reshape(w, n * h, c)
    indicator = torch.ones(w, n * h, dtype=x.dtype, device=x.device)
    indicator[0] = 0
    return streams, indicator, torch.tensor(float(h), dtype=x.dtype, device=x.device)


def srnn_unformat(streams, height: int):
    """SRNNFormat UNFORMAT: (T, N H, C) streams of height rows each -> (N, C, H, T)."""
    t, nh, c = streams.shape
    return streams.reshape(t, nh // height, height, c).permute(1, 3, 2, 0)


@register_layer("SRNNFormat")
class SRNNFormat(Layer):
    reads_bottom_values = True

    def parse(self, lp):
        unformat = lp.srnnformat_param.operation == lp.srnnformat_param.UNFORMAT
        if unformat:
            need_blobs(lp, "SRNNFormat UNFORMAT", 2, 1, "streams, stream size")
        else:
            need_blobs(lp, "SRNNFormat FORMAT", 1, 3)
        return {"unformat": unformat}

    def infer(self, attrs, in_shapes):
        if not attrs["unformat"]:
            n, c, h, w = four_axes(in_shapes[0], "SRNNFormat FORMAT")
            return [(w, n * h, c), (w, n * h), ()]
        streams, size = (tuple(s) for s in in_shapes)
        if len(streams) != 3 or len(size) != 0:
            raise LayerError(f"SRNNFormat UNFORMAT takes (T, streams, C) and a scalar stream size, got "
                             f"{list(streams)} and {list(size)}")
        height = attrs["bottom_values"][1]
        if height is None:
            raise LayerError("SRNNFormat UNFORMAT reads its stream size's value, which only a FORMAT layer's "
                             "third top gives")
        height = int(height)
        if height < 1 or streams[1] % height:
            raise LayerError(f"SRNNFormat UNFORMAT: {streams[1]} streams are not whole images of {height} rows")
        attrs["height"] = height
        return [(streams[1] // height, streams[2], height, streams[0])]

    def top_values(self, attrs, in_shapes):
        # Reshape writes the map's height into the scalar top
        return {} if attrs["unformat"] else {2: int(in_shapes[0][2])}

    def forward(self, attrs, params, x, *rest):
        return srnn_unformat(x, attrs["height"]) if attrs["unformat"] else srnn_format(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        if node.attrs["unformat"]:
            t, _, c = ctx.shape(x)
            h = node.attrs["height"]
            rows = ctx.add_node("Reshape", [x, ctx.i64([t, -1, h, c])], ctx.tmp(node.name + "_rows"), name=node.name)
            ctx.add_node("Transpose", [rows], [node.outputs[0]], perm=[1, 3, 2, 0])
            return
        _, c, h, w = ctx.shape(x)
        streams, indicator, size = node.outputs
        columns = ctx.add_node("Transpose", [x], ctx.tmp(node.name + "_columns"), name=node.name, perm=[3, 0, 2, 1])
        ctx.add_node("Reshape", [columns, ctx.i64([w, -1, c])], [streams])
        shape = ctx.op("Slice", [ctx.op("Shape", [streams], "shape"), ctx.i64([0]), ctx.i64([2])], "grid")
        ones = ctx.op("ConstantOfShape", [shape], "ones", value=np.array([1.0], np.float32))
        first = np.ones((w, 1), np.float32)
        first[0] = 0
        ctx.add_node("Mul", [ones, ctx.const(first)], [indicator])
        ctx.add_node("Identity", [ctx.f32(float(h))], [size])

    def pytorch_source(self, node, emit):
        if node.attrs["unformat"]:
            return f"{emit.helper(srnn_unformat)}({emit.inputs[0]}, {node.attrs['height']})"
        out = emit.tmp("rows")
        emit.stmt(f"{out} = {emit.helper(srnn_format)}({emit.inputs[0]})")
        return [f"{out}[{i}]" for i in range(3)]
