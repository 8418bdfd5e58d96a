"""Files of quantized models: .caffeq, .caffemodel and ONNX round trips, and their sizes."""
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, Case

import caffeq
from caffeq.errors import CaffeqError, ParseError
from caffeq.io.container import (
    FORMAT_VERSION,
    read_safetensors,
    save_caffeq,
)
from caffeq.io.writer import net_to_text, write_model_caffemodel
from caffeq.model import load_from_text
from caffeq.quant import quantize

TARGETS = ["fp32", "fp16", "int8", "binary"]
ROUND_TRIP_CASES = ["conv_basic", "deconv_group_nobias", "inner_product_axis2_transpose", "net_lenet",
                    "net_resnet_mini", "net_mobilenet_block", "prelu_shared"]


def _quantized(name, target):
    case = Case(FIXTURES / name)
    return case, quantize(case.load(), target, keep="none")


def _same_outputs(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ---- .caffeq -------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ROUND_TRIP_CASES)
def test_caffeq_round_trip_is_bit_identical(tmp_path, name, target):
    case, q = _quantized(name, target)
    path = tmp_path / "m.caffeq"
    save_caffeq(q, path)
    back = caffeq.load(str(path))
    _same_outputs(q.run(case.inputs), back.run(case.inputs))
    assert back.quantization == q.quantization
    for a, b in zip(q.graph.nodes, back.graph.nodes):
        assert a.name == b.name
        for x, y in zip(a.blobs or [], b.blobs or []):
            np.testing.assert_array_equal(x, y)
        qa, qb = a.quant, b.quant
        assert set(qa) == set(qb), a.name
        for i in qa:
            assert (qa[i].scheme, qa[i].axis, qa[i].groups) == (qb[i].scheme, qb[i].axis, qb[i].groups)
            np.testing.assert_array_equal(qa[i].codes, qb[i].codes)
    if q.quant_report is not None:
        assert back.quant_report.to_dict() == json.loads(json.dumps(q.quant_report.to_dict()))


def test_caffeq_is_plain_safetensors_with_documented_metadata(tmp_path):
    from safetensors import safe_open
    _, q = _quantized("deconv_group_nobias", "binary")
    path = tmp_path / "m.caffeq"
    save_caffeq(q, path)
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        keys = set(f.keys())
        signs = f.get_tensor("up.0.signs")
        alpha = f.get_tensor("up.0.alpha")
    assert meta["format"] == "caffeq" and meta["format_version"] == str(FORMAT_VERSION)
    assert 'name: "deconv_group_nobias"' in meta["prototxt"]
    layout = json.loads(meta["layout"])
    assert layout[0]["scheme"] == "binary" and layout[0]["groups"] == 2 and layout[0]["axis"] == 1
    assert keys == {"up.0.signs", "up.0.alpha"}
    assert signs.dtype == np.uint8 and alpha.dtype == np.float32 and alpha.shape == (4,)
    qb = q.graph.node("up").quant[0]
    np.testing.assert_array_equal(np.unpackbits(signs, count=qb.size, bitorder="little"),
                                  (qb.codes.reshape(-1) > 0).astype(np.uint8))
    np.testing.assert_array_equal(alpha, qb.scale)


def test_caffeq_weights_are_memory_mapped(tmp_path):
    case = Case(FIXTURES / "net_lenet")
    m = case.load()
    path = tmp_path / "m.caffeq"
    save_caffeq(m, path)
    _, tensors = read_safetensors(str(path))
    w = tensors["ip1.0"]
    assert not w.flags.owndata and not w.flags.writeable
    assert w.ctypes.data % 4 == 0                         # aligned for zero-copy use
    back = caffeq.load(str(path))
    assert not back.graph.node("ip1").blobs[0].flags.owndata
    np.testing.assert_array_equal(back.graph.node("ip1").blobs[0], m.graph.node("ip1").blobs[0])


