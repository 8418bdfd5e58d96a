"""DeepLab v2 / PSPNet's Interp and its forks' forms, InterpAdvance (the other vision forks' layers:
vision_forks.py).

Interp (DeepLab v2 / PSPNet): align-corners bilinear resize of an optionally
cropped input (pad_beg/pad_end <= 0 crop).  Output size, first match wins as
in DeepLab v2: shrink_factor alone, zoom_factor alone, height + width, shrink
then zoom, or the size of a second bottom.  PSPNet's interp_type
"nearest_neighbor" is supported too.  soeaver/py-RFCN-priv's `use_blob_size`
(8fcc58b caffe-priv/src/caffe/proto/caffe.proto, InterpParameter field 7,
default false; caffe-priv/src/caffe/layers/interp_layer.cpp fec9ec1, Reshape):
the output is bottom 1's height x width whatever shrink/zoom/height/width say
(the fork checks none of them then), bottom 0 still cropped by pad_beg/pad_end
and resized as above; only bottom 1's shape is read, and a single bottom is an
error.  Without it a second bottom sizes the output only when nothing else does.
LeYangNwpu/SROWN's `is_seglabel` (47f59d5 caffe-master/src/caffe/proto/caffe.proto, InterpParameter field 7,
default false; caffe-master/src/caffe/util/interp.cpp/.cu caffe_cpu_interp2 / its kernel, the unpacked path
Interp runs) resizes label maps: each output takes the source pixel at the align-corners position rounded half
up (h1 + 1 where the float32 fraction is >= 0.5, kept at the last row and column), which is PSPNet's
nearest_neighbor, floor(x + 0.5) clamped; a same-size Interp copies in both.

In YOLOv3 conversions and Open Model Zoo's segmentation nets whose joins fit only that, zoom_factor z gives
h x z (interp_zooms_multiply, a fork reading that ir.py's graph builder offers where
_multiplying_zoom_interps finds such Interps before a failed Concat or Eltwise).
InterpAdvance (xw-hu/CF-Caffe): Interp to the second bottom's height and width.

ONNX: Interp -> Slice + Resize (align_corners; vision_forks' _sizes_const and _resize); nearest_neighbor (and
is_seglabel) -> Slice + two Gathers of the source rows and columns forward picks.
"""
import numpy as np
import torch
from torch import nn

from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from .vision_forks import _resize, _sizes_const

# ---- Interp ------------------------------------------------------------------------

def interp_coords(n_in: int, n_out: int, device: torch.device):
    """Caffe's interp2 source coordinates: float32 (n_in - 1) / (n_out - 1) * i."""
    ratio = torch.tensor(0.0)
    if n_out > 1:
        ratio = torch.tensor(float(n_in - 1)) / torch.tensor(float(n_out - 1))
    return (ratio * torch.arange(n_out, dtype=torch.float32)).to(device)


def nearest_indexes(n_in: int, n_out: int, device: torch.device):
    """interp2's nearest source row (column) of each output: the float32 coordinate rounded half up (in double,
    so that no float32 sum rounds it), at most n_in - 1.  A rational coordinate computed exactly (ONNX Resize's
    align_corners) can land on a half the float32 ratio misses: 53 / 26 x 13 is 26.5, float32 26.499998."""
    return torch.floor(interp_coords(n_in, n_out, device).double() + 0.5).long().clamp(0, n_in - 1)


def interp_output_size(he: int, we: int, shrink: int, zoom: int, height: int, width: int, ref_h: int, ref_w: int):
    """DeepLab v2's Interp output size from the cropped input size he x we (0: a field not set);
    first match wins: shrink alone, zoom alone, height x width, shrink then zoom, else ref_h x ref_w."""
    if shrink and not zoom:
        return (he - 1) // shrink + 1, (we - 1) // shrink + 1
    if zoom and not shrink:
        return he + (he - 1) * (zoom - 1), we + (we - 1) * (zoom - 1)
    if height and width:
        return height, width
    if zoom and shrink:
        ho, wo = (he - 1) // shrink + 1, (we - 1) // shrink + 1
        return ho + (ho - 1) * (zoom - 1), wo + (wo - 1) * (zoom - 1)
    return ref_h, ref_w


