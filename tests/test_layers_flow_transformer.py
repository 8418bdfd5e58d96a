"""FlowTransformer (bryanyzhu/Hidden-Two-Stream f7f684a, flow_transformer_layer.cu
FlowTransformerForwardGPU): the reference below is the kernel's loop, in float32 as it computes, checked
in torch, onnxruntime and the generated model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32
LAYER = 'layer { name: "warp" type: "FlowTransformer" bottom: "img" bottom: "flow" top: "o" }'


def flow_transformer_ref(image, flow):
    """V[i, j, s, t] as the fork's kernel sums it: x (row) = s + flow 1, y (column) = t + flow 0."""
    n_, c_, h, w = image.shape
    out = np.zeros(image.shape, f32)
    for i in range(n_):
        for j in range(c_):
            pic = image[i, j]
            for s in range(h):
                for t in range(w):
                    x = f32(s) + flow[i, 1, s, t]
                    y = f32(t) + flow[i, 0, s, t]
                    v = f32(0)
                    fx, fy = np.floor(x), np.floor(y)
                    m0 = 0 if np.isnan(fx) else int(fx)        # CUDA's (int) NaN is 0
                    n0 = 0 if np.isnan(fy) else int(fy)
                    m1 = 0 if np.isnan(fx) else int(fx + f32(1))
                    n1 = 0 if np.isnan(fy) else int(fy + f32(1))
                    taps = ((m0, n0, f32(1) - (x - f32(m0)), f32(1) - (y - f32(n0))),
                            (m1, n0, f32(1) - (f32(m1) - x), f32(1) - (y - f32(n0))),
                            (m0, n1, f32(1) - (x - f32(m0)), f32(1) - (f32(n1) - y)),
                            (m1, n1, f32(1) - (f32(m1) - x), f32(1) - (f32(n1) - y)))
                    for m, n, wm, wn in taps:
                        if 0 <= m < h and 0 <= n < w:
                            v = f32(v + f32(wm * wn) * pic[m, n])
                    out[i, j, s, t] = v
    return out


def inputs(seed, shape=(2, 3, 5, 7)):
    g = rng(seed)
    image = g.standard_normal(shape).astype(f32)
    n, _, h, w = shape
    flow = g.uniform(-4, 4, (n, 2, h, w)).astype(f32)
    flow[0, 0, 0, :4] = [0.0, 5.0, 5.5, 6.25]     # columns: on a pixel, the last column, between, past it
    flow[0, 1, 1, :3] = [3.0, 3.5, -1.5]           # rows: the last row, past it, above the first
    flow[1, :, 2, 2] = [-2.0, -2.0]                # exactly the corner (0, 0)
    flow[1, :, 4, 6] = [-6.5, -4.25]               # inside only by its far taps
    return image, flow


def load(image, flow):
    return load_from_text(net(LAYER, inputs={"img": image.shape, "flow": flow.shape}))


def test_flow_transformer_matches_the_kernel_in_every_backend(tmp_path):
    image, flow = inputs(3)
    ref = flow_transformer_ref(image, flow)
    zeros = np.all(ref == 0, axis=1)
    assert 0 < np.count_nonzero(zeros) < zeros.size     # some pixels read nothing but zero padding
    model = load(image, flow)
    assert model.graph.tensors["o"].shape == image.shape
    check_everywhere(model, {"img": image, "flow": flow}, {"o": ref}, tmp_path, exact=True)


def test_flow_transformer_axes_are_column_then_row(tmp_path):
    """A whole-pixel flow shifts the image: channel 0 by columns, channel 1 by rows, zeros come in."""
    image = rng(4).standard_normal((1, 2, 4, 6)).astype(f32)
    flow = np.zeros((1, 2, 4, 6), f32)
    flow[0, 0] = 2.0
    flow[0, 1] = -1.0
    want = np.zeros_like(image)
    want[:, :, 1:, :4] = image[:, :, :3, 2:]
    check_everywhere(load(image, flow), {"img": image, "flow": flow}, {"o": want}, tmp_path, opsets=(None,),
                     exact=True)


def test_flow_transformer_nan_flow_reads_tap_zero_as_cuda_does(tmp_path):
    g = rng(5)
    image = g.standard_normal((1, 2, 3, 4)).astype(f32)
    flow = g.uniform(-0.9, 0.9, (1, 2, 3, 4)).astype(f32)
    flow[0, 1, 1, 2] = np.nan          # the row NaN: taps (0, k0), (0, k1) inside, NaN weights
    flow[0, 0, 2, 0] = np.nan          # the column NaN
    flow[0, :, 0, 0] = [np.nan, 9.0]   # column NaN, row far outside: nothing read
    ref = flow_transformer_ref(image, flow)
    assert np.isnan(ref[0, :, 1, 2]).all() and np.isnan(ref[0, :, 2, 0]).all() and (ref[0, :, 0, 0] == 0).all()
    model = load(image, flow)
    feeds = {"img": image, "flow": flow}
    for backend, got in {"torch": model.run(feeds, exact=True)["o"], "onnx": onnx_outputs(model, feeds, tmp_path)["o"],
                         "model.py": model_py_outputs(model, feeds, tmp_path)["o"]}.items():
        np.testing.assert_array_equal(got, ref, err_msg=backend)


@pytest.mark.parametrize("flow_shape, msg", [
    ((2, 3, 5, 7), r"flow \(bottom 1\) must be \(N, 2, H, W\)"),
    ((2, 2, 5, 6), r"flow \(bottom 1\) must be \(N, 2, H, W\)"),
    ((1, 2, 5, 7), r"flow \(bottom 1\) must be \(N, 2, H, W\)"),
    ((2, 2, 35), r"4-axis flow"),
])
def test_flow_transformer_checks_the_flow_shape(flow_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(LAYER, inputs={"img": (2, 3, 5, 7), "flow": flow_shape}))


@pytest.mark.parametrize("layer, msg", [
    ('layer { name: "warp" type: "FlowTransformer" bottom: "img" top: "o" }', "takes 2 bottoms"),
    ('layer { name: "warp" type: "FlowTransformer" bottom: "img" bottom: "flow" top: "img" }', "in-place"),
])
def test_flow_transformer_checks_its_blobs(layer, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(layer, inputs={"img": (2, 3, 5, 7), "flow": (2, 2, 5, 7)}))