def test_caffeq_batch_override(tmp_path):
    case, q = _quantized("net_lenet", "int8")
    path = tmp_path / "m.caffeq"
    save_caffeq(q, path)
    m = caffeq.load(str(path), batch=5)
    assert m.inputs["data"][0] == 5
    x = np.concatenate([case.inputs["data"]] * 2)[:5]
    # another batch size may take another BLAS path: equal within float rounding
    np.testing.assert_allclose(m.run({"data": x})["prob"][:3], q.run(case.inputs)["prob"], rtol=1e-5, atol=1e-7)


def _rewrite_meta(path, **changes):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"].update(changes)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_caffeq_refuses_newer_versions_and_other_files(tmp_path):
    _, q = _quantized("conv_basic", "binary")
    path = tmp_path / "m.caffeq"
    save_caffeq(q, path)
    _rewrite_meta(path, format_version=str(FORMAT_VERSION + 1))
    with pytest.raises(ParseError, match="newer"):
        caffeq.load(str(path))
    _rewrite_meta(path, format="something", format_version="1")
    with pytest.raises(ParseError, match="not a .caffeq model"):
        caffeq.load(str(path))
    bad = tmp_path / "junk.caffeq"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ParseError, match="junk.caffeq"):
        caffeq.load(str(bad))
    save_caffeq(q, path)
    data = path.read_bytes()
    (tmp_path / "cut.caffeq").write_bytes(data[:-10])
    with pytest.raises(ParseError, match="truncated"):
        caffeq.load(str(tmp_path / "cut.caffeq"))


def test_caffeq_save_is_atomic(tmp_path, monkeypatch):
    from caffeq.io import container
    _, q = _quantized("conv_basic", "int8")
    node = q.graph.node("conv")
    node.blobs = [node.blobs[0], None]
    with pytest.raises(CaffeqError, match="conv"):
        save_caffeq(q, tmp_path / "m.caffeq")
    _, q = _quantized("conv_basic", "int8")
    real = container.write_safetensors

    def failing(path, tensors, meta):
        real(path, tensors, meta)
        raise OSError("disk full")
    monkeypatch.setattr(container, "write_safetensors", failing)
    with pytest.raises(OSError):
        save_caffeq(q, tmp_path / "m.caffeq")
    assert os.listdir(tmp_path) == []


# ---- .caffemodel --------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ["net_lenet", "net_resnet_mini", "deconv_group_nobias",
                                  "inner_product_axis2_transpose"])
def test_caffemodel_round_trip_is_bit_identical(tmp_path, name, target):
    case, q = _quantized(name, target)
    (tmp_path / "q.prototxt").write_text(net_to_text(q.net))
    write_model_caffemodel(q, tmp_path / "q.caffemodel")
    back = caffeq.load(str(tmp_path / "q.prototxt"), str(tmp_path / "q.caffemodel"))
    # exact: the float file folds BatchNorm into its (dequantized) weights where the quantized
    # model keeps a Scale after its int8/binary weights, which rounds differently
    _same_outputs(q.run(case.inputs, exact=True), back.run(case.inputs, exact=True))


# ---- ONNX: onnxruntime equals torch for every target ----------------------------------------------

ONNX_CASES = ["conv_basic", "conv_group_dilation", "deconv_basic", "deconv_group_nobias", "inner_product_4d",
              "inner_product_axis2_transpose", "net_lenet", "net_resnet_mini", "net_mobilenet_block",
              "net_inception_block", "batchnorm_scale", "prelu_channel"]


def _ort_run(path, inputs):
    import onnxruntime as ort
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outs = s.run(None, {i.name: inputs[i.name] for i in s.get_inputs()})
    return {o.name: v for o, v in zip(s.get_outputs(), outs)}


def _assert_rel(ours, ref, rtol, what):
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(ours.astype(np.float64) - ref).max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * {scale:.3g}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnxruntime_equals_torch(tmp_path, name, target):
    case, q = _quantized(name, target)
    ref = q.run(case.inputs)
    for opset, batch, optimize in ((21, "dynamic", True), (13, 1, False)):
        path = tmp_path / f"m{opset}.onnx"
        q.export_onnx(str(path), opset=opset, batch=batch, optimize=optimize)
        inputs = case.inputs if batch == "dynamic" else {k: v[:1] for k, v in case.inputs.items()}
        want = ref if batch == "dynamic" else q.run(inputs)
        got = _ort_run(path, inputs)
        for out in q.outputs:
            _assert_rel(got[out], want[out], 1e-5, f"{name} {target} opset {opset}: {out}")


