"""The vector operations of strawberryfg/Senorita-HANDS19-Pose (40d1341, src/network_layers: layers in
src/caffe/layers/operations/*.cpp, declarations in include/caffe/operations.hpp, parameters in
src/caffe/proto/caffe.proto), which strawberryfg/3dhuman-groupnorm's training nets use too (that repository
carries no sources).  The parameters are in proto/caffe.proto (proto/README.md).

Every vector layer reshapes its top to (N, D) = the first two axes of its (first) bottom and walks t < N,
i < D over the flat data at t * D + i, so a bottom of more axes gives its first N * D values (caffeq does the
same; a bottom of fewer than two axes, whose shape()[1] the fork reads past, is refused).

- ReadBlobFromFile (read_blob_from_file_layer.cpp; read_blob_from_file_param file_path, num_to_read [21],
  batch_size [16]): no bottoms, one top (batch_size, num_to_read); each forward fscanf's num_to_read doubles
  from file_path into a 333-double buffer (t_data[333]: num_to_read past 333 is refused) and copies them, as
  float, into every row.  file_path is looked up as fopen does (as written: absolute, else from the current
  folder; never the prototxt's folder).  Nothing there (the fork's fopen gives NULL and its fscanf crashes):
  the top is a graph input of that shape, fed by the user (the corpus files name Windows paths such as
  E:\\center_x_224.txt).  Something there: it is opened without blocking and must be a regular file (a
  FIFO, device or folder is refused before any read); caffeq reads its first 1 MiB and takes the numbers
  num_to_read fscanf("%lf") calls read (caffeq/fs.py's read_text_numbers: white space skipped, the longest
  strtod number; the first word that is no number ends the reading: "1-2" gives 1, -2; "1,2" gives 1;
  each double then rounded to float), as a constant top.  Fewer numbers (the fork's row would keep t_data's
  stale values), numbers past the first 1 MiB, or a number whose reading differs between C libraries ("1e",
  "0x", "infin") are LayerErrors.
- ReadBlobFromFileIndexing (read_blob_from_file_indexing_layer.cpp; read_blob_from_file_indexing_param
  file_prefix, num_to_read [21]): top (N, num_to_read), N the index bottom's first axis; each sample's row is
  read at run time from "<file_prefix><(int) index[t]>.txt".  Read and sized; not run (a file read per run-time
  value is no graph operation).
- ScaleVector (scale_vector_layer.cpp; scale_vector_param.scale_factor, a float, default 1.8): top = x *
  scale_factor (the float factor widened to double, the product rounded to float: the float product).  One or
  more bottoms (MinBottomBlobs 1); only the first is read.
- AddVectorByConstant (add_vector_by_constant_layer.cpp; add_vector_by_constant_param.add_value, a float,
  default 0): top = x + add_value in float.
- TwoVectorSubtract (two_vector_subtract_layer.cpp; universal_param.take_abs [false]): top = a - b in float,
  |a - b| with take_abs (the float abs MSVC's <cmath> gives, the fork's Windows build; the first N * D values of
  b are read, fewer refused).
- IdentityVectorNoGradient (identity_vector_no_gradient_layer.cpp): top = x (its backward writes zeros).
- OutputBlob (output_blob_layer.cpp; output_blob_param): writes each sample's row of its first bottom to
  "<save_path><blob_name>_<index>.txt"; no tops.  caffeq writes no files: read, nothing computed.

torch, ONNX and model.py for the computing layers.
"""
import os

import numpy as np
import torch
from torch import nn

from ..fs import read_text_numbers
from .registry import (
    AT_LEAST,
    Layer,
    LayerError,
    claim_layers,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)

#: the fork's fscanf buffer: double t_data[333]
BUFFER = 333
#: the largest ReadBlobFromFile file caffeq reads as a constant
MAX_FILE_BYTES = 1 << 20


# ---- torch functions (model.py gets the same code) ---------------------------------------------

def first_rows(x, n: int, d: int):
    """The fork's (N, D) view of a bottom: its first n * d values, row t = flat[t * d:(t + 1) * d]."""
    if x.dim() == 2:
        return x
    return x.reshape(-1)[: n * d].reshape(n, d)


