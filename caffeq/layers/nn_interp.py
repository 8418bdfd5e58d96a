"""xh-liu/HydraPlus-Net's NNInterp (2b056d3, layers/nninterp_layer.cpp and .cu, last changed in f972823; the
repository ships the layer, not its caffe.proto, so nninterp_param's numbers are caffeq's own): nearest
neighbour resizing.  The output is zoom_factor's h + (h - 1)(zoom - 1), shrink_factor's (h - 1) / shrink + 1,
or height x width, exactly one of them; output row r reads row min(int(r * scale), h - 1) with scale the
float32 h_in / h_out (columns likewise).

ModelTC/NART (5e3d6d6) declares the same layer in its nart_caffe.proto with three more fields.  Its
`scale_factor` s is a fourth way to size it: NART's Caffe-to-ONNX converter (utils/caffe_utils/caffe_to_onnx.py)
makes it an Upsample (nearest) by s, whose size is floor(float32(float32(s) * h)) (ops/op.py Upsample.infer_shape),
and its backends run that as their nearest interp (modules/default.py; art's op_default_nninterp_run), which
reads rows by the rule above.  Its pad_beg / pad_end are refused.
"""
import math

import numpy as np
import torch

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer


def nn_interp_rows(n_in: int, n_out: int, device: torch.device | None = None):
    """The source index of each of n_out outputs: min(int(i * float32(n_in / n_out)), n_in - 1)."""
    scale = torch.tensor(float(n_in), dtype=torch.float32) / float(n_out)
    index = (torch.arange(n_out, dtype=torch.float32) * scale).long().clamp(max=n_in - 1)
    return index.to(device) if device is not None else index


def nn_interp(x, h_out: int, w_out: int):
    rows = nn_interp_rows(x.shape[2], h_out, x.device)
    cols = nn_interp_rows(x.shape[3], w_out, x.device)
    return x.index_select(2, rows).index_select(3, cols)


@register_layer("NNInterp")
class NNInterp(Layer):
    def parse(self, lp):
        need_blobs(lp, "NNInterp", 1, 1)
        p = lp.nninterp_param
        specs = [p.HasField("zoom_factor"), p.HasField("shrink_factor"), p.HasField("height") and p.HasField("width"),
                 p.HasField("scale_factor")]
        if sum(specs) != 1:   # LayerSetUp's CHECK
            raise LayerError("nninterp_param: give exactly one of zoom_factor, shrink_factor, height and width, "
                             "or (NART's) scale_factor")
        if specs[0] and p.zoom_factor < 1 or specs[1] and p.shrink_factor < 1:
            raise LayerError("nninterp_param.zoom_factor and shrink_factor must be >= 1")
        if specs[3] and not (0 < p.scale_factor < float("inf")):
            raise LayerError(f"nninterp_param.scale_factor must be positive, got {p.scale_factor}")
        if p.pad_beg or p.pad_end:
            raise LayerError("nninterp_param.pad_beg / pad_end (NART's): not reproduced by caffeq")
        return {"zoom": int(p.zoom_factor) if specs[0] else None, "shrink": int(p.shrink_factor) if specs[1] else None,
                "size": (int(p.height), int(p.width)) if specs[2] else None,
                "factor": float(p.scale_factor) if specs[3] else None}

    @staticmethod
    def out_size(attrs, h, w):
        if attrs["zoom"]:
            z = attrs["zoom"]
            return h + (h - 1) * (z - 1), w + (w - 1) * (z - 1)
        if attrs["shrink"]:
            s = attrs["shrink"]
            return (h - 1) // s + 1, (w - 1) // s + 1
        if attrs.get("factor") is not None:   # NART's Upsample: a float32 product, floored
            f = np.float32(attrs["factor"])
            return math.floor(f * np.float32(h)), math.floor(f * np.float32(w))
        return attrs["size"]

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "NNInterp")
        ho, wo = self.out_size(attrs, h, w)
        if ho < 1 or wo < 1:
            raise LayerError(f"NNInterp's output {ho}x{wo} must be positive")
        return [(n, c, ho, wo)]

    def forward(self, attrs, params, x):
        return nn_interp(x, *self.out_size(attrs, x.shape[2], x.shape[3]))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        h, w = ctx.shape(x)[2:]
        ho, wo = self.out_size(node.attrs, h, w)
        rows = ctx.add_node("Gather", [x, ctx.const(nn_interp_rows(h, ho).numpy())], ctx.tmp(node.name + "_rows"),
                            name=node.name, axis=2)
        ctx.add_node("Gather", [rows, ctx.const(nn_interp_rows(w, wo).numpy())], [node.outputs[0]], axis=3)

    def pytorch_source(self, node, emit):
        ho, wo = emit.out_shape(0)[2:]
        emit.helper(nn_interp_rows)
        return f"{emit.helper(nn_interp)}({emit.inputs[0]}, {ho}, {wo})"
