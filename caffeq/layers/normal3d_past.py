"""The 3D surface-normal layers of rohitgirdhar-cmu-experimental/caffe-3dnormal_joint_past (98f0ab2), a copy of
xiaolonw/caffe-3dnormal_joint_pose (11f5adc) whose decode, combine, rescale, resize, norm, multi_softmax and
reshape layers are byte-identical.  V1 types, read by name (caffeq/io/upgrade.py's fork_v1_type); the
parameters in proto/caffe.proto (proto/README.md).  The others these nets use are already here: MULTI_SOFTMAX
(v1_forks.py), NORM (face_norms.py, x / (sqrt(sum x^2) + 1e-6)), RESIZE (pose_action.py, util_img's bilinear
resize) and RESHAPE (reshape.py's PatchReshape: the same patch spreading as Arroosh's fork).

- Decode (src/caffe/layers/decode_layer.cpp; decode_param source_dict, source_triids, usesoft [false]): the
  bottom (N, C, H, W) holds C codeword probabilities per pixel; the top is (N, 3, H, W).  source_dict is a text
  file of C rows of 3 floats (the codebook, the fork's CHECK: as many rows as channels), source_triids one of
  T rows of 3 one-based codeword ids (triangles).  usesoft: top = sum over c, in channel order, of
  p[c] * dict[c].  Else, per pixel, the triangle t whose p sum (its three ids in file order) is largest, the
  first on ties and triangle 0 when no sum exceeds 0 (maxp starts at 0, compared with >); top = the sum over
  its three ids, in file order, of p[id] * dict[id].  Both files are read at setup (the triangles' even with
  usesoft); neither is in the caffemodel: caffeq reads them where they are found (as written, then next to the
  prototxt, then in the current folder) and otherwise reads the layer without running it.  Both are read as
  the fork's loops fscanf them (caffeq/fs.py's read_text_numbers): source_dict by "%f" (strtof, each number
  rounded once to float), source_triids by "%d" (base 10); white space skipped, the longest number taken
  ("1-2" is 1 then -2; "2.5" under %d is 2, then the reading ends), the first word that is no number ends the
  reading; a number whose reading differs between C libraries ("1e", "0x", an int past 32 bits) is refused.
- Rescale, the fork's (rescale_layer.cpp; V1 RESCALE with decode_param.source_dict; DeepSkeleton's Rescale
  with rescale_param stays edge_flow_crf_forks.py's): top[i] = x[i] * 128 + 128 - mean[i % dim], dim the
  count of one sample, the mean every float of source_dict (fscanf("%f") order; the first dim of them used here,
  fewer refused: the fork would read past its vector).  Not found, the layer is read, not run.
- Combine (combine_layer.cpp): the bottoms' samples laid one after another, i.e. the concatenation along
  channels of 4-axis bottoms of one N, H and W (its CHECKs on H and W).
- JointImageData (joint_image_data_layer.cpp; image_data_param with new_height_2, new_width_2, mean_file_2):
  a list of (image, label file) lines; tops: the image resized to new_height x new_width (3 channels, BGR),
  the label file's new_height x new_width integers (N, 1, new_height, new_width), and the same image resized
  to new_height_2 x new_width_2, each image less its mean file, times scale.  No crop (its CHECK), no mirror.
- ImageLocData (image_loc_data_layer.cpp; image_loc_data_param): each list line holds source_num files (an
  image, then source_num - 1 raw float32 maps of 3 channels) and a label file; the image resized to
  new_height x new_width is cut into the (new_height / slide_stride) x (new_width / slide_stride) windows of
  crop_size centred on the stride grid (zeros past the edge), one per batch item (the fork's CHECK: their count
  is batch_size): data (batch_size, 3 source_num, crop_size, crop_size), label (batch_size, 1, 1, 1).
- MULTI_SOFTMAX_LOSS and ACCURACY only train and score (loss_param.scale is read and not used).
"""
import os

import numpy as np
import torch
from torch import nn

from ..fs import read_text_numbers, resolve_source
from .data import DataLayer
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    legacy_nchw,
    need_blobs,
    positive_field,
    register_layer,
)

#: the largest codebook, triangle or mean file read
MAX_TEXT_BYTES = 256 << 20


