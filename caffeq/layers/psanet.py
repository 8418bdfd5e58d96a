"""PSANet's PointwiseSpatialAttention (hszhao/PSANet ff91e4f, pointwise_spatial_attention_layer.cpp).

Bottoms: x (N, C, H, W) and mask (N, mH * mW, H, W); top shaped like x.  Without
attention_mask_height/width (both or neither), mH = 2H - 1 and mW = 2W - 1 (LayerSetUp); given
ones must be odd and > 1.  hm = (mH - 1) / 2, wm = (mW - 1) / 2.

1. A zeroed buffer (N, H*W, H, W) receives the mask (the PSAForward_buffer_mask_*_cpu loops),
   for every position q = (h, w) and mask cell (i, j) whose shifted position
   p = (h + i - hm, w + j - wm) lies on the map:
   COLLECT:    buffer[n, p, q] = mask[n, i * mW + j, h, w]
   DISTRIBUTE: buffer[n, q, p] = mask[n, i * mW + j, h, w]
2. is_softmax: Softmax over the buffer's axis 1, a Softmax layer run on the whole buffer, so the
   zeros outside the window take part (each is exp(0) in the sum).
3. top[n] (C x HW) = x[n] (C x HW) . buffer[n] (HW x HW) * (1 / normalization_factor), the
   factor defaulting to mH * mW (LayerSetUp), even with the softmax.

Here the transposed buffer S[q, p] = buffer[p, q] is gathered straight from the mask, so the
softmax runs over the last axis (as ONNX's Softmax of every opset) and top = x . S^T.
"""

import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, register_layer

#: the buffer holds (H*W)^2 values per image: refuse maps whose buffer could not be allocated
MAX_BUFFER = 1 << 31


def psa_gather_index(height: int, width: int, mask_h: int, mask_w: int, distribute: bool):
    """For S[q, p] (q, p: positions h * W + w): the index of its value in the mask flattened to
    (mH * mW * H * W), and whether (i, j) lies inside the mask window; both (HW, HW)."""
    hw = height * width
    pos = torch.arange(hw)
    ph, pw = pos // width, pos % width
    rows_h, rows_w = ph[:, None], pw[:, None]           # q
    cols_h, cols_w = ph[None, :], pw[None, :]           # p
    if distribute:   # buffer[q_mask, p] from the mask at p: S[q, p] = mask[(q - p) + half, p]
        di, dj, at = rows_h - cols_h, rows_w - cols_w, pos[None, :]
    else:            # COLLECT: buffer[p, q] from the mask at q: S[q, p] = mask[(p - q) + half, q]
        di, dj, at = cols_h - rows_h, cols_w - rows_w, pos[:, None]
    i = di + (mask_h - 1) // 2
    j = dj + (mask_w - 1) // 2
    inside = (i >= 0) & (i < mask_h) & (j >= 0) & (j < mask_w)
    index = (i.clamp(0, mask_h - 1) * mask_w + j.clamp(0, mask_w - 1)) * hw + at
    return index, inside


def pointwise_spatial_attention(x, mask, mask_h: int, mask_w: int, distribute: bool, softmax: bool,
                                scale: float):
    """PSANet's PointwiseSpatialAttention forward: x (N, C, H, W), mask (N, mH * mW, H, W)."""
    n, c, height, width = x.shape
    index, inside = psa_gather_index(height, width, mask_h, mask_w, distribute)
    flat = mask.reshape(n, -1)
    s = flat[:, index.to(x.device).reshape(-1)].reshape(n, height * width, height * width)
    s = torch.where(inside.to(x.device), s, torch.zeros((), dtype=s.dtype, device=s.device))
    if softmax:
        s = torch.softmax(s, dim=-1)
    out = torch.matmul(x.reshape(n, c, height * width), s.transpose(1, 2)) * scale
    return out.reshape(n, c, height, width)


