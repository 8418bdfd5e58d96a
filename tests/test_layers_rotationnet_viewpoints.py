"""kanezaki/caffe-rotationnet's MY_SOFTMAX and shubhtuls/ViewpointsAndKeypoints' MASK_OUTPUTS (caffeq/layers/
rotationnet.py, viewpoints.py) against loops written here from the forks' forwards, in torch, onnxruntime and
model.py, read from V1 files as the forks' nets are written."""
import numpy as np
import pytest
from conftest import check_everywhere, onnx_outputs, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def v1_net(inputs, *layers):
    head = "".join(f'input: "{k}" ' + "".join(f"input_dim: {d} " for d in v) for k, v in inputs.items())
    return head + "\n" + "\n".join(layers)


def grouped_softmax_ref(x, stride):
    out = np.empty(x.shape, np.float64)
    n, c = x.shape[:2]
    for i in range(n):
        for g in range(c // stride):
            block = x[i, g * stride:(g + 1) * stride].astype(np.float64)
            e = np.exp(block - block.max(axis=0))
            out[i, g * stride:(g + 1) * stride] = e / e.sum(axis=0)
    return out.astype(F)


@pytest.mark.parametrize("shape, stride", [((3, 12, 1, 1), 4), ((2, 6, 2, 3), 3)])
def test_my_softmax_normalizes_each_run_of_stride_channels(shape, stride, tmp_path):
    text = v1_net({"x": shape}, f'layers {{ name: "prob" type: MY_SOFTMAX bottom: "x" top: "o" '
                                f'my_softmax_param {{ stride: {stride} }} }}')
    model = load_from_text(text)
    x = (rng(11).standard_normal(shape) * 3).astype(F)
    check_everywhere(model, {"x": x}, {"o": grouped_softmax_ref(x, stride)}, tmp_path, atol=1e-6, rtol=1e-5)
    with pytest.raises(LayerError, match="multiple of stride 5"):
        load_from_text(text.replace(f"stride: {stride}", "stride: 5"))


def test_mask_outputs_keeps_each_samples_class_block(tmp_path):
    n, k, blocks = 4, 3, 5
    text = v1_net({"s": (n, k * blocks, 1, 1), "label": (n, 1, 1, 1)},
                  f'layers {{ name: "pred" type: MASK_OUTPUTS bottom: "s" bottom: "label" top: "o" '
                  f'mask_outputs_param {{ kernel_size: {k} }} }}')
    model = load_from_text(text)
    s = rng(12).standard_normal((n, k * blocks, 1, 1)).astype(F)
    label = np.array([0, 4, 2, 2], F).reshape(n, 1, 1, 1)
    want = np.stack([s[i, int(label[i, 0, 0, 0]) * k:(int(label[i, 0, 0, 0]) + 1) * k] for i in range(n)])
    assert model.blob_shapes["o"] == (n, k, 1, 1)
    check_everywhere(model, {"s": s, "label": label}, {"o": want}, tmp_path)
    for bad in (5, -1):
        labels = np.array([0, bad, 1, 1], F).reshape(n, 1, 1, 1)
        with pytest.raises(CaffeqError, match="a label outside the 5 blocks of 3 channels"):
            model.run({"s": s, "label": labels})
        with pytest.raises(Exception, match="GatherElements|out of bounds|index"):   # not ONNX's count from the end
            onnx_outputs(model, {"s": s, "label": labels}, tmp_path / f"bad{bad}")