def interp_resize(x, ho: int, wo: int, nearest: bool = False):
    """Caffe's interp2 of x (N, C, H, W) to ho x wo: align-corners coordinates in float32, then
    truncated indexes and float32 weights (bilinear), or rounding (nearest_neighbor)."""
    he, we = x.shape[2], x.shape[3]
    if nearest:
        return x.index_select(2, nearest_indexes(he, ho, x.device)).index_select(3, nearest_indexes(we, wo, x.device))
    src_h = interp_coords(he, ho, x.device)
    src_w = interp_coords(we, wo, x.device)
    h0, w0 = src_h.long(), src_w.long()
    h1 = torch.where(h0 < he - 1, h0 + 1, h0)
    w1 = torch.where(w0 < we - 1, w0 + 1, w0)
    lh = (src_h - h0.float()).to(x.dtype)[:, None]
    lw = (src_w - w0.float()).to(x.dtype)
    rows0 = x.index_select(2, h0)
    rows1 = x.index_select(2, h1)
    top = (1 - lw) * rows0.index_select(3, w0) + lw * rows0.index_select(3, w1)
    bot = (1 - lw) * rows1.index_select(3, w0) + lw * rows1.index_select(3, w1)
    return (1 - lh) * top + lh * bot


class Interp(nn.Module):
    """DeepLab's Interp: crop by pad_beg/pad_end (<= 0), then interp_resize to interp_output_size
    (ref_h x ref_w: the second bottom's size, when nothing else sets it)."""

    def __init__(self, shrink=0, zoom=0, height=0, width=0, pad_beg=0, pad_end=0, nearest=False):
        super().__init__()
        self.shrink, self.zoom, self.height, self.width = shrink, zoom, height, width
        self.pad_beg, self.pad_end, self.nearest = pad_beg, pad_end, nearest

    def forward(self, x, ref_h: int = 0, ref_w: int = 0):
        he = x.shape[2] + self.pad_beg + self.pad_end
        we = x.shape[3] + self.pad_beg + self.pad_end
        ho, wo = interp_output_size(he, we, self.shrink, self.zoom, self.height, self.width, ref_h, ref_w)
        b = -self.pad_beg
        x = x[:, :, b:b + he, b:b + we]
        if ho == he and wo == we:
            return x
        return interp_resize(x, ho, wo, self.nearest)


# model.py gets the same code that forward runs
TORCH_INTERP = torch_sources(interp_coords, nearest_indexes, interp_output_size, interp_resize, Interp)


def is_zoom_only(attrs):
    """An Interp whose size zoom_factor alone sets (DeepLab's first match: no shrink_factor)."""
    return attrs.get("zoom") is not None and attrs.get("shrink") is None


def interp_zooms_multiply(net):
    """ForkReading rewrite for YOLOv3 conversions that upsample with Interp's zoom_factor: the Interp they run
    with (DeepLab's, its output size changed to h x zoom_factor; jasonlovescoding/YOLOv3-caffe's README tells
    how) keeps DeepLab's bilinear interpolation.  OpenVINO's Model Optimizer reads Interp so too
    (openvinotoolkit/openvino tools/mo/openvino/tools/mo/ops/interp.py and
    model-optimizer/extensions/front/InterpolateNormalizer.py: zoom alone gives (h + pad_beg + pad_end) x zoom,
    DeepLab's formula left commented out; interp_ext.py: linear, align_corners 1), which Open Model Zoo's
    PyTorch-made road- and semantic-segmentation-adas nets need (their joins see the Interp through a Conv and ReLU;
    openvinotoolkit/training_toolbox_caffe 5e543a4 has no Interp layer).  Every Interp whose size zoom_factor alone
    sets gets caffeq's interp_param.zoom_multiplies.  Returns the note."""
    marked = []
    for lp in net.layer:
        p = lp.interp_param
        if lp.type == "Interp" and p.HasField("zoom_factor") and not p.HasField("shrink_factor") \
                and not p.use_blob_size:
            p.zoom_multiplies = True
            marked.append(lp.name)
    return (f"the Interp layers {', '.join(repr(n) for n in marked)} read as the Interp YOLOv3 conversions run "
            f"with (and OpenVINO's Model Optimizer computes): zoom_factor z gives h x z (DeepLab's "
            f"h + (h - 1)(z - 1) does not fit the net's joins), the "
            f"same bilinear interpolation")


