"""dicecco1/fpga_caffe (caffeq/layers/fpga_caffe.py): HWCN and its Pad against their Forward_cpu loops, in torch,
onnxruntime and model.py; the FPGA layers sized as the fork's Reshape gives them and refused when run."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def hwcn_ref(x, convert_to):
    """hwcn_layer.cpp's index loops."""
    if x.ndim == 2:
        return x.T.copy()
    if convert_to:
        n, c, h, w = x.shape
        out = np.empty(h * w * c * n, F32)
        for i in np.ndindex(x.shape):
            nn, cc, hh, ww = i
            out[((hh * w + ww) * c + cc) * n + nn] = x[i]
        return out.reshape(h, w, c, n)
    h, w, c, n = x.shape
    out = np.empty(n * c * h * w, F32)
    for i in np.ndindex(x.shape):
        hh, ww, cc, nn = i
        out[((nn * c + cc) * h + hh) * w + ww] = x[i]
    return out.reshape(n, c, h, w)


def pad_ref(x, axis, top_len, pad):
    """pad_layer.cpp: top zeroed, then each bottom position copied where its index on `axis` is below dim_."""
    top_shape = list(x.shape)
    top_shape[axis] = top_len
    out = np.zeros(top_shape, F32)
    dim = x.shape[axis] if pad else top_len
    for i in np.ndindex(x.shape):
        if i[axis] < dim and i[axis] < top_len:
            out[i] = x[i]
    return out


def test_hwcn_and_pad(tmp_path):
    """fpga_nin's input path: XCLProgram, HWCN, Pad of C (axis 2) to 4, then its unpad and HWCN back."""
    x = rng(101).standard_normal((2, 3, 4, 5)).astype(F32)
    layers = ('layer { name: "xcl" type: "XCLProgram" xcl_param { xcl_name: "k.xclbin" kernel_name: "k" } }\n'
              'layer { name: "to" type: "HWCN" bottom: "x" top: "h" hwcn_param { convert_to: true } }\n'
              'layer { name: "pad" type: "Pad" bottom: "h" top: "p" pad_param { pad: true axis: 2 pad_to: 4 } }\n'
              'layer { name: "pad16" type: "Pad" bottom: "h" top: "p16" pad_param { axis: 3 } }\n'
              'layer { name: "unpad" type: "Pad" bottom: "p" top: "u" pad_param { pad: false axis: 2 pad_to: 3 } }\n'
              'layer { name: "back" type: "HWCN" bottom: "u" top: "y" hwcn_param { convert_to: false } }')
    model = load_from_text(net(layers, inputs={"x": x.shape}), outputs=["p", "p16", "y"])
    h = hwcn_ref(x, True)
    p = pad_ref(h, 2, 4, True)
    assert p.shape == (4, 5, 4, 2) and (p[:, :, 3] == 0).all()
    refs = {"p": p, "p16": pad_ref(h, 3, 16, True), "y": hwcn_ref(pad_ref(p, 2, 3, False), False)}
    np.testing.assert_array_equal(refs["y"], x)
    check_everywhere(model, {"x": x}, refs, tmp_path)
    two = load_from_text(net('layer { name: "t" type: "HWCN" bottom: "x" top: "y" }', inputs={"x": (3, 7)}))
    v = rng(102).standard_normal((3, 7)).astype(F32)
    check_everywhere(two, {"x": v}, {"y": hwcn_ref(v, True)}, tmp_path)
    with pytest.raises(LayerError, match="pad_to 2 is below axis 2's 3"):
        load_from_text(net(layers.replace("pad_to: 4", "pad_to: 2"), inputs={"x": x.shape}))


def test_fpga_layers_are_sized_and_refused():
    """fpga_alexnet's shapes: conv1 11 x 11 stride 4 on (227, 227, 4, 16), pool 3 stride 2 by ceil, fc6 on the
    HWCN map, fc7 on (K, N)."""
    layers = ('layer { name: "cpfp" type: "CPFPConversion" bottom: "h" top: "q" }\n'
              'layer { name: "conv1" type: "OCLCRHWCN" bottom: "q" top: "c1" convolution_param { num_output: 96 '
              'kernel_size: 11 stride: 4 } cr_param { relu: 1 num_cu: 16 num_pe: 4 } }\n'
              'layer { name: "pool1" type: "OCLPoolingHWCN" bottom: "c1" top: "p1" pooling_param { pool: MAX '
              'kernel_size: 3 stride: 2 } }\n'
              'layer { name: "fc6" type: "OCLHWCNInnerProduct" bottom: "p1" top: "f6" inner_product_param { '
              'num_output: 64 } }\n'
              'layer { name: "fc7" type: "OCLHWCNInnerProduct" bottom: "f6" top: "f7" inner_product_param { '
              'num_output: 10 } }')
    model = load_from_text(net(layers, inputs={"h": (227, 227, 4, 16)}), random_weights=True)
    shapes = model.blob_shapes
    assert shapes["c1"] == (55, 55, 96, 16) and shapes["p1"] == (27, 27, 96, 16)
    assert shapes["f6"] == (64, 16) and shapes["f7"] == (10, 16)
    blobs = {n.name: [b.shape for b in n.blobs] for n in model.layers if n.blobs}
    assert blobs["conv1"] == [(96, 4, 11, 11), (96,)] and blobs["fc6"] == [(64, 27 * 27 * 96), (64,)]
    with pytest.raises(CaffeqError, match="12-bit codes packed two per float"):
        model.run({"h": np.zeros((227, 227, 4, 16), F32)})
