"""apple35932003/IVS-Caffe 54bb78d ConvolutionIVS / FcIVS: numpy loops written from the fork's Forward_cpu,
forward_cpu_IVS (folding adds), forward_cpu_IVS_serial and Trim2FixedPoint_cpu / Trim2FixedPoint_overflow_cpu
(base_IVS_layer.cpp), compared in torch, onnxruntime (LAYER_BY_LAYER) and model.py."""
import numpy as np
import pytest
from c_reference import c_round
from conftest import REPO, assert_close, check_everywhere, model_py_outputs, net, rng
from google.protobuf import text_format

import caffeq
from caffeq.errors import CaffeqError, ExportError
from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"
FILES = ["apple35932003__IVS-Caffe__caffe-fast-rcnn__examples__mnist__lenet_elb_BAC.prototxt",
         "apple35932003__IVS-Caffe__caffe-fast-rcnn__examples__mnist__lenet_quantized_IVS.prototxt"]


# ---- the fork's loops ----------------------------------------------------------------------------

def trim_ref(data, bw, fl, overflow=False):
    """Trim2FixedPoint_cpu (TRIM_AT_THRESH) or Trim2FixedPoint_overflow_cpu, NEAREST, in float32."""
    max_data = f32((2.0 ** (bw - 1) - 1) * 2.0 ** -fl)
    min_data = f32(-(2.0 ** (bw - 1)) * 2.0 ** -fl)
    temp_pow = f32(2.0 ** -fl)
    out = np.array(data, np.float32, copy=True, order="C")
    flat = out.reshape(-1)
    for i in range(flat.size):
        v = flat[i]
        if overflow:
            while v > max_data:
                v = f32(v - f32(f32(max_data - min_data) + f32(1)))
            while v < min_data:
                v = f32(v + f32(f32(max_data - min_data) + f32(1)))
        else:
            v = max(min(v, max_data), min_data) if not np.isnan(v) else v
        v = f32(v / temp_pow)
        v = f32(c_round(v))
        flat[i] = f32(v * temp_pow)
    return out


def fold_ref(rows, add):
    """forward_cpu_IVS's matrix accumulation on rows (K, S) in place; add = (bw, fl, overflow)."""
    left = rows.shape[0]
    while left != 1:
        half = left // 2
        for j in range(half):
            rows[j] = rows[j] + rows[j + half]
        rows[:half] = trim_ref(rows[:half], *add)
        if left % 2 == 1:
            rows[0] = rows[0] + rows[left - 1]
            rows[0] = trim_ref(rows[0], *add)
        left //= 2
    return rows[0]


def serial_ref(rows, add):
    for k in range(1, rows.shape[0]):
        rows[0] = rows[0] + rows[k]
        rows[0] = trim_ref(rows[0], *add)
    return rows[0]


def im2col_ref(x, kh, kw, stride, pad):
    c, h, w = x.shape
    oh, ow = (h + 2 * pad[0] - kh) // stride[0] + 1, (w + 2 * pad[1] - kw) // stride[1] + 1
    col = np.zeros((c * kh * kw, oh * ow), np.float32)
    r = 0
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                for y in range(oh):
                    for z in range(ow):
                        yy, zz = y * stride[0] - pad[0] + i, z * stride[1] - pad[1] + j
                        if 0 <= yy < h and 0 <= zz < w:
                            col[r, y * ow + z] = x[ch, yy, zz]
                r += 1
    return col, oh, ow


def q_of(q, what, overflow):
    return (q[f"bw_{what}"], q[f"fl_{what}"], overflow)