def _multiplying_zoom_interps(in_ids, nodes, shapes):
    """The Interps, sized by zoom_factor alone, that make bottoms of a failed Concat or Eltwise whose
    spatial sizes all agree once each such Interp gives h x zoom instead of DeepLab's h + (h - 1)(zoom - 1)
    (YOLOv3 conversions' Interp, see interp_zooms_multiply); else []."""
    by_output = {tid: n for n in nodes for tid in n.outputs}
    sizes, found = [], []
    for tid in in_ids:
        node, shape = by_output.get(tid), shapes.get(tid)
        if shape is None or len(shape) != 4:
            return []
        seen = set()   # back through one-bottom layers that keep the map's size (ReLU, 1x1 or same-padded convs):
        while node is not None and node.type != "Interp" and len(node.inputs) == 1 and id(node) not in seen \
                and len(shapes.get(node.inputs[0]) or ()) == 4 and list(shapes[node.inputs[0]][2:]) == list(shape[2:]):
            seen.add(id(node))     # Open Model Zoo's PyTorch-made segmentation nets join Interp -> Conv -> ReLU
            node = by_output.get(node.inputs[0])
        if node is not None and node.type == "Interp" and is_zoom_only(node.attrs) and node.attrs["zoom"] > 1 \
                and not node.attrs.get("zoom_multiplies"):
            x = shapes.get(node.inputs[0])
            if x is None:
                return []
            (he, we), _ = node.spec.out_size(node.attrs, x[2], x[3])
            sizes.append((he * node.attrs["zoom"], we * node.attrs["zoom"]))
            found.append(node.name)
        else:
            sizes.append(tuple(shape[2:]))
    return found if found and len(set(sizes)) == 1 else []