def _initializer_types(path):
    import onnx
    m = onnx.load(str(path))
    return {t.name: t.data_type for t in m.graph.initializer}, [n.op_type for n in m.graph.node]


def test_onnx_stores_each_precision_compactly(tmp_path):
    import onnx
    T = onnx.TensorProto
    case = Case(FIXTURES / "net_lenet")
    m = case.load()
    for target, dtype, op in (("fp16", T.FLOAT16, "Cast"), ("int8", T.INT8, "DequantizeLinear"),
                              ("binary", T.UINT8, "BitShift")):
        q = quantize(m, target, keep="none")
        path = tmp_path / f"{target}.onnx"
        q.export_onnx(str(path))
        types, ops = _initializer_types(path)
        assert types[f"ip1.weight_{ {'fp16': 'fp16', 'int8': 'int8', 'binary': 'signbits'}[target]}"] == dtype
        assert op in ops
        # no float copy of a quantized weight
        assert not any(t == T.FLOAT and n in ("ip1.weight", "conv2.weight") for n, t in types.items())


# ---- sizes on a real-sized layer -------------------------------------------------------------------

BIG = """name: "big"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 512 dim: 6 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 512 kernel_size: 3 pad: 1 } }
"""


@pytest.fixture(scope="module")
def big():
    return load_from_text(BIG, random_weights=True, seed=7)


def test_compression_ratios_on_512x512x3x3(big, tmp_path):
    fp32_bytes = 512 * 512 * 9 * 4
    b = quantize(big, "binary", keep="none")
    row = {r.name: r for r in b.quant_report.layers}["conv"]
    assert row.bytes_before == fp32_bytes + 512 * 4
    # .caffeq: bit-packed signs + per-channel alpha <= 1/30 of the fp32 bytes
    save_caffeq(b, tmp_path / "b.caffeq")
    _, tensors = read_safetensors(str(tmp_path / "b.caffeq"))
    binarized = tensors["conv.0.signs"].nbytes + tensors["conv.0.alpha"].nbytes
    assert binarized <= fp32_bytes / 30
    assert os.path.getsize(tmp_path / "b.caffeq") <= fp32_bytes / 30 + 512 * 4 + 8192
    # ONNX: binarized tensors at most 1/8 (bit-packed: ~1/32)
    b.export_onnx(str(tmp_path / "b.onnx"))
    assert os.path.getsize(tmp_path / "b.onnx") <= fp32_bytes / 8
    assert os.path.getsize(tmp_path / "b.onnx") <= fp32_bytes / 30 + 512 * 4 + 8192
    # fp16 about half, int8 about a quarter
    for target, frac in (("fp16", 0.5), ("int8", 0.25)):
        q = quantize(big, target)
        q.export_onnx(str(tmp_path / f"{target}.onnx"))
        size = os.path.getsize(tmp_path / f"{target}.onnx")
        assert fp32_bytes * frac <= size <= fp32_bytes * frac * 1.01 + 8192, (target, size)
        save_caffeq(q, tmp_path / f"{target}.caffeq")
        assert os.path.getsize(tmp_path / f"{target}.caffeq") <= fp32_bytes * frac * 1.01 + 8192


def test_train_val_caffeq_written_elsewhere_finds_its_data(tmp_path):
    """A .caffeq of a train_val net resolves its LMDB relative to the original prototxt's folder."""
    import caffeq
    from caffeq.io.container import save_caffeq
    digits = Path(__file__).resolve().parents[1] / "examples" / "digits"
    model = caffeq.load(str(digits / "train_val.prototxt"), str(digits / "model.caffemodel"))
    out = tmp_path / "tv.caffeq"
    save_caffeq(model, str(out))
    back = caffeq.load(str(out))
    assert back.inputs == model.inputs
