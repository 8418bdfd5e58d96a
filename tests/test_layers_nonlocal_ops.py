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


# ---- mozpp/mscnn-master's MatMul (matmul_layer.cpp: caffe_cpu_gemm_batch over (B, rows, flattened cols)) ----

def flat_matmul_ref(a, b, a_t, b_t):
    a = a.reshape(a.shape[0], a.shape[1], -1).astype(np.float64)
    b = b.reshape(b.shape[0], b.shape[1], -1).astype(np.float64)
    return np.stack([(x.T if a_t else x) @ (y.T if b_t else y) for x, y in zip(a, b)])


@pytest.mark.parametrize("a_shape, b_shape, param, top", [
    # the non-local block: theta (B, C', H, W) as C' x HW, transposed, times phi's C' x HW
    ((2, 3, 4, 5), (2, 3, 4, 5), "transpose_a: true transpose_b: false", (2, 20, 20)),
    ((2, 3, 4, 5), (2, 6, 20), "transpose_b: true", (2, 3, 6)),      # transpose_b's default is true
    ((2, 3, 4, 5), (2, 6, 20), "", (2, 3, 6)),
    ((1, 4, 7), (1, 7, 2), "transpose_b: false", (1, 4, 2)),
])
def test_matmul_flattens_each_item_and_multiplies(a_shape, b_shape, param, top, tmp_path):
    g = rng(17)
    a, b = g.standard_normal(a_shape).astype(F), g.standard_normal(b_shape).astype(F)
    model = load_from_text(net(f'layer {{ name: "m" type: "MatMul" bottom: "a" bottom: "b" top: "o" '
                               f'matmul_param {{ {param} }} }}', inputs={"a": a_shape, "b": b_shape}))
    assert model.blob_shapes["o"] == top
    a_t, b_t = "transpose_a: true" in param, "transpose_b: false" not in param
    check_everywhere(model, {"a": a, "b": b}, {"o": flat_matmul_ref(a, b, a_t, b_t)}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("a_shape, b_shape, msg", [
    ((2, 3), (2, 3, 4), "at least 3 axes"),
    ((2, 3, 4), (3, 5, 4), "batches differ, 2 and 3"),
    ((2, 3, 4), (2, 5, 3), r"as 3x4 and B \[2, 5, 3\] as 3x5 .* do not multiply"),
])
def test_matmul_refusals(a_shape, b_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net('layer { name: "m" type: "MatMul" bottom: "a" bottom: "b" top: "o" }',
                           inputs={"a": a_shape, "b": b_shape}))