def conv_ivs_ref(x, w, b, stride, pad, q, mode, overflow=False):
    """ConvolutionIVSLayer::Forward_cpu, TEST: the bottom, weights and bias trimmed, then per sample and output
    channel the products trimmed and accumulated (mode 1 folding, 2 serial), the bias added, the top trimmed."""
    x = trim_ref(x, *q_of(q, "layer_in", overflow))
    w = trim_ref(w, *q_of(q, "params", overflow))
    b = None if b is None else trim_ref(b, *q_of(q, "bias", overflow))
    n, o = x.shape[0], w.shape[0]
    kh, kw = w.shape[2:]
    outs = []
    for s in range(n):
        col, oh, ow = im2col_ref(x[s], kh, kw, stride, pad)
        top = np.zeros((o, oh * ow), np.float32)
        for oc in range(o):
            if mode == 0:
                top[oc] = (w[oc].reshape(-1, 1).astype(np.float64) * col).sum(0)
            else:
                rows = trim_ref(col * w[oc].reshape(-1, 1), *q_of(q, "multiply", overflow))
                top[oc] = (fold_ref if mode == 1 else serial_ref)(rows, q_of(q, "add", overflow))
            if b is not None:
                top[oc] = top[oc] + b[oc]
        outs.append(top.reshape(o, oh, ow))
    y = np.stack(outs).astype(np.float32)
    if mode and b is not None:   # the add trim of the bias sum, only with a bias
        y = trim_ref(y, *q_of(q, "add", overflow))
    return trim_ref(y, *q_of(q, "layer_out", overflow)), x


def fc_ivs_ref(x, w, b, q, mode, overflow=False):
    """FcIVSLayer::Forward_cpu, TEST, as conv_ivs_ref over the flattened bottom (M, K)."""
    x = trim_ref(x, *q_of(q, "layer_in", overflow))
    w = trim_ref(w, *q_of(q, "params", overflow))
    b = None if b is None else trim_ref(b, *q_of(q, "bias", overflow))
    a = x.reshape(x.shape[0], -1)
    top = np.zeros((a.shape[0], w.shape[0]), np.float32)
    for m in range(a.shape[0]):
        if mode == 0:
            top[m] = (a[m].astype(np.float64) * w).sum(1)
        else:
            inter = trim_ref((a[m][:, None] * w.T).astype(np.float32), *q_of(q, "multiply", overflow))   # (K, N)
            top[m] = (fold_ref if mode == 1 else serial_ref)(inter, q_of(q, "add", overflow))
    if b is not None:
        top = top + b
        if mode:
            top = trim_ref(top, *q_of(q, "add", overflow))
    return trim_ref(top, *q_of(q, "layer_out", overflow))


# ---- the layers ---------------------------------------------------------------------------------

Q = dict(bw_layer_in=6, fl_layer_in=2, bw_params=4, fl_params=2, bw_bias=8, fl_bias=3, bw_multiply=6,
         fl_multiply=3, bw_add=7, fl_add=2, bw_layer_out=6, fl_layer_out=1)
MODES = ["LAYER_BY_LAYER", "EVERY_OPERATION", "EVERY_OPERATION_SERIAL"]


def qparam(q, mode, **extra):
    fields = dict(q, rounding_time=mode, **extra)
    return "quantization_param { " + " ".join(f"{k}: {v}" for k, v in fields.items()) + " }"


def one_layer(type_, shape, params, qtext, top="y"):
    return load_from_text(net(f'layer {{ name: "q" type: "{type_}" bottom: "x" top: "{top}" {params} {qtext} }}',
                              inputs={"x": shape}), random_weights=True)


def set_blobs(model, *blobs):
    node = next(n for n in model.layers if n.name == "q")
    node.blobs = [np.asarray(b, np.float32) for b in blobs]
    model.clear_cache()


def run_everywhere(model, feeds, refs, tmp_path, mode):
    if mode == 0:
        check_everywhere(model, feeds, refs, tmp_path)
        return
    ours = model.run(feeds)
    got = model_py_outputs(model, feeds, tmp_path)
    for k, ref in refs.items():
        assert_close(ours[k], ref, 0, 0, f"torch {k}")
        assert_close(got[k], ref, 0, 0, f"model.py {k}")
    with pytest.raises(ExportError, match="LAYER_BY_LAYER only"):
        model.export_onnx(str(tmp_path / "m.onnx"))


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("cin", [3, 2])   # K = 18 (even folds) and 12; odd rows on the way
def test_convolution_ivs(mode, cin, tmp_path):
    shape = (2, cin, 7, 6)
    params = "convolution_param { num_output: 5 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 }"
    model = one_layer("ConvolutionIVS", shape, params, qparam(Q, MODES[mode]))
    r = rng(3)
    x = (r.standard_normal(shape) * 4).astype(f32)
    x.reshape(-1)[:4] = [0.125, -0.125, 0.375, 100.0]   # ties of step 1/4 and a saturated value
    w = (r.standard_normal((5, cin, 3, 2)) * 0.7).astype(f32)
    b = (r.standard_normal(5) * 1.5).astype(f32)
    set_blobs(model, w, b)
    ref, _ = conv_ivs_ref(x, w, b, (2, 1), (1, 0), Q, mode)
    run_everywhere(model, {"x": x}, {"y": ref}, tmp_path, mode)


