"""sanpingzhou/Person-Re-ID (129abad; its own Caffe): the P2S nets' PS layer (split_person_layer.cpp, CPU only,
no parameters), which cuts a person's (N, C, H, W) map into four horizontal stripes of full width.

Stripes 0-2 are rows i h4 .. (i + 1) h4 - 1 (h4 = H // 4): (N, C, h4, W).  Stripe 3 is (N, C, H - 3 h4, W), and
the fork writes it with the other stripes' plane stride h4 W: read flat, its value p is plane B = min(p // (h4 W),
N C - 1) of the input at offset r = p - B h4 W past row 3 h4 (r < (H - 3 h4) W), and 0 past that (memory
never written).  When H % 4 == 0 that is the plain fourth stripe; otherwise each plane's last row is lost
but the last plane's, and the blob's tail is 0: reproduced.  Its P2SLoss only trains.
"""
import torch

from .registry import Layer, LayerError, cached_constant, four_axes, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def last_stripe_index(planes: int, height: int, width: int):
    """The fork's fourth stripe as flat indices into the input, -1 where it leaves memory unwritten."""
    rows = height // 4
    plane = rows * width
    p = torch.arange(planes * (height - 3 * rows) * width)
    b = torch.clamp(p // plane, max=planes - 1)
    r = p - b * plane
    src = b * (height * width) + 3 * rows * width + r
    return torch.where(r < (height - 3 * rows) * width, src, torch.full_like(src, -1))


def person_stripes(x, index):
    """Four stripes of x (N, C, H, W): three of H // 4 rows, then the fork's fourth from `index`."""
    n, c, h, w = x.shape
    rows = h // 4
    flat = x.reshape(-1)
    last = torch.where(index >= 0, flat[index.clamp(min=0)], torch.zeros((), dtype=x.dtype, device=x.device))
    return (x[:, :, :rows], x[:, :, rows:2 * rows], x[:, :, 2 * rows:3 * rows], last.reshape(n, c, h - 3 * rows, w))


@register_layer("PS")
class PersonStripes(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 4)
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "PS")
        if h < 4:
            raise LayerError(f"PS cuts 4 stripes of H // 4 rows; a height of {h} leaves them empty")
        rows = h // 4
        return [(n, c, rows, w)] * 3 + [(n, c, h - 3 * rows, w)]

    def forward(self, attrs, params, x):
        n, c, h, w = x.shape
        return person_stripes(x, cached_constant(last_stripe_index, n * c, h, w, device=x.device, dtype=torch.long))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        n, c, h, w = ctx.shape(x)
        rows = h // 4
        index = last_stripe_index(n * c, h, w).numpy()
        for i, out in enumerate(node.outputs[:3]):
            ctx.add_node("Slice", [x, ctx.i64([i * rows]), ctx.i64([(i + 1) * rows]), ctx.i64([2])], [out],
                         name=f"{node.name}/stripe{i}")
        flat = ctx.op("Reshape", [x, ctx.i64([-1])], "flat")
        picked = ctx.op("Gather", [flat, ctx.i64(index.clip(min=0))], "picked", axis=0)
        written = ctx.const(index >= 0, node.name + "_written")   # a Where, as torch: 0 stays 0 beside inf / NaN
        kept = ctx.op("Where", [written, picked, ctx.f32(0.0)], "kept")
        ctx.add_node("Reshape", [kept, ctx.i64([n, c, h - 3 * rows, w])], [node.outputs[3]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(last_stripe_index)
        x = emit.inputs[0]
        return f"{emit.helper(person_stripes)}({x}, last_stripe_index({x}.shape[0] * {x}.shape[1], " \
               f"{x}.shape[2], {x}.shape[3]).to({x}.device))"
