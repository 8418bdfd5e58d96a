"""xw-hu/CF-Caffe's non-local block layers (477b79f matrix_multiplication*_layer.cpp Forward_cpu,
matrix_transposition_layer.cu, reshape_advance_layer.cpp): references from their gemm calls and index
formulas in float64, on asymmetric shapes."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def matmul_ref(x, y, x_t, y_t):
    """caffe_cpu_gemm per item b over max(Bx, By), a 2-axis operand's data shared (stride 0)."""
    xs = x[None] if x.ndim == 2 else x
    ys = y[None] if y.ndim == 2 else y
    b = max(len(xs), len(ys))
    out = []
    for i in range(b):
        a = xs[i if len(xs) > 1 else 0].astype(np.float64)
        c = ys[i if len(ys) > 1 else 0].astype(np.float64)
        out.append((a.T if x_t else a) @ (c.T if y_t else c))
    z = np.stack(out)
    return (z[0] if x.ndim == 2 and y.ndim == 2 else z).astype(F)


CASES = [("MatrixMultiplication", (2, 3, 4), (2, 4, 5)), ("MatrixMultiplication", (3, 4), (2, 4, 5)),
         ("MatrixMultiplication", (2, 3, 4), (4, 5)), ("MatrixMultiplication", (3, 4), (4, 5)),
         ("MatrixMultiplicationYt", (2, 3, 4), (2, 5, 4)), ("MatrixMultiplicationXt", (2, 4, 3), (2, 4, 5))]


@pytest.mark.parametrize("kind, xs, ys", CASES)
def test_matrix_products(kind, xs, ys, tmp_path):
    model = load_from_text(net(f'layer {{ name: "m" type: "{kind}" bottom: "x" bottom: "y" top: "z" }}',
                               inputs={"x": xs, "y": ys}))
    x, y = rng(1).standard_normal(xs).astype(F), rng(2).standard_normal(ys).astype(F)
    want = matmul_ref(x, y, kind.endswith("Xt"), kind.endswith("Yt"))
    assert model.blob_shapes["z"] == want.shape
    check_everywhere(model, {"x": x, "y": y}, {"z": want}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("xs, ys, msg", [((2, 3, 4), (3, 4, 5), "batch 2 and Y's 3 differ"),
                                         ((2, 3, 4), (2, 5, 5), "incompatible dimensions"),
                                         ((2, 3, 4, 1), (2, 4, 5), "multiplies")])
def test_matrix_product_refusals(xs, ys, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net('layer { name: "m" type: "MatrixMultiplication" bottom: "x" bottom: "y" top: "z" }',
                           inputs={"x": xs, "y": ys}))


def test_transposition_and_reshape_advance(tmp_path):
    # the non-local block's tail: (B, HW, C) transposed to (B, C, HW), then back to a map whose last axis
    # is the reference's (dim -2) and whose third is inferred
    text = net('layer { name: "t" type: "MatrixTransposition" bottom: "x" top: "t" }',
               'layer { name: "r" type: "ReshapeAdvance" bottom: "t" bottom: "ref" top: "r" '
               'reshape_param { shape { dim: 0 dim: 0 dim: -1 dim: -2 } } }',
               inputs={"x": (2, 12, 3), "ref": (1, 7, 4, 6)})
    model = load_from_text(text, outputs=["t", "r"])
    x = rng(3).standard_normal((2, 12, 3)).astype(F)
    t = np.empty((2, 3, 12), F)
    for i, v in np.ndenumerate(x):          # MatrixTForward: top[(n N + x_hw) M + x_c] = bottom[index]
        n, c, hw = i
        t[n, hw, c] = v
    assert model.blob_shapes["r"] == (2, 3, 2, 6)
    check_everywhere(model, {"x": x, "ref": np.zeros((1, 7, 4, 6), F)}, {"t": t, "r": t.reshape(2, 3, 2, 6)},
                     tmp_path)


def test_reshape_advance_refuses_a_missing_reference_axis():
    with pytest.raises(LayerError, match=r"dim\[3\] is -2, but bottom 1 \[4, 6\] has no axis 3"):
        load_from_text(net('layer { name: "r" type: "ReshapeAdvance" bottom: "x" bottom: "ref" top: "r" '
                           'reshape_param { shape { dim: 0 dim: 0 dim: -1 dim: -2 } } }',
                           inputs={"x": (2, 3, 12), "ref": (4, 6)}))