@register_layer("PointwiseSpatialAttention")
class PointwiseSpatialAttention(Layer):
    def parse(self, lp):
        need_blobs(lp, "PointwiseSpatialAttention", 2, 1, "x, mask")
        p = lp.pointwise_spatial_attention_param
        given = (p.HasField("attention_mask_height"), p.HasField("attention_mask_width"))
        if given[0] != given[1]:
            raise LayerError("pointwise_spatial_attention_param: give both attention_mask_height and "
                             "attention_mask_width, or neither")
        mask_hw = None
        if given[0]:
            mask_hw = (int(p.attention_mask_height), int(p.attention_mask_width))
            for field, v in zip(("attention_mask_height", "attention_mask_width"), mask_hw):
                if v <= 1 or v % 2 == 0:
                    raise LayerError(f"pointwise_spatial_attention_param.{field} must be odd and > 1, got {v}")
        factor = float(p.normalization_factor) if p.HasField("normalization_factor") else None
        if factor is not None and factor == 0:
            raise LayerError("pointwise_spatial_attention_param.normalization_factor must not be 0")
        return {"mask_hw": mask_hw, "factor": factor, "softmax": bool(p.is_softmax),
                "distribute": p.psa_type == 1}

    @staticmethod
    def _settings(attrs, x_shape):
        """(mH, mW, the float32 scale 1 / normalization_factor) for a bottom x of x_shape."""
        mask_h, mask_w = attrs["mask_hw"] or (2 * x_shape[2] - 1, 2 * x_shape[3] - 1)
        factor = attrs["factor"] if attrs["factor"] is not None else float(mask_h * mask_w)
        return mask_h, mask_w, float(np.float32(1.0 / factor))

    def infer(self, attrs, in_shapes):
        x, mask = (tuple(s) for s in in_shapes)
        if len(x) != 4 or len(mask) != 4:
            raise LayerError(f"PointwiseSpatialAttention needs 4-D bottoms, got {list(x)} and {list(mask)}")
        mask_h, mask_w, _ = self._settings(attrs, x)
        want = (x[0], mask_h * mask_w, x[2], x[3])
        if mask != want:
            raise LayerError(f"the mask must be shaped {list(want)} for x {list(x)} and a {mask_h}x{mask_w} "
                             f"window, got {list(mask)}")
        if x[0] * (x[2] * x[3]) ** 2 > MAX_BUFFER:
            raise LayerError(f"the attention buffer of x {list(x)} would hold {x[0] * (x[2] * x[3]) ** 2} values")
        return [x]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return n * c * (h * w) ** 2

    def forward(self, attrs, params, x, mask):
        mask_h, mask_w, scale = self._settings(attrs, x.shape)
        return pointwise_spatial_attention(x, mask, mask_h, mask_w, attrs["distribute"], attrs["softmax"], scale)

    def onnx(self, ctx, node):
        x_in, mask_in = node.inputs
        n, c, h, w = ctx.shape(x_in)
        mask_h, mask_w, scale = self._settings(node.attrs, (n, c, h, w))
        hw = h * w
        name = node.name
        # the gather index from two (HW,) position constants, not an (HW, HW) constant
        pos = np.arange(hw, dtype=np.int64)
        ph, pw = pos // w, pos % w
        rows_h, rows_w = ctx.i64(ph.reshape(-1, 1)), ctx.i64(pw.reshape(-1, 1))
        cols_h, cols_w = ctx.i64(ph.reshape(1, -1)), ctx.i64(pw.reshape(1, -1))
        if node.attrs["distribute"]:
            di, dj, at = (ctx.op("Sub", [rows_h, cols_h], "di"), ctx.op("Sub", [rows_w, cols_w], "dj"),
                          ctx.i64(pos.reshape(1, -1)))
        else:
            di, dj, at = (ctx.op("Sub", [cols_h, rows_h], "di"), ctx.op("Sub", [cols_w, rows_w], "dj"),
                          ctx.i64(pos.reshape(-1, 1)))
        i = ctx.op("Add", [di, ctx.i64((mask_h - 1) // 2)], "i")
        j = ctx.op("Add", [dj, ctx.i64((mask_w - 1) // 2)], "j")
        inside_i = ctx.op("And", [ctx.op("GreaterOrEqual", [i, ctx.i64(0)], "i_lo"),
                                  ctx.op("Less", [i, ctx.i64(mask_h)], "i_hi")], "in_i")
        inside_j = ctx.op("And", [ctx.op("GreaterOrEqual", [j, ctx.i64(0)], "j_lo"),
                                  ctx.op("Less", [j, ctx.i64(mask_w)], "j_hi")], "in_j")
        inside = ctx.op("And", [inside_i, inside_j], "inside")
        clamp = lambda v, top, hint: ctx.op("Min", [ctx.op("Max", [v, ctx.i64(0)], hint + "_lo"), ctx.i64(top)], hint)
        cell = ctx.op("Add", [ctx.op("Mul", [clamp(i, mask_h - 1, "ic"), ctx.i64(mask_w)], "row"),
                              clamp(j, mask_w - 1, "jc")], "cell")
        index = ctx.op("Add", [ctx.op("Mul", [cell, ctx.i64(hw)], "cell_hw"), at], "index")
        flat = ctx.op("Reshape", [mask_in, ctx.i64([0, -1])], "flat")
        s = ctx.op("Gather", [flat, index], "s", axis=1)                                   # (N, HW, HW)
        s = ctx.op("Where", [inside, s, ctx.const(np.array(0, np.float32))], "s_win")
        if node.attrs["softmax"]:
            s = ctx.op("Softmax", [s], "s_soft", axis=2)   # the last axis: the same in every opset
        x_flat = ctx.op("Reshape", [x_in, ctx.i64([0, c, hw])], "x_flat")
        prod = ctx.op("MatMul", [x_flat, ctx.op("Transpose", [s], "s_t", perm=[0, 2, 1])], "prod")
        scaled = ctx.op("Mul", [prod, ctx.const(np.array(scale, np.float32))], "scaled")
        ctx.add_node("Reshape", [scaled, ctx.i64([0, c, h, w])], [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        mask_h, mask_w, scale = self._settings(node.attrs, emit.in_shape(0))
        emit.helper(psa_gather_index)
        fn = emit.helper(pointwise_spatial_attention)
        return (f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {mask_h}, {mask_w}, "
                f"distribute={node.attrs['distribute']}, softmax={node.attrs['softmax']}, "
                f"scale={emit.lit(scale)})")

