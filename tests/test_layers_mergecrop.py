"""naibaf7/caffe's MergeCrop (2996015 mergecrop_layer.cu), against a numpy loop over the kernel's own
indexing (top index -> batch, bottom, channel, position; bottom 1 read at position + (size_1 - size_0) / 2);
in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def merge_crop_ref(a, b, stack, use_a=True, use_b=True):
    """MergeCropForward, one top element at a time."""
    n, ca = a.shape[:2]
    cb = b.shape[1]
    spatial_a, spatial_b = a.shape[2:], b.shape[2:]
    pad = [(sb - sa) // 2 for sa, sb in zip(spatial_a, spatial_b)]
    size_a = int(np.prod(spatial_a))
    channels = ca + cb if stack else ca
    top = np.zeros((n, channels) + spatial_a, np.float32)
    flat_a, flat_b, flat_top = a.reshape(-1), b.reshape(-1), top.reshape(-1)
    for index in range(top.size):
        pos = np.unravel_index(index % size_a, spatial_a)
        batch = index // (channels * size_a)
        shifted = tuple(p + d for p, d in zip(pos, pad))
        if stack:
            bottom = ((index - batch * channels * size_a) // (ca * size_a)) % 2
            if bottom == 0:
                ch = (index // size_a) % ca
                flat_top[index] = flat_a[np.ravel_multi_index((batch, ch) + pos, a.shape)] if use_a else 0
            else:
                ch = (index // size_a) % cb
                flat_top[index] = flat_b[np.ravel_multi_index((batch, ch) + shifted, b.shape)] if use_b else 0
        else:
            ch = (index // size_a) % ca
            value = flat_a[np.ravel_multi_index((batch, ch) + pos, a.shape)] if use_a else 0
            if use_b:
                value += flat_b[np.ravel_multi_index((batch, ch) + shifted, b.shape)]
            flat_top[index] = value
    return top


def layer(param=""):
    return f'layer {{ name: "m" type: "MergeCrop" bottom: "a" bottom: "b" top: "o" mergecrop_param {{ {param} }} }}'


@pytest.mark.parametrize("a_shape, b_shape, param", [
    ((2, 3, 4, 5), (2, 3, 9, 8), ""),                               # odd and even margins: offsets 2 and 1
    ((2, 3, 2, 3, 4), (2, 3, 5, 3, 7), "operation: STACK"),         # 3-D, one axis uncropped
    ((1, 4, 3, 3), (1, 2, 6, 4), ""),                               # one item, channels 2 dividing 4
    ((2, 4, 3, 5), (2, 2, 6, 6), ""),                               # two items: the kernel mixes channels
    ((3, 2, 3, 4), (3, 5, 4, 7), "forward: true forward: true"),    # C_b > 2 C_a: some of b's part reads a
    ((2, 5, 3, 4), (2, 3, 5, 4), "forward: false forward: true"),
    ((2, 3, 4, 5), (2, 3, 7, 6), "operation: ADD"),
    ((2, 3, 4, 5), (2, 3, 7, 6), "operation: ADD forward: true forward: false"),
    ((2, 3, 4, 5), (2, 3, 7, 6), "forward: false forward: true"),
])
def test_mergecrop_follows_the_kernel(a_shape, b_shape, param, tmp_path):
    a = rng(1).standard_normal(a_shape).astype(np.float32)
    b = rng(2).standard_normal(b_shape).astype(np.float32)
    model = load_from_text(net(layer(param), inputs={"a": a_shape, "b": b_shape}))
    flags = [not f.startswith("false") for f in param.split("forward: ")[1:]] + [True, True]
    want = merge_crop_ref(a, b, "ADD" not in param, flags[0], flags[1])
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"a": a, "b": b}, {"o": want}, tmp_path)


@pytest.mark.parametrize("a_shape, b_shape, param, msg", [
    ((2, 3, 6, 6), (2, 3, 4, 6), "", "it is smaller"),
    ((2, 3, 4, 4), (2, 2, 6, 6), "operation: ADD", "equal channels"),
    ((2, 3, 4, 4), (1, 3, 6, 6), "", "same batch"),
])
def test_mergecrop_refuses_what_the_kernel_cannot_read(a_shape, b_shape, param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(layer(param), inputs={"a": a_shape, "b": b_shape}))


def test_uneven_channel_counts_really_mix_channels():
    """Why the kernel's reading is followed rather than a concatenation: with 4 + 2 channels over two
    items they differ (the second item reads other channels)."""
    a = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 2, 2)
    b = 100 + np.arange(2 * 2 * 4, dtype=np.float32).reshape(2, 2, 2, 2)
    concat = np.concatenate([a, b], 1)
    assert not np.array_equal(merge_crop_ref(a, b, True), concat)
    assert np.array_equal(merge_crop_ref(a[:1], b[:1], True), concat[:1])   # one item: it is one
