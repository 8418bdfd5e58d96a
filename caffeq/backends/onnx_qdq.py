"""QDQ int8 ONNX files through onnxruntime: writing them, running them, and checking their kernels.

onnxruntime is an optional dependency (extra `verify`): static int8 needs it at conversion time,
for calibration and for writing the QuantizeLinear/DequantizeLinear graph with its
`quantize_static`.  The file it writes is plain ONNX (opset >= 13); onnxruntime's graph
optimizer fuses each DequantizeLinear -> Conv -> QuantizeLinear group into one QLinearConv
(likewise Gemm/MatMul, Add, pooling), so the arithmetic runs on int8 kernels.
"""
import contextlib
import io
import json
import logging
import os
import re
import tempfile

import numpy as np

from ..quant.base import QuantizeError

# what gets int8 inputs and outputs; Softmax, Sigmoid and the like keep float inputs
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul", "Add", "MaxPool", "AveragePool", "GlobalAveragePool",
                 "Concat", "Relu", "Clip")
# kernels onnxruntime runs on int8 data once the QDQ groups are fused
INTEGER_KERNELS = ("QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm",
                   "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "FusedConvInteger")


def require_onnxruntime():
    """onnxruntime and its quantization package, or one clear error saying how to get them."""
    try:
        import onnxruntime
        from onnxruntime import quantization
    except ImportError:
        raise QuantizeError("static int8 (--calibrate) needs onnxruntime: pip install 'caffeq[verify]' "
                            "(or pip install onnxruntime)") from None
    return onnxruntime, quantization


def session(path, threads=None, profile_prefix=None, spin=True):
    """An onnxruntime CPU session with every graph optimization (the QDQ fusions) enabled.

    spin=False: idle pool threads sleep instead of spinning (shared, oversubscribed machines)."""
    ort, _ = require_onnxruntime()
    opts = ort.SessionOptions()
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return ort.InferenceSession(os.fspath(path), opts, providers=["CPUExecutionProvider"])


def input_names(path):
    return [i.name for i in session(path).get_inputs()]


class ArrayReader:
    """onnxruntime's CalibrationDataReader over in-memory arrays: batches of `batch` items."""

    def __init__(self, arrays, batch=8):
        self.arrays = arrays
        self.n = next(iter(arrays.values())).shape[0] if arrays else 0
        self.batch = max(1, int(batch))
        self.start, self.end, self.pos = 0, self.n, 0

    def get_next(self):
        if self.pos >= self.end:
            return None
        stop = min(self.pos + self.batch, self.end)
        feed = {k: np.ascontiguousarray(v[self.pos:stop], dtype=np.float32) for k, v in self.arrays.items()}
        self.pos = stop
        return feed

    def __iter__(self):
        return self

    def __next__(self):
        item = self.get_next()
        if item is None:
            raise StopIteration
        return item

    def __len__(self):
        return self.n

    def set_range(self, start_index, end_index):
        self.start, self.end, self.pos = start_index, min(end_index, self.n), start_index

    def rewind(self):
        self.start, self.end, self.pos = 0, self.n, 0


@contextlib.contextmanager
def _quiet():
    """onnxruntime's quantization tools print progress and log advice; caffeq reports itself."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def _methods(q):
    return {"minmax": q.CalibrationMethod.MinMax, "percentile": q.CalibrationMethod.Percentile,
            "entropy": q.CalibrationMethod.Entropy}


def calibrate_ranges(fp32_path, arrays, method, cache_path, batch=8):
    """Activation ranges of `method` ("minmax", "percentile", "entropy") on `arrays`, saved to
    cache_path (onnxruntime's JSON calibration cache) for write_qdq."""
    _, q = require_onnxruntime()
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data
    methods = _methods(q)
    extra = {"symmetric": False, "percentile": 99.999}
    with tempfile.TemporaryDirectory(prefix="caffeq-calib-") as tmp, _quiet():
        calibrator = create_calibrator(fp32_path, list(QUANTIZED_OPS),
                                       augmented_model_path=os.path.join(tmp, "augmented.onnx"),
                                       calibrate_method=methods[method], extra_options=extra)
        # a few batches per call: each call reduces what it saw (min/max merged, histograms added),
        # so memory stays bounded by `chunk` batches of every activation.  The histogram methods
        # stack a call's batches, so a short last batch gets a call of its own.
        reader = ArrayReader(arrays, batch)
        full = reader.n - reader.n % reader.batch
        bounds = [(s, min(s + 4 * reader.batch, full)) for s in range(0, full, 4 * reader.batch)]
        if full < reader.n:
            bounds.append((full, reader.n))
        for start, stop in bounds:
            reader.set_range(start, stop)
            calibrator.collect_data(reader)
        ranges = calibrator.compute_data()
        del calibrator
    save_tensors_data(ranges, cache_path)


def write_qdq(fp32_path, out_path, cache_path, method, exclude=(), reduce_range=False):
    """The QDQ int8 file: per-channel symmetric int8 weights, per-tensor uint8 activations with the
    ranges in cache_path; nodes in `exclude` stay float."""
    _, q = require_onnxruntime()
    with _quiet():
        _quantize_static(q, fp32_path, out_path, cache_path, method, exclude, reduce_range)


def _quantize_static(q, fp32_path, out_path, cache_path, method, exclude, reduce_range):
    q.quantize_static(
        fp32_path, out_path, None, quant_format=q.QuantFormat.QDQ, per_channel=True,
        reduce_range=reduce_range, activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
        op_types_to_quantize=list(QUANTIZED_OPS), nodes_to_exclude=list(exclude) or None,
        calibration_cache_path=cache_path, calibrate_method=_methods(q)[method],
        extra_options={"WeightSymmetric": True, "ActivationSymmetric": False})


def kernel_ops(path, feed, threads=1):
    """{node name: op type} of the kernels onnxruntime ran for `path`, read from its profiler
    (after its graph optimizations: fused QDQ groups show as QLinearConv, QGemm, ...)."""
    with tempfile.TemporaryDirectory(prefix="caffeq-prof-") as tmp:
        sess = session(path, threads=threads, profile_prefix=os.path.join(tmp, "ort"))
        sess.run(None, feed)
        trace = sess.end_profiling()
        with open(trace) as f:
            events = json.load(f)
    ops = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") == "Node" and "op_name" in args and e.get("name", "").endswith("_kernel_time"):
            # layout transforms rename fused nodes "conv1_token_2": keep the layer's name
            ops[re.sub(r"_token_\d+$", "", e["name"][:-len("_kernel_time")])] = args["op_name"]
    return ops


class OrtModule:
    """A session that stands in for a torch module in caffeq's evaluation loop: tensors in (in the
    base model's input order), {blob: tensor} out for the wanted blobs the file computes."""

    def __init__(self, path, base_inputs, input_shapes, wanted, threads=None):
        import torch
        self._torch = torch
        self.path = os.fspath(path)
        self.sess = session(path, threads=threads)
        self.input_names = list(base_inputs)
        self.input_shapes = dict(input_shapes)
        self.onnx_inputs = {i.name for i in self.sess.get_inputs()}
        have = {o.name for o in self.sess.get_outputs()}
        self.output_names = [w for w in wanted if w in have]

    def __call__(self, *tensors):
        feed = {name: t.detach().float().cpu().numpy() for name, t in zip(self.input_names, tensors)
                if name in self.onnx_inputs}
        out = self.sess.run(self.output_names, feed)
        dev = tensors[0].device if tensors else "cpu"     # back where the other targets' outputs live
        return {k: self._torch.from_numpy(np.asarray(v)).to(dev) for k, v in zip(self.output_names, out)}

    def eval(self):
        return self


def sums_to_adds(path):
    """Rewrite every n-input Sum (Eltwise SUM without coefficients) as a chain of 2-input Adds, in
    place: onnxruntime's quantizer and kernels have QLinearAdd but no int8 Sum, and a float Sum
    between int8 convolutions costs a dequantize and a quantize of both full tensors."""
    import onnx
    m = onnx.load(path)
    nodes = []
    changed = 0
    for n in m.graph.node:
        if n.op_type != "Sum" or len(n.input) < 2:
            nodes.append(n)
            continue
        changed += 1
        acc = n.input[0]
        for k, term in enumerate(n.input[1:], 1):
            last = k == len(n.input) - 1
            out = n.output[0] if last else f"{n.output[0]}/add{k}"
            nodes.append(onnx.helper.make_node("Add", [acc, term], [out], name=n.name if last else f"{n.name}/add{k}"))
            acc = out
    if changed:
        del m.graph.node[:]
        m.graph.node.extend(nodes)
        onnx.save(m, path)
    return changed


def add_outputs(path, names):
    """Make the tensors `names` graph outputs of the ONNX file at path (in place), when they exist."""
    import onnx
    m = onnx.load(path)
    have = {o.name for o in m.graph.output}
    produced = {t for n in m.graph.node for t in n.output}
    added = []
    for name in names:
        if name not in have and name in produced:
            m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            added.append(name)
    if added:
        onnx.save(m, path)
    return added


__all__ = ["INTEGER_KERNELS", "QUANTIZED_OPS", "ArrayReader", "OrtModule", "add_outputs", "calibrate_ranges",
           "kernel_ops", "require_onnxruntime", "session", "sums_to_adds", "write_qdq"]
