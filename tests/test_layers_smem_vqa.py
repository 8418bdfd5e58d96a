"""VisionLearningGroup/Ask_Attend_and_Answer's MatrixProd and WordSum (caffeq/layers/smem_vqa.py) against the
fork's gemms (matrix_prod_layer.cpp, word_sum_layer.cpp at 45b1d36), in torch, onnxruntime and model.py, and
its SMem-VQA nets read and run."""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, cli_process, net, node_of, ok, rng

import caffeq
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"
DEPLOY = CORPUS / "VisionLearningGroup__Ask_Attend_and_Answer__example__prediction__deploy.prototxt"
TRAIN = CORPUS / "VisionLearningGroup__Ask_Attend_and_Answer__example__train__mmnetwork.prototxt"


def word_sum_ref(x, w, bias):
    """word_sum_layer.cpp: per sample j, gemm W (K x M) . X_j (M x N), then the (K*N) bias added to every sample."""
    b, m, n = x.shape[:3]
    k = w.shape[0]
    out = np.zeros((b, k, n))
    for j in range(b):
        xj = x[j].reshape(m, n).astype(np.float64)
        for r in range(k):
            for c in range(n):
                out[j, r, c] = sum(float(w[r, i]) * xj[i, c] for i in range(m))
    if bias is not None:
        out += bias.astype(np.float64).reshape(1, k, n)
    return out.reshape((b, k) + x.shape[2:])


def matrix_prod_ref(a, b):
    """matrix_prod_layer.cpp: M, N from the second bottom; K = 1 when the first bottom's axis 0 is 1, else its
    axis 1; one gemm per matrix i of the second bottom, the first read in K*M chunks."""
    ls, m, n = b.shape[:3]
    k = 1 if a.shape[0] == 1 else a.shape[1]
    flat_a, flat_b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    top = np.zeros(ls * k * n)
    for i in range(ls):
        ai = flat_a[i * k * m:(i + 1) * k * m].reshape(k, m)
        bi = flat_b[i * m * n:(i + 1) * m * n].reshape(m, n)
        top[i * k * n:(i + 1) * k * n] = (ai @ bi).reshape(-1)
    shape = list(a.shape)
    shape[2] = n
    return top.reshape(shape)


def word_sum_layer(bottom, top, params):
    return f'layer {{ name: "{top}" type: "WordSum" bottom: "{bottom}" top: "{top}" word_sum_param {{ {params} }} }}'