@pytest.mark.parametrize("mode", [1, 2])
def test_convolution_ivs_overflow_sim(mode, tmp_path):
    shape = (2, 2, 5, 4)
    model = one_layer("ConvolutionIVS", shape, "convolution_param { num_output: 3 kernel_size: 3 pad: 1 }",
                      qparam(Q, MODES[mode], overflow_behavior="OVERFLOW_SIM"))
    r = rng(5)
    x = (r.standard_normal(shape) * 6).astype(f32)
    w = (r.standard_normal((3, 2, 3, 3)) * 0.9).astype(f32)
    b = (r.standard_normal(3) * 3).astype(f32)
    set_blobs(model, w, b)
    ref, _ = conv_ivs_ref(x, w, b, (1, 1), (1, 1), Q, mode, overflow=True)
    ours = model.run({"x": x})["y"]
    assert_close(ours, ref, 0, 0, "torch")
    assert_close(model_py_outputs(model, {"x": x}, tmp_path)["y"], ref, 0, 0, "model.py")


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("shape", [(2, 3, 3, 1), (2, 7)])   # K 9 and 7: odd folds
def test_fc_ivs(mode, shape, tmp_path):
    model = one_layer("FcIVS", shape, "inner_product_param { num_output: 5 }", qparam(Q, MODES[mode]))
    r = rng(11)
    k = int(np.prod(shape[1:]))
    x = (r.standard_normal(shape) * 4).astype(f32)
    w = (r.standard_normal((5, k)) * 0.8).astype(f32)
    b = (r.standard_normal(5) * 2).astype(f32)
    set_blobs(model, w, b)
    run_everywhere(model, {"x": x}, {"y": fc_ivs_ref(x, w, b, Q, mode)}, tmp_path, mode)


def test_fc_ivs_transpose_layer_by_layer_and_no_bias(tmp_path):
    model = one_layer("FcIVS", (2, 6), "inner_product_param { num_output: 3 transpose: true bias_term: false }",
                      qparam(Q, "LAYER_BY_LAYER"))
    r = rng(2)
    x = (r.standard_normal((2, 6)) * 4).astype(f32)
    w = (r.standard_normal((6, 3)) * 0.8).astype(f32)
    set_blobs(model, w)
    ref = fc_ivs_ref(x, np.ascontiguousarray(w.T), np.zeros(3, f32), Q, 0)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_the_trimmed_bottom_is_written_back(tmp_path):
    text = net('layer { name: "q" type: "ConvolutionIVS" bottom: "x" top: "y" convolution_param { num_output: 2 '
               'kernel_size: 1 } ' + qparam(Q, "EVERY_OPERATION") + ' }\n'
               'layer { name: "s" type: "Eltwise" bottom: "x" bottom: "x" top: "z" }', inputs={"x": (2, 3, 3, 5)})
    model = load_from_text(text, random_weights=True)
    x = (rng(4).standard_normal((2, 3, 3, 5)) * 4).astype(f32)
    xq = trim_ref(x, 6, 2)
    assert_close(model.run({"x": x})["z"], xq + xq, 0, 0, "torch")


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("cin, k", [(1, 1), (2, 3)])   # K = 1: no add at all, the products only multiply-trimmed
def test_convolution_ivs_without_bias(mode, cin, k, tmp_path):
    """Without a bias the fork skips the bw/fl_add trim of the top (Forward_cpu: phase TEST && bias_term)."""
    shape = (2, cin, 5, 4)
    model = one_layer("ConvolutionIVS", shape, f"convolution_param {{ num_output: 3 kernel_size: {k} bias_term: false }}",
                      qparam(Q, MODES[mode]))
    r = rng(8)
    x = (r.standard_normal(shape) * 4).astype(f32)
    w = (r.standard_normal((3, cin, k, k)) * 0.7).astype(f32)
    set_blobs(model, w)
    ref, _ = conv_ivs_ref(x, w, None, (1, 1), (0, 0), Q, mode)
    run_everywhere(model, {"x": x}, {"y": ref}, tmp_path, mode)


