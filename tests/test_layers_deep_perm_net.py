"""rfsantacruz/deep-perm-net d3dccc3: SinkhornNorm and PermMatrix (caffeq/layers/deep_perm_net.py).

The SinkhornNorm references are numpy versions of sinkhorn_norm_layer.cu's Forward_gpu, step by step in
float32: RowNorm_GPU (add lambda, row sums as gemv against ones, powx -1, dgmm scaling of each row) and
ColNorm_GPU (Trans_Tensor_kernel's index map, the same row steps on the transposed items, the map back).
PermMatrix is a random sampler: its tops are the net's inputs, which the tests feed.
"""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


def trans_tensor(flat, n, rows, cols):
    """Trans_Tensor_kernel(num, rows, cols, in, out): out[b*rows*cols + r*cols + c] = in[b*rows*cols + c*cols + r]."""
    out = np.zeros(n * rows * cols, np.float32)
    bs = rows * cols
    for i in range(n * bs):
        b, r, c = i // bs, (i % bs) // cols, (i % bs) % cols
        out[i] = flat[b * bs + c * cols + r]
    return out


def scale_lines(buf, lines, length):
    """gemv against ones (each line's sum), caffe_gpu_powx(sum, -1), dgmm: each line times its reciprocal."""
    m = buf.reshape(lines, length)
    sums = m.sum(axis=1, dtype=np.float32)
    inv = np.power(sums, np.float32(-1.0)).astype(np.float32)
    return (m * inv[:, None]).astype(np.float32).reshape(-1)


def sinkhorn_ref(x, rows, cols, lam, row_step):
    n = x.shape[0]
    flat = x.astype(np.float32).reshape(-1)
    if row_step:   # RowNorm_GPU: output = input + lambda, rows scaled
        return scale_lines(flat + np.float32(lam), n * rows, cols).reshape(x.shape)
    buf = trans_tensor(flat, n, rows, cols) + np.float32(lam)   # ColNorm_GPU
    buf = scale_lines(buf, n * cols, rows)
    return trans_tensor(buf, n, cols, rows).reshape(x.shape)


def sinkhorn_text(name, bottom, top, rows, cols, row_step, lam=0.01):
    return (f'layer {{ name: "{name}" type: "SinkhornNorm" bottom: "{bottom}" top: "{top}" sinkhorn_norm_param {{ '
            f'is_row_step: {str(row_step).lower()} num_rows: {rows} num_cols: {cols} lambda: {lam} }} }}')


@pytest.mark.parametrize("rows,cols,row_step,lam", [
    (3, 5, True, 0.01),     # a non-square row step
    (5, 3, True, 0.001),
    (4, 4, False, 0.01),    # the column step (square, as the fork's transpose needs)
    (7, 7, False, 0.25),
])
def test_sinkhorn_step_matches_the_forks_gpu_forward(rows, cols, row_step, lam, tmp_path):
    x = rng(rows * 10 + cols).uniform(0.0, 1.0, (2, rows * cols)).astype(np.float32)
    model = load_from_text(net(sinkhorn_text("s", "x", "o", rows, cols, row_step, lam), inputs={"x": x.shape}))
    ref = sinkhorn_ref(x, rows, cols, lam, row_step)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-7, rtol=2e-6)
    m = ref.reshape(2, rows, cols)
    assert np.allclose(m.sum(axis=2 if row_step else 1), 1.0, atol=1e-6)


def test_softmax_row_then_column_step_as_the_test_nets(tmp_path):
    """The corpus nets' head: Softmax over 81 scores, then a row step and a column step on 9 x 9."""
    x = rng(3).normal(0.0, 3.0, (3, 81)).astype(np.float32)
    text = net('layer { name: "norm" type: "Softmax" bottom: "x" top: "s" }',
               sinkhorn_text("r", "s", "r1", 9, 9, True), sinkhorn_text("c", "r1", "o", 9, 9, False),
               inputs={"x": x.shape})
    model = load_from_text(text)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    soft = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    ref = sinkhorn_ref(sinkhorn_ref(soft, 9, 9, 0.01, True), 9, 9, 0.01, False)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape,rows,cols,row_step,needle", [
    ((2, 81), 4, 4, True, "81 values per item are not sinkhorn_norm_param.num_rows * num_cols = 4 * 4"),
    ((2, 3, 5), 3, 5, True, "needs a 2-axis bottom"),
    ((2, 15), 3, 5, False, "needs num_rows == num_cols"),
    ((2, 0), 0, 4, True, "num_rows must be >= 1"),
])
def test_sinkhorn_bad_configurations_are_one_line_errors(shape, rows, cols, row_step, needle):
    with pytest.raises(LayerError) as e:
        load_from_text(net(sinkhorn_text("s", "x", "o", rows, cols, row_step), inputs={"x": shape}))
    assert needle in str(e.value) and "\n" not in str(e.value)


def perm_text(grid, patch, tops=None):
    tops = tops if tops is not None else [f"p{k}" for k in range(grid * grid)] + ["labels"]
    return ('layer { name: "perm_gen" type: "PermMatrix" bottom: "data" bottom: "lab" '
            + " ".join(f'top: "{t}"' for t in tops)
            + f" perm_matrix_param {{ grid_size: {grid} patch_size: {patch} }} }}")


