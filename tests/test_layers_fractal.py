"""FractalNet's FractalJoin and CNNDesignPatterns' FreezeDropPath (caffeq/layers/fractal.py) at TEST, against
references written here from fractal_join_layer.cpp (0 + m x0 + m x1 ..., m = float(1 / n), in float32) and
freeze_drop_path.cpp (the plain sum), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def saxpy_ref(xs, m):
    y = np.zeros_like(xs[0], F32)
    for x in xs:
        y = F32(m) * x + y
    return y


@pytest.mark.parametrize("kind, n, ratios", [("FractalJoin", 2, "drop_path_ratio: 0.15"), ("FractalJoin", 3, ""),
                                             ("FractalJoin", 4, "drop_path_ratio: 0 " * 4), ("FreezeDropPath", 2, ""),
                                             ("FreezeDropPath", 3, "")])
def test_join_averages_and_freeze_drop_path_sums(kind, n, ratios, tmp_path):
    r = rng(5)
    xs = [r.standard_normal((2, 3, 4, 5)).astype(F32) for _ in range(n)]
    names = [f"x{i}" for i in range(n)]
    param = f"fractal_join_param {{ {ratios} }}" if kind == "FractalJoin" else \
        "freeze_drop_path_param { num_iter_per_cycle: 0 interval_type: 0 }"
    text = net(f'layer {{ name: "j" type: "{kind}" {" ".join(f"bottom: {b!r}" for b in names)} top: "y" {param} }}',
               inputs={b: x.shape for b, x in zip(names, xs)})
    model = load_from_text(text.replace("'", '"'))
    m = F32(1.0 / n) if kind == "FractalJoin" else F32(1)
    ref = saxpy_ref(xs, m)
    if kind == "FractalJoin":
        np.testing.assert_allclose(ref, np.mean(xs, axis=0), rtol=1e-6, atol=1e-6)
    check_everywhere(model, dict(zip(names, xs)), {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_fractal_join_checks_its_ratios_and_shapes():
    two = {"a": (1, 2, 3, 3), "b": (1, 2, 3, 3)}
    with pytest.raises(LayerError, match="gives 3 drop_path_ratio for 2 bottoms"):
        load_from_text(net('layer { name: "j" type: "FractalJoin" bottom: "a" bottom: "b" top: "y" '
                           'fractal_join_param { drop_path_ratio: 0.1 drop_path_ratio: 0.1 drop_path_ratio: 0.1 } }',
                           inputs=two))
    with pytest.raises(LayerError, match="bottoms of one shape"):
        load_from_text(net('layer { name: "j" type: "FreezeDropPath" bottom: "a" bottom: "b" top: "y" }',
                           inputs={"a": (1, 2, 3, 3), "b": (1, 2, 3, 4)}))