# ---- torch functions (model.py gets the same code) ---------------------------------------------

def decode_normals(p, codebook, triangles, soft: bool):
    """p (N, C, H, W) codeword probabilities -> (N, 3, H, W) normals; codebook (C, 3), triangles (T, 3)
    zero-based ids (int64).  The sums run in the fork's order."""
    if soft:
        out = p[:, 0:1] * codebook[0].reshape(1, 3, 1, 1)
        for c in range(1, p.shape[1]):
            out = out + p[:, c:c + 1] * codebook[c].reshape(1, 3, 1, 1)
        return out
    sums = p.index_select(1, triangles[:, 0]) + p.index_select(1, triangles[:, 1])
    sums = sums + p.index_select(1, triangles[:, 2])
    best = sums.argmax(1, keepdim=True)                       # the first of equal sums, as `>`
    best = torch.where(sums.gather(1, best) > 0, best, torch.zeros_like(best))
    parts = []
    for k in range(3):
        ids = triangles[:, k][best]                           # (N, 1, H, W) codeword ids
        parts.append((p.gather(1, ids), codebook[ids[:, 0]].permute(0, 3, 1, 2)))
    out = parts[0][0] * parts[0][1]
    for prob, code in parts[1:]:
        out = out + prob * code
    return out


class DecodeNormals(nn.Module):
    def __init__(self, channels: int, triangles: int, soft: bool):
        super().__init__()
        self.soft = soft
        self.register_buffer("codebook", torch.zeros(channels, 3))
        self.register_buffer("triangles", torch.zeros(triangles, 3, dtype=torch.int64))

    def forward(self, p):
        return decode_normals(p, self.codebook.to(p.dtype), self.triangles, self.soft)


def rescale_normals(x, mean):
    """x * 128 + 128 - mean, the mean shaped as one sample."""
    return x * 128.0 + 128.0 - mean


class RescaleNormals(nn.Module):
    def __init__(self, shape: list):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))

    def forward(self, x):
        return rescale_normals(x, self.mean.to(x.dtype))


# ---- reading the fork's text files ----------------------------------------------------------------

def read_numbers(path, conversion, what):
    """The numbers the fork's `while (fscanf(fid, conversion, &x) > 0)` loop reads from the text file at path
    (conversion "%f": strtof's floats, "%d": base-10 ints; caffeq/fs.py's read_text_numbers), up to the first
    word that is not one; what: the field, named with the path in one-line LayerErrors."""
    what = f"{what} {path}"
    values = read_text_numbers(path, conversion, MAX_TEXT_BYTES, what, LayerError)
    if values is None:
        raise LayerError(f"{what}: no longer there")
    return values


def _existing(path, base_dir):
    found = resolve_source(path, base_dir) if path else ""
    return found if found and os.path.isfile(found) else None


def read_codebook(dict_path, tri_path, channels):
    """(codebook (C, 3) float32, triangles (T, 3) zero-based int64) of a Decode layer, checked as the fork reads them."""
    values = read_numbers(dict_path, "%f", "decode_param.source_dict")
    if len(values) % 3:
        raise LayerError(f"decode_param.source_dict {dict_path} holds {len(values)} numbers, not rows of 3 (x, y, z)")
    codebook = np.array(values, np.float32).reshape(-1, 3)
    if len(codebook) != channels:
        raise LayerError(f"decode_param.source_dict {dict_path} holds {len(codebook)} codewords; the bottom has "
                         f"{channels} channels (the fork's CHECK)")
    ids = read_numbers(tri_path, "%d", "decode_param.source_triids")
    if not ids or len(ids) % 3:
        raise LayerError(f"decode_param.source_triids {tri_path} holds {len(ids)} integers, not rows of 3 codeword ids")
    triangles = np.array(ids, np.int64).reshape(-1, 3)
    if triangles.min() < 1 or triangles.max() > channels:
        raise LayerError(f"decode_param.source_triids {tri_path}: codeword ids run from 1 to {channels}, got "
                         f"{int(triangles.min())} to {int(triangles.max())}")
    return codebook, triangles - 1


# ---- Decode -----------------------------------------------------------------------------------------