@pytest.mark.parametrize("mode", [1, 2])
def test_fc_ivs_without_bias_k1(mode, tmp_path):
    model = one_layer("FcIVS", (3, 1), "inner_product_param { num_output: 4 bias_term: false }", qparam(Q, MODES[mode]))
    r = rng(9)
    x = (r.standard_normal((3, 1)) * 4).astype(f32)
    w = (r.standard_normal((4, 1)) * 0.7).astype(f32)
    set_blobs(model, w)
    run_everywhere(model, {"x": x}, {"y": fc_ivs_ref(x, w, None, Q, mode)}, tmp_path, mode)


@pytest.mark.parametrize("mode", [0, 2])
def test_fc_ivs_overflow_sim(mode, tmp_path):
    model = one_layer("FcIVS", (2, 5), "inner_product_param { num_output: 3 }",
                      qparam(Q, MODES[mode], overflow_behavior="OVERFLOW_SIM"))
    r = rng(12)
    x = (r.standard_normal((2, 5)) * 6).astype(f32)
    w = (r.standard_normal((3, 5)) * 0.9).astype(f32)
    b = (r.standard_normal(3) * 3).astype(f32)
    set_blobs(model, w, b)
    ref = fc_ivs_ref(x, w, b, Q, mode, overflow=True)
    assert_close(model.run({"x": x})["y"], ref, 0, 0, "torch")
    assert_close(model_py_outputs(model, {"x": x}, tmp_path)["y"], ref, 0, 0, "model.py")
    with pytest.raises(ExportError, match="OVERFLOW_SIM" if mode == 0 else "LAYER_BY_LAYER only"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_written_back_bottom_and_nan_everywhere(tmp_path):
    """LAYER_BY_LAYER: the trimmed bottom (NaN kept, as std::min / std::max) is what a later layer reads,
    in torch, ONNX and model.py."""
    text = net('layer { name: "q" type: "ConvolutionIVS" bottom: "x" top: "y" convolution_param { num_output: 2 '
               'kernel_size: 1 } ' + qparam(Q, "LAYER_BY_LAYER") + ' }\n'
               'layer { name: "s" type: "Eltwise" bottom: "x" bottom: "x" top: "z" }', inputs={"x": (2, 3, 3, 5)})
    model = load_from_text(text, random_weights=True)
    r = rng(6)
    x = (r.standard_normal((2, 3, 3, 5)) * 4).astype(f32)
    x.reshape(-1)[:5] = [np.nan, 1e6, -1e6, 0.125, -0.375]
    w = (r.standard_normal((2, 3, 1, 1)) * 0.7).astype(f32)
    b = (r.standard_normal(2)).astype(f32)
    set_blobs(model, w, b)
    xq = trim_ref(x, 6, 2)
    assert np.isnan(xq.reshape(-1)[0])
    ref, _ = conv_ivs_ref(x, w, b, (1, 1), (0, 0), Q, 0)
    check_everywhere(model, {"x": x}, {"z": xq + xq, "y": ref}, tmp_path)


def test_fc_ivs_first_weight_2610214_is_a_weight(tmp_path):
    """Only ConvolutionIVSLayer::Forward_cpu tests for the 2610214 statistics switch; FcIVS computes."""
    model = one_layer("FcIVS", (2, 3), "inner_product_param { num_output: 2 }",
                      qparam(dict(Q, bw_params=32, fl_params=0), "EVERY_OPERATION"))
    w = np.array([[2610214, 0.5, -1], [0.25, 1, 2]], f32)
    b = np.array([0.5, -0.25], f32)
    set_blobs(model, w, b)
    x = np.array([[0.25, 1, -2], [3, 0.5, 1]], f32)
    q = dict(Q, bw_params=32, fl_params=0)
    run_everywhere(model, {"x": x}, {"y": fc_ivs_ref(x, w, b, q, 1)}, tmp_path, 1)


@pytest.mark.parametrize("type_, params, extra, msg", [
    ("ConvolutionIVS", "convolution_param { num_output: 2 kernel_size: 1 }", "precision: MINIFLOAT",
     "leaves rounding_time unset"),
    ("FcIVS", "inner_product_param { num_output: 2 }", "rounding_time: DLA", "forward aborts"),
    ("FcIVS", "inner_product_param { num_output: 2 }", "bw_add: 0", "bw_add must be 1 to 64"),
])
def test_refusals(type_, params, extra, msg):
    with pytest.raises(LayerError, match=msg):
        one_layer(type_, (2, 4, 3, 3), params, "quantization_param { " + extra + " }")


@pytest.mark.parametrize("type_, params, extra, msg", [
    ("ConvolutionIVS", "convolution_param { num_output: 2 kernel_size: 1 }", "rounding_scheme: STOCHASTIC",
     "STOCHASTIC rounds with rand"),
    ("ConvolutionIVS", "convolution_param { num_output: 2 kernel_size: 1 group: 2 }", "", "group > 1"),
    ("FcIVS", "inner_product_param { num_output: 2 transpose: true }", "", "past the weights"),
])
def test_read_but_not_run(type_, params, extra, msg):
    model = one_layer(type_, (2, 4, 3, 3), params, "quantization_param { " + extra + " }")
    with pytest.raises(CaffeqError, match=msg):
        model.run({"x": np.zeros((2, 4, 3, 3), f32)})


def test_the_statistics_weight_is_refused():
    model = one_layer("ConvolutionIVS", (2, 1, 3, 3), "convolution_param { num_output: 1 kernel_size: 1 }",
                      "quantization_param { }")
    set_blobs(model, np.full((1, 1, 1, 1), 2610214, f32), np.zeros(1, f32))
    with pytest.raises(CaffeqError, match="statistics"):
        model.run({"x": np.zeros((2, 1, 3, 3), f32)})


# ---- the real files --------------------------------------------------------------------------------

def maxpool2(a):
    n, c, h, w = a.shape
    return a.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


@pytest.mark.parametrize("name", FILES)
def test_real_lenets_run_as_the_fork(name, tmp_path):
    """The fork's LeNets: EVERY_OPERATION (lenet_elb_BAC) and LAYER_BY_LAYER (lenet_quantized_IVS), 2-bit words."""
    path = CORPUS / name
    model = caffeq.load(path, random_weights=True, input_shapes={"data": (2, 1, 28, 28)}, outputs=["ip2"])
    layers = {lp.name: lp for lp in text_format.Parse(path.read_text(), caffe_pb2.NetParameter()).layer}
    blobs = {n.name: n.blobs for n in model.layers if n.blobs}

    def q(layer):
        p = layers[layer].quantization_param
        keys = [f"{a}_{b}" for a in ("bw", "fl") for b in ("layer_in", "params", "bias", "multiply", "add", "layer_out")]
        return {k: getattr(p, k) for k in keys}, p.rounding_time

    def conv(a, layer):
        qq, mode = q(layer)
        return conv_ivs_ref(a, *blobs[layer], (1, 1), (0, 0), qq, mode)[0]

    def fc(a, layer):
        qq, mode = q(layer)
        return fc_ivs_ref(a, *blobs[layer], qq, mode)

    x = (rng(1).random((2, 1, 28, 28)) * 2).astype(f32)
    h = maxpool2(conv(x, "conv1"))
    h = maxpool2(conv(h, "conv2"))
    h = np.maximum(fc(h, "ip1"), 0)
    ref = fc(h, "ip2")
    mode = q("ip2")[1]
    run_everywhere(model, {"data": x}, {"ip2": ref}, tmp_path, mode)