def scale_vector(x, factor: float):
    return first_rows(x, x.shape[0], x.shape[1]) * factor


def add_vector_by_constant(x, value: float):
    return first_rows(x, x.shape[0], x.shape[1]) + value


def two_vector_subtract(a, b, take_abs: bool):
    n, d = a.shape[0], a.shape[1]
    out = first_rows(a, n, d) - b.reshape(-1)[: n * d].reshape(n, d)
    return out.abs() if take_abs else out


def identity_vector(x):
    return first_rows(x, x.shape[0], x.shape[1]).clone()


class ConstantRows(nn.Module):
    """ReadBlobFromFile's constant top: its file's row, n times."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.n = n
        self.register_buffer("row", torch.zeros(1, d))

    def forward(self):
        return self.row.expand(self.n, self.row.shape[1]).clone()


TORCH_CONSTANT_ROWS = torch_sources(ConstantRows)
TORCH_VECTOR = torch_sources(first_rows, scale_vector, add_vector_by_constant, two_vector_subtract, identity_vector)


def _vector_shape(shape, what):
    if len(shape) < 2:
        raise LayerError(f"{what} reads the bottom's first two axes (N, D); the bottom {list(shape)} has "
                         f"{len(shape)} (the fork indexes shape()[1])")
    return (int(shape[0]), int(shape[1]))


def _onnx_rows(ctx, name, shape, hint):
    """ONNX: the (N, D) rows of a bottom named `name` of static `shape` (its first N * D values)."""
    n, d = int(shape[0]), int(shape[1])
    if len(shape) == 2:
        return name
    flat = ctx.op("Reshape", [name, ctx.i64([-1])], f"{hint}_flat")
    head = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([n * d]), ctx.i64([0])], f"{hint}_head")
    return ctx.op("Reshape", [head, ctx.i64([n, d])], f"{hint}_rows")


# ---- ReadBlobFromFile ---------------------------------------------------------------------------

def _read_blob_fields(lp):
    need_blobs(lp, "ReadBlobFromFile", 0, 1)
    p = lp.read_blob_from_file_param
    num = positive_field(p.num_to_read, "read_blob_from_file_param.num_to_read")
    if num > BUFFER:
        raise LayerError(f"read_blob_from_file_param.num_to_read is {num}; the fork reads into a buffer of "
                         f"{BUFFER} doubles (t_data[{BUFFER}])")
    batch = positive_field(p.batch_size, "read_blob_from_file_param.batch_size")
    return {"name": lp.name, "file_path": str(p.file_path), "num_to_read": num, "batch_size": batch}


def _file_is_there(lp):
    """Something is at file_path as fopen looks it up (as written, from the current folder); a stat, no read."""
    path = str(lp.read_blob_from_file_param.file_path)
    return bool(path) and os.path.exists(path)


def read_blob_values(lp):
    """The num_to_read numbers the fork's forward reads from file_path, or None where no file is there.
    A file that is there but gives fewer numbers (the fork's row would hold t_data's stale values), is
    not a regular file, or holds them past MAX_FILE_BYTES is a LayerError."""
    attrs = _read_blob_fields(lp)
    what = f"read_blob_from_file_param.file_path '{attrs['file_path']}'"
    if not attrs["file_path"]:
        return None
    values = read_text_numbers(attrs["file_path"], "%lf", MAX_FILE_BYTES, what, LayerError, attrs["num_to_read"])
    if values is None:
        return None
    if len(values) < attrs["num_to_read"]:
        raise LayerError(f"{what}: fscanf reads {len(values)} numbers from it, num_to_read is "
                         f"{attrs['num_to_read']} (the fork's row would keep stale buffer values)")
    return values


@register_layer("ReadBlobFromFile")
class ReadBlobFromFileInput(Layer):
    """Nothing at file_path (the fork's fopen would fail): a graph input (batch_size, num_to_read) to feed."""
    is_data = True
    reading_note = ("ReadBlobFromFile: nothing is at its file_path here (looked up as fopen does: as written, "
                    "from the current folder), so its top is a graph input (batch_size, num_to_read) to feed "
                    "with the file's values in every row")

    def parse(self, lp):
        return _read_blob_fields(lp)

    def infer(self, attrs, in_shapes):
        return [(attrs["batch_size"], attrs["num_to_read"])]


@claim_layers("ReadBlobFromFile", _file_is_there)
class ReadBlobFromFileConstant(Layer):
    """Something is at file_path: the top is its first num_to_read numbers, in every row (or a LayerError)."""

    def parse(self, lp):
        attrs = _read_blob_fields(lp)
        values = read_blob_values(lp)
        if values is None:      # gone between the claim and here
            raise LayerError(f"read_blob_from_file_param.file_path '{attrs['file_path']}' is no longer there")
        attrs["values"] = [float(v) for v in values]
        return attrs

    def infer(self, attrs, in_shapes):
        return [(attrs["batch_size"], attrs["num_to_read"])]

    def _row(self, attrs):
        return np.array(attrs["values"], np.float64).astype(np.float32).reshape(1, -1)

    def forward(self, attrs, params):
        module = ConstantRows(attrs["batch_size"], attrs["num_to_read"])
        module.row.copy_(torch.from_numpy(self._row(attrs)))
        return module()

    def onnx(self, ctx, node):
        a = node.attrs
        ctx.add_node("Expand", [ctx.const(self._row(a), node.name + "_row"),
                                ctx.i64([a["batch_size"], a["num_to_read"]])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.module(f"{emit.helper(TORCH_CONSTANT_ROWS)}({a['batch_size']}, {a['num_to_read']})")
        emit.buffer("row", self._row(a))
        return f"{m}()"


# ---- ReadBlobFromFileIndexing --------------------------------------------------------------------

@register_layer("ReadBlobFromFileIndexing")
class ReadBlobFromFileIndexing(Layer):
    onnx_refusal = "ReadBlobFromFileIndexing reads a text file per sample, named by a run-time index value"
    def parse(self, lp):
        need_blobs(lp, "ReadBlobFromFileIndexing", 1, 1, "index")
        p = lp.read_blob_from_file_indexing_param
        num = positive_field(p.num_to_read, "read_blob_from_file_indexing_param.num_to_read")
        if num > BUFFER:
            raise LayerError(f"read_blob_from_file_indexing_param.num_to_read is {num}; the fork reads into a "
                             f"buffer of {BUFFER} doubles")
        return {"prefix": str(p.file_prefix), "num_to_read": num}

    def infer(self, attrs, in_shapes):
        if not len(in_shapes[0]):
            raise LayerError("ReadBlobFromFileIndexing: the index bottom has no axes (the fork reads shape()[0])")
        return [(int(in_shapes[0][0]), attrs["num_to_read"])]

    def cannot_run(self, attrs, in_shapes):
        return (f"reads each sample's row from the text file '{attrs['prefix']}<index>.txt' named by the index "
                f"bottom's run-time value; caffeq runs no file reads inside a net")

    def forward(self, attrs, params, index):
        self.refuse_if_cannot_run("ReadBlobFromFileIndexing", attrs, [tuple(index.shape)], LayerError)


# ---- the vector operations -------------------------------------------------------------------------

class _Vector(Layer):
    def infer(self, attrs, in_shapes):
        return [_vector_shape(in_shapes[0], self.types[0])]


@register_layer("ScaleVector")
class ScaleVector(_Vector):
    def parse(self, lp):
        need_blobs(lp, "ScaleVector", range(1, AT_LEAST), 1)
        return {"factor": float(np.float32(lp.scale_vector_param.scale_factor))}

    def forward(self, attrs, params, x, *ignored):
        return scale_vector(x, attrs["factor"])

    def onnx(self, ctx, node):
        rows = _onnx_rows(ctx, node.inputs[0], ctx.shape(node.inputs[0]), node.name)
        ctx.add_node("Mul", [rows, ctx.f32(node.attrs["factor"])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_VECTOR)
        return f"scale_vector({emit.inputs[0]}, {emit.lit(node.attrs['factor'])})"


@register_layer("AddVectorByConstant")
class AddVectorByConstant(_Vector):
    def parse(self, lp):
        need_blobs(lp, "AddVectorByConstant", 1, 1)
        return {"value": float(np.float32(lp.add_vector_by_constant_param.add_value))}

    def forward(self, attrs, params, x):
        return add_vector_by_constant(x, attrs["value"])

    def onnx(self, ctx, node):
        rows = _onnx_rows(ctx, node.inputs[0], ctx.shape(node.inputs[0]), node.name)
        ctx.add_node("Add", [rows, ctx.f32(node.attrs["value"])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_VECTOR)
        return f"add_vector_by_constant({emit.inputs[0]}, {emit.lit(node.attrs['value'])})"


@register_layer("TwoVectorSubtract")
class TwoVectorSubtract(_Vector):
    def parse(self, lp):
        need_blobs(lp, "TwoVectorSubtract", 2, 1, "a, b")
        return {"take_abs": bool(lp.universal_param.take_abs)}

    def infer(self, attrs, in_shapes):
        n, d = _vector_shape(in_shapes[0], "TwoVectorSubtract")
        count = int(np.prod(in_shapes[1], dtype=np.int64))
        if count < n * d:
            raise LayerError(f"TwoVectorSubtract reads {n} x {d} values of its second bottom (the first's first two "
                             f"axes); it has {count} ({list(in_shapes[1])})")
        return [(n, d)]

    def forward(self, attrs, params, a, b):
        return two_vector_subtract(a, b, attrs["take_abs"])

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        n, d = int(shape[0]), int(shape[1])
        a = _onnx_rows(ctx, node.inputs[0], shape, node.name + "_a")
        b_shape = ctx.shape(node.inputs[1])
        b = node.inputs[1] if tuple(b_shape) == (n, d) else _onnx_rows(ctx, node.inputs[1], (n, d, 1), node.name + "_b")
        if not node.attrs["take_abs"]:
            ctx.add_node("Sub", [a, b], [node.outputs[0]], name=node.name)
            return
        diff = ctx.op("Sub", [a, b], "diff", name=node.name)
        ctx.add_node("Abs", [diff], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_VECTOR)
        return f"two_vector_subtract({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['take_abs']})"


@register_layer("IdentityVectorNoGradient")
class IdentityVectorNoGradient(_Vector):
    def parse(self, lp):
        need_blobs(lp, "IdentityVectorNoGradient", 1, 1)
        return {}

    def forward(self, attrs, params, x):
        return identity_vector(x)

    def onnx(self, ctx, node):
        rows = _onnx_rows(ctx, node.inputs[0], ctx.shape(node.inputs[0]), node.name)
        ctx.add_node("Identity", [rows], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_VECTOR)
        return f"identity_vector({emit.inputs[0]})"


class WritesFilesOnly(Layer):
    """A layer with no tops that only writes files in its fork (OutputBlob; 3dhuman's skeleton pictures):
    caffeq writes none, so it computes nothing."""

    def infer(self, attrs, in_shapes):
        return []

    def forward(self, attrs, params, *inputs):
        return ()

    def onnx(self, ctx, node):
        return None

    def pytorch_source(self, node, emit):
        return []


@register_layer("OutputBlob")
class OutputBlob(WritesFilesOnly):
    """Writes its first bottom's rows to text files; no tops.  caffeq writes none."""
    reading_note = ("OutputBlob writes each sample's row of its first bottom to '<save_path><blob_name>_<index>.txt'; "
                    "caffeq writes no files: the layer computes nothing here")

    def parse(self, lp):
        need_blobs(lp, "OutputBlob", 2, 0, "blob, index")
        p = lp.output_blob_param
        return {"save_path": str(p.save_path), "blob_name": str(p.blob_name)}


__all__ = ["AddVectorByConstant", "IdentityVectorNoGradient", "OutputBlob", "ReadBlobFromFileConstant",
           "ReadBlobFromFileIndexing", "ReadBlobFromFileInput", "ScaleVector", "TwoVectorSubtract"]