@register_layer("Decode")
class Decode(Layer):
    reads_files = True

    def parse(self, lp):
        need_blobs(lp, "Decode", 1, 1)
        p = lp.decode_param
        if not p.source_dict or not p.source_triids:
            raise LayerError("Decode needs decode_param.source_dict and source_triids (the fork reads both at setup)")
        return {"name": lp.name, "dict": str(p.source_dict), "triids": str(p.source_triids), "soft": bool(p.usesoft)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "Decode")
        paths = [_existing(attrs[k], attrs.get("base_dir")) for k in ("dict", "triids")]
        attrs["_tables"] = read_codebook(paths[0], paths[1], c) if all(paths) else None
        return [(n, 3, h, w)]

    def cannot_run(self, attrs, in_shapes):
        if attrs.get("_tables") is None:
            return (f"decode_param's codebook '{attrs['dict']}' or triangles '{attrs['triids']}' not found (as "
                    f"written, next to the prototxt or in the current folder); the caffemodel does not hold them")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError)
        codebook, triangles = attrs["_tables"]
        x = x.reshape(legacy_nchw(tuple(x.shape), "Decode"))
        return decode_normals(x, torch.as_tensor(codebook, dtype=x.dtype, device=x.device),
                              torch.as_tensor(triangles, device=x.device), attrs["soft"])

    def onnx(self, ctx, node):
        from ..errors import ExportError
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(node.inputs[0])], ExportError)
        codebook, triangles = node.attrs["_tables"]
        shape = legacy_nchw(ctx.shape(node.inputs[0]), "Decode")
        p = ctx.op("Reshape", [node.inputs[0], ctx.i64([0] + list(shape[1:]))], "p4d", name=node.name)
        if node.attrs["soft"]:
            out = None
            for c in range(shape[1]):
                pc = ctx.op("Gather", [p, ctx.i64([c])], f"p{c}", axis=1)
                term = ctx.op("Mul", [pc, ctx.const(codebook[c].reshape(1, 3, 1, 1))], f"term{c}")
                out = term if out is None else ctx.op("Add", [out, term], f"sum{c}")
            ctx.add_node("Identity", [out], [node.outputs[0]])
            return
        picked = [ctx.op("Gather", [p, ctx.const(triangles[:, k].copy())], f"tri{k}", axis=1) for k in range(3)]
        sums = ctx.op("Add", [ctx.op("Add", [picked[0], picked[1]], "sum01"), picked[2]], "sums")
        best = ctx.op("ArgMax", [sums], "best", axis=1, keepdims=1)
        top = ctx.op("GatherElements", [sums, best], "top", axis=1)
        best = ctx.op("Where", [ctx.op("Greater", [top, ctx.f32(0.0)], "positive"), best, ctx.i64(0)], "chosen")
        probs, codes = [], []
        for k in range(3):
            ids = ctx.op("Gather", [ctx.const(triangles[:, k].copy()), best], f"ids{k}", axis=0)
            probs.append(ctx.op("GatherElements", [p, ids], f"prob{k}", axis=1))
            codes.append([ctx.op("Gather", [ctx.const(codebook[:, j].copy()), ids], f"code{k}{j}", axis=0)
                          for j in range(3)])
        axes = []
        for j in range(3):
            acc = ctx.op("Mul", [probs[0], codes[0][j]], f"x{j}_0")
            for k in (1, 2):
                acc = ctx.op("Add", [acc, ctx.op("Mul", [probs[k], codes[k][j]], f"x{j}_{k}t")], f"x{j}_{k}")
            axes.append(acc)
        ctx.add_node("Concat", axes, [node.outputs[0]], axis=1)

    def pytorch_source(self, node, emit):
        from ..errors import ExportError
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError)
        codebook, triangles = node.attrs["_tables"]
        m = emit.instance(DecodeNormals, len(codebook), len(triangles), node.attrs["soft"], needs=(decode_normals,))
        emit.buffer("codebook", codebook)
        emit.buffer("triangles", triangles)
        shape = legacy_nchw(emit.in_shape(0), "Decode")
        x = emit.inputs[0]
        return f"{m}({x}.reshape({x}.shape[0], {', '.join(str(d) for d in shape[1:])}))"


# ---- the fork's Rescale ---------------------------------------------------------------------------