def test_perm_matrix_tops_are_the_nets_inputs(tmp_path):
    """grid 2, patch 3: four (N, 3, 3, 3) patches and a (N, 16) permutation matrix, fed by the user; a
    per-patch InnerProduct, Concat and a 4 x 4 Sinkhorn head run on them."""
    g, p, n = 2, 3, 2
    layers = [perm_text(g, p)]
    for k in range(g * g):
        layers.append(f'layer {{ name: "fc{k}" type: "InnerProduct" bottom: "p{k}" top: "f{k}" '
                      f'inner_product_param {{ num_output: 5 }} }}')
    layers.append('layer { name: "cat" type: "Concat" bottom: "f0" bottom: "f1" bottom: "f2" bottom: "f3" top: "c" }')
    layers.append('layer { name: "fc8" type: "InnerProduct" bottom: "c" top: "fc8" '
                  'inner_product_param { num_output: 16 } }')
    layers.append('layer { name: "sm" type: "Softmax" bottom: "fc8" top: "s" }')
    layers.append(sinkhorn_text("r", "s", "r1", 4, 4, True))
    layers.append(sinkhorn_text("cl", "r1", "prob", 4, 4, False))
    text = net(*layers, inputs={"data": (n, 3, 7, 9), "lab": (n, 1)})
    model = load_from_text(text, random_weights=True, batch=n, outputs=["prob"])
    names = [model.graph.tensors[i].blob for i in model.graph.inputs]
    assert names == ["p0", "p1", "p2", "p3"]
    assert model.blob_shapes["p0"] == (n, 3, p, p) and model.blob_shapes["labels"] == (n, 16)
    r = rng(5)
    feeds = {f"p{k}": r.uniform(-1, 1, (n, 3, p, p)).astype(np.float32) for k in range(4)}
    feats = []
    for k in range(4):
        w, b = (np.asarray(a) for a in model.params[f"fc{k}"])
        feats.append(feeds[f"p{k}"].reshape(n, -1).astype(np.float64) @ w.T.astype(np.float64) + b)
    w, b = (np.asarray(a) for a in model.params["fc8"])
    z = np.concatenate(feats, axis=1) @ w.T.astype(np.float64) + b
    e = np.exp(z - z.max(axis=1, keepdims=True))
    soft = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    ref = sinkhorn_ref(sinkhorn_ref(soft, 4, 4, 0.01, True), 4, 4, 0.01, False)
    check_everywhere(model, feeds, {"prob": ref}, tmp_path, atol=1e-5, rtol=1e-4)


def test_perm_matrix_default_batch_and_given_shapes():
    text = net(perm_text(3, 4), 'layer { name: "cat" type: "Concat" bottom: "p0" bottom: "p8" top: "c" }',
               inputs={"data": (4, 3, 13, 13), "lab": (4, 1)})
    model = load_from_text(text, outputs=["c"])
    assert model.blob_shapes["c"] == (1, 6, 4, 4) and model.blob_shapes["labels"] == (1, 81)
    model = load_from_text(text, outputs=["c"], input_shapes={"p0": (3, 3, 4, 4)})
    assert model.blob_shapes["c"] == (3, 6, 4, 4) and model.blob_shapes["labels"] == (3, 81)
    with pytest.raises(LayerError, match=r"top 'p0' is \[3, 3, 4, 4\]"):
        load_from_text(text, outputs=["c"], input_shapes={"p0": (3, 3, 5, 4)})


@pytest.mark.parametrize("grid,tops,needle", [
    (2, ["a", "b", "c", "labels"], "PermMatrix takes"),           # grid_size^2 + 1 tops
    (0, ["labels"], "perm_matrix_param.grid_size must be >= 1"),
])
def test_perm_matrix_bad_parameters_are_one_line_errors(grid, tops, needle):
    text = net(perm_text(grid, 3, tops), inputs={"data": (1, 3, 9, 9), "lab": (1, 1)})
    with pytest.raises(LayerError) as e:
        load_from_text(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,outputs", [("test_grid3", ["prob"]), ("train_val_grid3", ["fc8_c1"])])
def test_corpus_grid3_nets_run_on_fed_patches(name, outputs):
    model = load(CORPUS / f"rfsantacruz__deep-perm-net__models__{name}.prototxt", random_weights=True, batch=1,
                 outputs=outputs)
    assert [model.graph.tensors[i].blob for i in model.graph.inputs] == [f"data_{k}" for k in range(9)]
    r = rng(7)
    out = model.run({f"data_{k}": r.uniform(-128, 128, (1, 3, 64, 64)).astype(np.float32) for k in range(9)})
    m = out[outputs[0]].reshape(9, 9)
    assert np.allclose(m.sum(axis=0), 1.0, atol=1e-5)   # the column step comes last


@pytest.mark.parametrize("name", ["test_grid2", "train_val_grid2"])
def test_corpus_grid2_nets_are_refused_as_the_fork_refuses_them(name):
    """fc8 has 81 outputs (the 3 x 3 nets'), the Sinkhorn steps 4 x 4: the fork's Reshape CHECK fails too."""
    with pytest.raises(LayerError, match="81 values per item are not sinkhorn_norm_param.num_rows"):
        load(CORPUS / f"rfsantacruz__deep-perm-net__models__{name}.prototxt", random_weights=True)