def test_word_sum_with_bias_per_top_element(tmp_path):
    shape = (2, 5, 7)
    model = load_from_text(net(word_sum_layer("x", "y", "num_output: 3"), inputs={"x": shape}),
                           random_weights=True)
    node = node_of(model, "y")
    assert [tuple(b.shape) for b in node.blobs] == [(3, 5), (21,)]
    node.blobs[1] = rng(1).standard_normal(21).astype(F32)   # a bias that differs per (k, n)
    model.clear_cache()
    x = rng(2).standard_normal(shape).astype(F32)
    w, b = (np.asarray(v) for v in node.blobs)
    assert model.graph.tensors["y"].shape == (2, 3, 7)
    check_everywhere(model, {"x": x}, {"y": word_sum_ref(x, w, b)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_word_sum_without_bias_keeps_later_unit_axes(tmp_path):
    shape = (3, 4, 5, 1)
    model = load_from_text(net(word_sum_layer("x", "y", "num_output: 6 bias_term: false"), inputs={"x": shape}),
                           random_weights=True)
    node = node_of(model, "y")
    assert [tuple(b.shape) for b in node.blobs] == [(6, 4)]
    x = rng(3).standard_normal(shape).astype(F32)
    assert model.graph.tensors["y"].shape == (3, 6, 5, 1)
    check_everywhere(model, {"x": x}, {"y": word_sum_ref(x, np.asarray(node.blobs[0]), None)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_matrix_prod_batched(tmp_path):
    shapes = {"a": (2, 3, 5), "b": (2, 5, 4)}
    model = load_from_text(net('layer { name: "p" type: "MatrixProd" bottom: "a" bottom: "b" top: "p" }',
                               inputs=shapes))
    r = rng(4)
    feeds = {k: r.standard_normal(s).astype(F32) for k, s in shapes.items()}
    assert model.graph.tensors["p"].shape == (2, 3, 4)
    check_everywhere(model, feeds, {"p": matrix_prod_ref(feeds["a"], feeds["b"])}, tmp_path, atol=1e-5, rtol=1e-5)


def test_matrix_prod_first_axis_one_takes_a_matrix_per_row(tmp_path):
    shapes = {"a": (1, 3, 5), "b": (3, 5, 2)}
    model = load_from_text(net('layer { name: "p" type: "MatrixProd" bottom: "a" bottom: "b" top: "p" }',
                               inputs=shapes))
    r = rng(5)
    feeds = {k: r.standard_normal(s).astype(F32) for k, s in shapes.items()}
    ref = matrix_prod_ref(feeds["a"], feeds["b"])
    assert ref.shape == (1, 3, 2) and model.graph.tensors["p"].shape == (1, 3, 2)
    np.testing.assert_allclose(ref[0, 1], feeds["a"][0, 1].astype(np.float64) @ feeds["b"][1], rtol=1e-6)
    check_everywhere(model, feeds, {"p": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_attention_hop_word_sum_then_matrix_prod(tmp_path):
    """The SMem-VQA pattern: regions embedded by WordSum, matched against the words by MatrixProd."""
    shapes = {"regions": (2, 6, 5), "words": (2, 3, 4)}
    model = load_from_text(net(word_sum_layer("regions", "emb", "num_output: 4"),
                               'layer { name: "m" type: "MatrixProd" bottom: "words" bottom: "emb" top: "m" }',
                               inputs=shapes), random_weights=True)
    node = node_of(model, "emb")
    node.blobs[1] = rng(6).standard_normal(20).astype(F32)
    model.clear_cache()
    r = rng(7)
    feeds = {k: r.standard_normal(s).astype(F32) for k, s in shapes.items()}
    emb = word_sum_ref(feeds["regions"], np.asarray(node.blobs[0]), np.asarray(node.blobs[1]))
    ref = matrix_prod_ref(feeds["words"], emb)
    assert ref.shape == (2, 3, 5)
    check_everywhere(model, feeds, {"m": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shapes, match", [
    ({"a": (2, 3, 5), "b": (2, 4, 4)}, "axis 2 must equal"),
    ({"a": (2, 3, 5), "b": (3, 5, 4)}, "same first axis"),
    ({"a": (1, 3, 5), "b": (1, 5, 4)}, "batch of 1 with K > 1"),
    ({"a": (2, 3, 5, 2), "b": (2, 5, 4)}, "must have 3 axes"),
])
def test_matrix_prod_checks_as_the_fork(shapes, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(net('layer { name: "p" type: "MatrixProd" bottom: "a" bottom: "b" top: "p" }',
                           inputs=shapes))


def test_word_sum_bad_parameters():
    with pytest.raises(LayerError, match="word_sum_param.num_output must be >= 1"):
        load_from_text(net(word_sum_layer("x", "y", "bias_term: true"), inputs={"x": (2, 3, 4)}))
    with pytest.raises(LayerError, match="must have 3 axes"):
        load_from_text(net(word_sum_layer("x", "y", "num_output: 2"), inputs={"x": (2, 3)}))


@pytest.mark.parametrize("path", [DEPLOY, TRAIN], ids=["deploy", "train"])
def test_smem_vqa_nets_read(path):
    out = ok(cli_process("inspect", path, "--input-shape", "question=25,25"))
    assert "17,702,608 parameters" in out.splitlines()[-1]
    assert "25x1031" in out


def _softmax(v):
    e = np.exp(v - v.max())
    return e / e.sum()


def test_smem_vqa_deploy_runs_with_random_weights():
    """The deploy net's two attention hops, recomputed in numpy from its pool5 and word embeddings."""
    model = caffeq.load(str(DEPLOY), random_weights=True, input_shapes={"question": (25, 25)}, batch=2)
    r = rng(8)
    feeds = {"noise": r.standard_normal((2, 3, 256, 256)).astype(F32),
             "data": r.standard_normal((2, 3, 224, 224)).astype(F32),
             "label": r.integers(0, 1031, 2).astype(F32),
             "question": r.integers(0, 7477, (2, 25)).astype(F32)}
    out = model.run(feeds, all_blobs=True)
    blobs = {n.name: [np.asarray(b, np.float64) for b in n.blobs] for n in model.layers if n.blobs}
    pool5, words = np.asarray(out["pool5"], np.float64), np.asarray(out["embed_word"], np.float64)
    assert pool5.shape == (2, 1024, 49) and words.shape == (2, 25, 1000)

    def ws(name, x):
        w, b = blobs[name]
        return w @ x + b.reshape(w.shape[0], -1)
    for j in range(2):
        sentence = ws("SumOfWord", words[j])[0]
        g = _softmax((words[j] @ ws("embedding_A", pool5[j])).max(0))
        c = ws("embedding_C", pool5[j])
        final = c @ g + sentence
        final2 = np.maximum(ws("embedding_C2", pool5[j]) @ _softmax(final @ c) + final, 0)
        w, b = blobs["predict"]
        prob = _softmax(w @ final2 + b)
        np.testing.assert_allclose(out["prob"][j], prob, rtol=1e-4, atol=1e-7)