@claim_layers("Rescale", lambda lp: lp.HasField("decode_param"))
class MeanRescale(Layer):
    reads_files = True

    def parse(self, lp):
        need_blobs(lp, "Rescale (decode_param)", 1, 1)
        if lp.HasField("rescale_param"):
            raise LayerError("Rescale: decode_param (3dnormal_joint_past's mean rescale) and rescale_param "
                             "(DeepSkeleton's) do not combine")
        if not lp.decode_param.source_dict:
            raise LayerError("Rescale needs decode_param.source_dict (the mean the fork reads at setup)")
        return {"name": lp.name, "dict": str(lp.decode_param.source_dict)}

    def infer(self, attrs, in_shapes):
        shape = tuple(in_shapes[0])
        path = _existing(attrs["dict"], attrs.get("base_dir"))
        attrs["_mean"] = None
        if path:
            values = read_numbers(path, "%f", "decode_param.source_dict")
            dim = int(np.prod(shape[1:]))
            if len(values) < dim:
                raise LayerError(f"decode_param.source_dict {path} holds {len(values)} numbers; one sample of the "
                                 f"bottom {list(shape)} has {dim}")
            attrs["_mean"] = np.array(values[:dim], np.float32).reshape(shape[1:])
        return [shape]

    def cannot_run(self, attrs, in_shapes):
        if attrs.get("_mean") is None:
            return (f"decode_param.source_dict '{attrs['dict']}' (the mean) not found (as written, next to the "
                    f"prototxt or in the current folder); the caffemodel does not hold it")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError)
        return rescale_normals(x, torch.as_tensor(attrs["_mean"], dtype=x.dtype, device=x.device))

    def onnx(self, ctx, node):
        from ..errors import ExportError
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(node.inputs[0])], ExportError)
        scaled = ctx.op("Mul", [node.inputs[0], ctx.f32(128.0)], "x128", name=node.name)
        shifted = ctx.op("Add", [scaled, ctx.f32(128.0)], "plus128")
        mean = node.attrs["_mean"]
        ctx.add_node("Sub", [shifted, ctx.const(mean.reshape((1,) + mean.shape))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        from ..errors import ExportError
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError)
        mean = node.attrs["_mean"]
        m = emit.instance(RescaleNormals, list(mean.shape), needs=(rescale_normals,))
        emit.buffer("mean", mean)
        return f"{m}({emit.inputs[0]})"


# ---- Combine ----------------------------------------------------------------------------------------

@register_layer("Combine")
class Combine(Layer):
    def parse(self, lp):
        need_blobs(lp, "Combine", range(1, 1 << 30), 1)
        return {}

    def infer(self, attrs, in_shapes):
        shapes = [legacy_nchw(s, "Combine") for s in in_shapes]
        n, _, h, w = shapes[0]
        for i, s in enumerate(shapes[1:], 1):
            if s[0] != n or s[2:] != (h, w):
                raise LayerError(f"Combine's bottoms must share num, height and width: bottom 0 {list(shapes[0])}, "
                                 f"bottom {i} {list(s)}")
        attrs["_legacy"] = [list(s) for s in shapes]
        return [(n, sum(s[1] for s in shapes), h, w)]

    def forward(self, attrs, params, *xs):
        return torch.cat([x.reshape(s) for x, s in zip(xs, attrs["_legacy"])], dim=1)

    def onnx(self, ctx, node):
        ins = [ctx.op("Reshape", [x, ctx.i64([0] + s[1:])], f"in{i}_4d", name=node.name if i == 0 else None)
               for i, (x, s) in enumerate(zip(node.inputs, node.attrs["_legacy"]))]
        ctx.add_node("Concat", ins, [node.outputs[0]], axis=1)

    def pytorch_source(self, node, emit):
        xs = [f"{x}.reshape({x}.shape[0], {', '.join(str(d) for d in s[1:])})"
              for x, s in zip(emit.inputs, node.attrs["_legacy"])]
        return f"torch.cat([{', '.join(xs)}], dim=1)"


# ---- the data layers --------------------------------------------------------------------------------

@register_layer("JointImageData")
class JointImageData(DataLayer):
    def parse(self, lp):
        need_blobs(lp, "JointImageData (data, label, data_2)", 0, 3)
        p = lp.image_data_param
        if p.crop_size:
            raise LayerError(f"image_data_param.crop_size {p.crop_size}: JointImageData does not crop (the fork's CHECK)")
        if p.mirror:
            raise LayerError("image_data_param.mirror: JointImageData mirrors only with a crop, which it lacks (the "
                             "fork stops)")
        sizes = {f: positive_field(getattr(p, f), f"image_data_param.{f}")
                 for f in ("new_height", "new_width", "new_height_2", "new_width_2")}
        return {"type": lp.type, "tops": list(lp.top), "num_tops": 3, "source": p.source,
                "batch_size": positive_field(p.batch_size, "image_data_param.batch_size"), **sizes,
                "scale": float(p.scale), "mean_file": p.mean_file or None, "mean_file_2": p.mean_file_2 or None}

    def top_shapes(self, attrs, given):
        n = attrs["batch_size"]
        made = [(n, 3, attrs["new_height"], attrs["new_width"]), (n, 1, attrs["new_height"], attrs["new_width"]),
                (n, 3, attrs["new_height_2"], attrs["new_width_2"])]
        return [tuple(given.get(i) or made[i]) for i in range(3)]

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        scale = f", times {attrs['scale']:g}" if attrs["scale"] != 1 else ""
        return [f"image list {attrs['source']!r}: each line an image and a text file of new_height x new_width "
                f"integer labels (top 1)",
                f"top 0: the image read in colour (BGR, 0-255), resized (cv::resize, bilinear) to "
                f"{attrs['new_height']} x {attrs['new_width']}, less mean_file "
                f"{attrs['mean_file'] or '(none: 0)'}{scale}",
                f"top 2: the same image resized to {attrs['new_height_2']} x {attrs['new_width_2']}, less "
                f"mean_file_2 {attrs['mean_file_2'] or '(none: 0)'}{scale}"]


@register_layer("ImageLocData")
class ImageLocData(DataLayer):
    def parse(self, lp):
        need_blobs(lp, "ImageLocData (data, label)", 0, 2)
        p = lp.image_loc_data_param
        a = {f: positive_field(getattr(p, f), f"image_loc_data_param.{f}")
             for f in ("batch_size", "crop_size", "new_height", "new_width", "slide_stride", "source_num")}
        windows = (a["new_height"] // a["slide_stride"]) * (a["new_width"] // a["slide_stride"])
        if windows != a["batch_size"]:
            raise LayerError(f"image_loc_data_param: (new_height / slide_stride) x (new_width / slide_stride) = "
                             f"{windows} windows must be batch_size {a['batch_size']} (the fork's CHECK)")
        if p.mirror:
            raise LayerError("image_loc_data_param.mirror is not supported: the fork's windows are never mirrored")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": 2, "source": p.source, **a,
                "scale": float(p.scale), "mean_file": p.mean_file or None}

    def top_shapes(self, attrs, given):
        n, k = attrs["batch_size"], attrs["crop_size"]
        made = [(n, 3 * attrs["source_num"], k, k), (n, 1, 1, 1)]
        return [tuple(given.get(i) or made[i]) for i in range(2)]

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        s, k = attrs["slide_stride"], attrs["crop_size"]
        scale = f", times {attrs['scale']:g}" if attrs["scale"] != 1 else ""
        return [f"list {attrs['source']!r}: each line {attrs['source_num']} file(s) (an image, then raw float32 "
                f"3-channel maps) and a label file",
                f"the image read in colour (BGR) and resized to {attrs['new_height']} x {attrs['new_width']}; its "
                f"bytes stored as signed char (values past 127 wrap to negative, as the fork's static_cast<char>)",
                f"one {k} x {k} window per batch item, centred at (gh * {s} + {s // 2}, gw * {s} + {s // 2}) row by "
                f"row, zeros past the image, less mean_file {attrs['mean_file'] or '(none: 0)'}{scale}"]


__all__ = ["Combine", "Decode", "DecodeNormals", "ImageLocData", "JointImageData", "MeanRescale", "RescaleNormals",
           "decode_normals", "read_codebook", "read_numbers", "rescale_normals"]