@register_layer("Interp")
class InterpLayer(Layer):
    def parse(self, lp):
        need_blobs(lp, "Interp", (1, 2), roles="data, size reference")
        p = lp.interp_param
        a = {"pad_beg": int(p.pad_beg), "pad_end": int(p.pad_end), "type": p.interp_type,
             "zoom": int(p.zoom_factor) if p.HasField("zoom_factor") else None,
             "shrink": int(p.shrink_factor) if p.HasField("shrink_factor") else None,
             "height": int(p.height) if p.HasField("height") and p.HasField("width") else None,
             "width": int(p.width) if p.HasField("height") and p.HasField("width") else None,
             "two_bottoms": len(lp.bottom) == 2, "zoom_multiplies": bool(p.zoom_multiplies)}
        if p.use_blob_size:   # soeaver's fork: bottom 1's size before every other size field, which it never reads
            if not a["two_bottoms"]:
                raise LayerError("interp_param.use_blob_size needs a second bottom to take the size from")
            a.update(zoom=None, shrink=None, height=None, width=None, use_blob_size=True)
        if a["pad_beg"] > 0 or a["pad_end"] > 0:
            raise LayerError("interp_param.pad_beg/pad_end must be <= 0 (only cropping is supported)")
        if a["type"] not in ("bilinear", "nearest_neighbor"):
            raise LayerError(f"interp_param.interp_type must be 'bilinear' or 'nearest_neighbor', "
                             f"got '{a['type']}'")
        if p.is_seglabel:   # LeYangNwpu/SROWN's label maps: its rounded source pixel is PSPNet's nearest_neighbor
            if p.HasField("interp_type") and a["type"] != "nearest_neighbor":
                raise LayerError(f"interp_param.is_seglabel (nearest source pixels) contradicts interp_type "
                                 f"'{a['type']}'")
            a["type"] = "nearest_neighbor"
        if a["zoom"] is not None and a["zoom"] < 1:
            raise LayerError(f"interp_param.zoom_factor must be >= 1, got {a['zoom']}")
        if a["shrink"] is not None and a["shrink"] < 1:
            raise LayerError(f"interp_param.shrink_factor must be >= 1, got {a['shrink']}")
        if a["zoom"] is None and a["shrink"] is None and a["height"] is None and not a["two_bottoms"]:
            raise LayerError("Interp needs zoom_factor, shrink_factor, height and width, or a second bottom")
        return a

    @staticmethod
    def out_size(a, h, w, ref_hw=None):
        he, we = h + a["pad_beg"] + a["pad_end"], w + a["pad_beg"] + a["pad_end"]
        if he <= 0 or we <= 0:
            raise LayerError(f"cropping {a['pad_beg']}/{a['pad_end']} leaves nothing of a {h}x{w} input")
        if a.get("zoom_multiplies") and is_zoom_only(a):
            ho, wo = he * a["zoom"], we * a["zoom"]
        else:
            ho, wo = interp_output_size(he, we, a["shrink"] or 0, a["zoom"] or 0, a["height"] or 0, a["width"] or 0,
                                        *(ref_hw or (0, 0)))
        if ho <= 0 or wo <= 0:
            raise LayerError(f"output size {ho}x{wo} must be positive")
        return (he, we), (int(ho), int(wo))

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"Interp needs a 4-axis input, got {list(s)}")
        ref = None
        if attrs["two_bottoms"]:
            r = in_shapes[1]
            if len(r) != 4:
                raise LayerError(f"Interp's second bottom must have 4 axes, got {list(r)}")
            ref = (r[2], r[3])
        _, (ho, wo) = self.out_size(attrs, s[2], s[3], ref)
        return [(s[0], s[1], ho, wo)]

    def forward(self, attrs, params, x, ref=None):
        (he, we), (ho, wo) = self.out_size(attrs, x.shape[2], x.shape[3],
                                           None if ref is None else (ref.shape[2], ref.shape[3]))
        b = -attrs["pad_beg"]
        x = x[:, :, b:b + he, b:b + we]
        if (he, we) == (ho, wo):
            return x.clone()
        return interp_resize(x, ho, wo, attrs["type"] == "nearest_neighbor")

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        s = ctx.shape(x)
        ref = None
        if a["two_bottoms"]:
            r = ctx.shape(node.inputs[1])
            ref = (r[2], r[3])
        (he, we), (ho, wo) = self.out_size(a, s[2], s[3], ref)
        if (he, we) != (s[2], s[3]):
            b = -a["pad_beg"]
            crop = ctx.tmp(node.name + "_crop")
            ctx.add_node("Slice", [x, ctx.const(np.array([b, b], np.int64)),
                                   ctx.const(np.array([b + he, b + we], np.int64)),
                                   ctx.const(np.array([2, 3], np.int64))], [crop])
            x = crop
        if (he, we) == (ho, wo):
            ctx.add_node("Identity", [x], [node.outputs[0]], name=node.name)
            return
        if a["type"] == "nearest_neighbor":   # the source rows and columns forward picks (Resize's differ at halves)
            cpu = torch.device("cpu")
            rows = ctx.op("Gather", [x, ctx.const(nearest_indexes(he, ho, cpu).numpy())], "rows", axis=2)
            ctx.add_node("Gather", [rows, ctx.const(nearest_indexes(we, wo, cpu).numpy())], [node.outputs[0]],
                         name=node.name, axis=3)
            return
        _resize(ctx, x, node.outputs[0], _sizes_const(ctx, x, [ho, wo], node.name), node.name, mode="linear",
                coordinate_transformation_mode="align_corners")

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a.get("zoom_multiplies") and is_zoom_only(a):   # the size this reading gives, written out
            s = emit.in_shape(0)
            _, (ho, wo) = self.out_size(a, s[2], s[3])
            a = dict(a, zoom=None, height=ho, width=wo)
        args = []
        for key, name in (("shrink", "shrink"), ("zoom", "zoom"), ("height", "height"), ("width", "width")):
            if a[key] is not None:
                args.append(f"{name}={a[key]}")
        for key in ("pad_beg", "pad_end"):
            if a[key]:
                args.append(f"{key}={a[key]}")
        if a["type"] == "nearest_neighbor":
            args.append("nearest=True")
        m = emit.module(f"{emit.helper(TORCH_INTERP)}({', '.join(args)})")
        if a["two_bottoms"]:  # the size of the second bottom (when nothing else sets it)
            ref = emit.inputs[1]
            return f"{m}({emit.inputs[0]}, {ref}.shape[2], {ref}.shape[3])"
        return f"{m}({emit.inputs[0]})"


@register_layer("InterpAdvance")
class InterpAdvance(InterpLayer):
    """xw-hu/CF-Caffe's InterpAdvance (477b79f interp_advance_layer.cpp): Interp to the second bottom's height
    and width, without pads; it reads no interp_param."""

    def parse(self, lp):
        need_blobs(lp, "InterpAdvance", 2, 1, roles="data, size reference")
        return {"pad_beg": 0, "pad_end": 0, "type": "bilinear", "zoom": None, "shrink": None, "height": None,
                "width": None, "two_bottoms": True}
