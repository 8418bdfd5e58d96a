"""alanhuang1990/caffe-dev's SpecifiedSoftPlusConvolution: the reference is written from
specified_softplus_conv_layer.cpp's Forward_cpu (the caffe_cpu_scale / exp / add / log / scale chain on W and b,
kernels whose rule is not 1 set to 0) and Caffe's convolution in float64; compared in torch, onnxruntime and
the generated model.py, with the rule file next to the prototxt and without it."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load

f32 = np.float32


def softplus_ref(v, beta):
    return (np.log(np.exp(v.astype(f32) * f32(beta)) + f32(1)) * f32(1.0 / f32(beta))).astype(f32)


def write_net(folder, rules=None, beta=1.0, rule_text=None):
    (folder / "net.prototxt").write_text(
        'input: "x" input_dim: 2 input_dim: 3 input_dim: 6 input_dim: 5\n'
        'layers { name: "s" type: SPECIFIED_SOFT_PLUS_CONVOLUTION bottom: "x" top: "y"\n'
        '  convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 }\n'
        f'  specified_soft_plus_convolution_param {{ rule_file_path: "rules/rule.txt" beta: {beta} }} }}\n')
    if rules is not None or rule_text is not None:
        (folder / "rules").mkdir()
        text = rule_text if rule_text is not None else "\n".join(" ".join(str(v) for v in row) for row in rules)
        (folder / "rules" / "rule.txt").write_text(text + "\n")
    return folder / "net.prototxt"


@pytest.mark.parametrize("beta", [1.0, 2.5])
def test_with_the_rule_file(beta, tmp_path):
    rules = np.array([[1, 0, 1], [2, 1, 1], [1, 1, 1], [0, -1, 1]])     # only the value 1 keeps a kernel
    model = load(write_net(tmp_path, rules, beta), random_weights=True)
    r = rng(61)
    w = (r.standard_normal((4, 3, 3, 3)) * 2).astype(f32)
    b = r.standard_normal(4).astype(f32)
    node_of(model, "s").blobs = [w, b]
    model.clear_cache()
    x = r.standard_normal((2, 3, 6, 5)).astype(f32)
    kept = (rules == 1)[:, :, None, None]
    ref = conv_ref(x, np.where(kept, softplus_ref(w, beta), 0), softplus_ref(b, beta), (2, 2), (1, 1))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-6)


def test_without_the_rule_file_zero_kernels_are_masked(tmp_path):
    model = load(write_net(tmp_path), random_weights=True)
    assert any("rule file 'rules/rule.txt' not found" in w for w in model.warnings)
    r = rng(62)
    w = r.standard_normal((4, 3, 3, 3)).astype(f32)
    w[1, 2] = 0.0
    w[3, 0] = 0.0
    b = r.standard_normal(4).astype(f32)
    node_of(model, "s").blobs = [w, b]
    model.clear_cache()
    x = r.standard_normal((2, 3, 6, 5)).astype(f32)
    kept = (np.abs(w).reshape(4, 3, -1).max(2) != 0)[:, :, None, None]
    ref = conv_ref(x, np.where(kept, softplus_ref(w, 1.0), 0), softplus_ref(b, 1.0), (2, 2), (1, 1))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-6)


def test_a_rule_file_of_the_wrong_size_is_refused(tmp_path):
    with pytest.raises(LayerError, match="holds 5 integers; the layer needs num_output x channels = 4 x 3"):
        load(write_net(tmp_path, rule_text="1 1 1 1 1 x 1"), random_weights=True)


def test_the_rule_file_is_read_as_fscanf_d(tmp_path):
    # the fork's while (fscanf("%d") == 1): "0-1" is 0 then -1 (split() and int() stop there), and "1.0" is 1,
    # then a failed call that ends the reading
    from caffeq.layers.softplus_conv import read_rules
    path = tmp_path / "rule.txt"
    path.write_text("1 0 1\n2 1 1\n+1 1 1\n0-1 1\n")
    np.testing.assert_array_equal(read_rules(path, 4, 3), np.array([[1, 0, 1], [2, 1, 1], [1, 1, 1], [0, -1, 1]]) == 1)
    path.write_text("1.0 " * 12)
    with pytest.raises(LayerError, match="holds 1 integers; the layer needs num_output x channels = 4 x 3"):
        read_rules(path, 4, 3)
    path.write_text("1 " * 11 + "99999999999")
    with pytest.raises(LayerError, match=r"rule.txt: the integer at byte 22 is outside int's 32 bits") as e:
        read_rules(path, 4, 3)
    assert "\n" not in str(e.value)
