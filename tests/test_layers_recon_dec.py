"""YutingZhang/caffe-recon-dec ace107b: Depooling (depooling_layer.cpp/.cu running pooling_layer.cu's
*PoolBackward kernels), SafeInv (zcaffe_gpu_safeinv) and ImageOutput, against loops written from the C++."""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, net, pool_net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
FIXTURES = REPO / "tests" / "fixtures" / "realworld"
PREFIX = "YutingZhang__caffe-recon-dec__recon-dec__"


def depool_ref(x, extra, method, k, s, p, local=False, fix=(0, 0)):
    """The GPU kernels' loops: per depooled cell, the covering windows in order (FIX: per window)."""
    n, c, h, w = x.shape
    hd, wd = (h - 1) * s[0] + k[0] - 2 * p[0], (w - 1) * s[1] + k[1] - 2 * p[1]
    top, bw = np.zeros((n, c, hd, wd), F), np.zeros((n, c, hd, wd), F)
    if method == "soft_switch":
        extra = extra.reshape(n, c, k[0] * k[1], h, w)   # the kernel's reading of the switches' memory
    for i in range(n):
        for ch in range(c):
            if method == "fix":
                for ph in range(h):
                    for pw in range(w):
                        yy, xx = ph * s[0] + fix[0], pw * s[1] + fix[1]
                        if yy < hd and xx < wd:
                            top[i, ch, yy, xx], bw[i, ch, yy, xx] = x[i, ch, ph, pw], 1
                continue
            for y in range(hd):
                for xc in range(wd):
                    g, wt = F(0), F(0)
                    yp, xp = y + p[0], xc + p[1]
                    for ph in range(0 if yp < k[0] else (yp - k[0]) // s[0] + 1, min(yp // s[0] + 1, h)):
                        for pw in range(0 if xp < k[1] else (xp - k[1]) // s[1] + 1, min(xp // s[1] + 1, w)):
                            hs, ws = ph * s[0] - p[0], pw * s[1] - p[1]
                            v = x[i, ch, ph, pw]
                            if method == "switch":
                                want = (y - hs) * k[1] + (xc - ws) if local else y * wd + xc
                                if extra[i, ch, ph, pw] == F(want):
                                    g, wt = F(g + v), F(wt + 1)
                            elif method == "ave":
                                size = (min(hs + k[0], hd + p[0]) - hs) * (min(ws + k[1], wd + p[1]) - ws)
                                g, wt = F(g + v / F(size)), F(wt + F(1) / F(size))
                            elif method == "sum":
                                g, wt = F(g + v), F(wt + 1)
                            else:
                                sw = extra[i, ch, (y - hs) * k[1] + (xc - ws), ph, pw]
                                g, wt = F(g + v * sw), F(wt + sw)
                    top[i, ch, y, xc], bw[i, ch, y, xc] = g, wt
    return top, bw


def depool_net(x_shape, params, extra_shape=None, tops=2):
    bottoms = ' bottom: "x"' + (' bottom: "m"' if extra_shape else "")
    top = ' top: "o"' + (' top: "bw"' if tops == 2 else "")
    inputs = {"x": x_shape, **({"m": extra_shape} if extra_shape else {})}
    return net(f'layer {{ name: "d" type: "Depooling"{bottoms}{top} pooling_param {{ {params} }} }}', inputs=inputs)


def max_mask(a, k, s, p):
    """The fork's MAX pooling mask (GLOBAL): h * W + w of each window's first maximum."""
    model = load_from_text(pool_net(a.shape, f"pool: MAX kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} "
                                             f"stride_w: {s[1]} pad_h: {p[0]} pad_w: {p[1]}", tops=2))
    return model.run({"x": a})["mask"]


@pytest.mark.parametrize("k, s, p", [((3, 2), (2, 1), (0, 0)), ((3, 3), (2, 2), (1, 1)), ((2, 3), (2, 3), (0, 1))])
def test_switch_from_max_pooling_mask(k, s, p, tmp_path):
    """The recon-dec nets: MAX's mask into Depooling (pool MAX, read as SWITCH), with a few mask values
    naming no cell of their window, a non-integer, a NaN and -1."""
    r = rng(1)
    x = r.standard_normal((2, 3, 5, 4)).astype(F)
    hd, wd = (5 - 1) * s[0] + k[0] - 2 * p[0], (4 - 1) * s[1] + k[1] - 2 * p[1]
    mask = max_mask(r.standard_normal((2, 3, hd, wd)).astype(F), k, s, p)
    assert mask.shape == x.shape
    mask[0, 0, 0, 0], mask[0, 1, 2, 1], mask[1, 2, 4, 3] = hd * wd - 1, 1.5, -1
    mask[1, 0, 1, 1], mask[1, 1, 0, 0] = np.nan, hd * wd + 7
    model = load_from_text(depool_net(x.shape, f"pool: MAX kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} "
                                               f"stride_w: {s[1]} pad_h: {p[0]} pad_w: {p[1]}", mask.shape))
    assert model.blob_shapes["o"] == model.blob_shapes["bw"] == (2, 3, hd, wd)
    top, bw = depool_ref(x, mask, "switch", k, s, p)
    assert bw.max() >= 1 and (bw == 0).any()
    check_everywhere(model, {"x": x, "m": mask}, {"o": top, "bw": bw}, tmp_path)


def test_switch_local_index(tmp_path):
    r = rng(2)
    x = r.standard_normal((3, 2, 4, 6)).astype(F)
    mask = r.integers(-1, 7, x.shape).astype(F)     # -1 and 6 name no cell of a 2x3 window
    model = load_from_text(depool_net(x.shape, "pool: SWITCH kernel_h: 2 kernel_w: 3 stride: 2 pad: 1 "
                                               "mask_index_type: LOCAL", x.shape))
    top, bw = depool_ref(x, mask, "switch", (2, 3), (2, 2), (1, 1), local=True)
    check_everywhere(model, {"x": x, "m": mask}, {"o": top, "bw": bw}, tmp_path)


@pytest.mark.parametrize("method, k, s, p", [("AVE", (3, 2), (2, 1), (1, 1)), ("AVE", (2, 4), (3, 2), (0, 0)),
                                             ("SUM", (3, 2), (1, 2), (1, 0))])
def test_ave_and_sum(method, k, s, p, tmp_path):
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(F)
    model = load_from_text(depool_net(x.shape, f"pool: {method} kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} "
                                               f"stride_w: {s[1]} pad_h: {p[0]} pad_w: {p[1]}"))
    top, bw = depool_ref(x, None, method.lower(), k, s, p)
    check_everywhere(model, {"x": x}, {"o": top, "bw": bw}, tmp_path)


@pytest.mark.parametrize("fields, cell", [("", (1, 1)), ("fix: 0", (0, 0)), ("fix_y: 2 fix_x: 0", (2, 0))])
def test_fix(fields, cell, tmp_path):
    x = rng(4).standard_normal((2, 3, 4, 5)).astype(F)
    model = load_from_text(depool_net(x.shape, f"pool: FIX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 {fields}"))
    top, bw = depool_ref(x, None, "fix", (3, 2), (2, 3), (0, 0), fix=cell)
    check_everywhere(model, {"x": x}, {"o": top, "bw": bw}, tmp_path)


def test_soft_switch(tmp_path):
    r = rng(5)
    x = r.standard_normal((2, 3, 4, 5)).astype(F)
    switches = r.uniform(0, 1, (2, 6, 3, 4, 5)).astype(F)
    model = load_from_text(depool_net(x.shape, "pool: SOFT_SWITCH kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1",
                                      switches.shape))
    top, bw = depool_ref(x, switches, "soft_switch", (3, 2), (2, 1), (0, 0))
    check_everywhere(model, {"x": x, "m": switches}, {"o": top, "bw": bw}, tmp_path)


def test_one_top(tmp_path):
    x = rng(6).standard_normal((1, 2, 3, 4)).astype(F)
    model = load_from_text(depool_net(x.shape, "pool: SUM kernel_size: 2 stride: 2", tops=1))
    check_everywhere(model, {"x": x}, {"o": depool_ref(x, None, "sum", (2, 2), (2, 2), (0, 0))[0]}, tmp_path)


@pytest.mark.parametrize("params, extra, match", [
    ("pool: STOCHASTIC kernel_size: 2", None, "NOT_IMPLEMENTED"),
    ("pool: MAX global_pooling: true", (1, 2, 3, 4), "global_pooling"),
    ("pool: MAX kernel_size: 2 stride: 2", None, "Depooling takes 2 bottoms"),
    ("pool: MAX kernel_size: 2 stride: 2", (1, 2, 4, 3), "mask bottom"),
    ("pool: SOFT_SWITCH kernel_size: 2 stride: 2", (1, 2, 4, 3, 4), "switches bottom"),
    ("pool: AVE kernel_size: 2 pad: 2", None, "smaller than the kernel"),
    ("pool: FIX kernel_size: 2 pad: 1", None, "FIX"),
    ("pool: SUM kernel_size: 2 fix: 1", None, "pooling_param.fix only works with FIX"),
    ("pool: AVE kernel_size: 2 kernel_h: 2 kernel_w: 2", None, "not both"),
    ("pool: AVE stride: 2", None, "kernel_size"),
])
def test_depooling_refusals(params, extra, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(depool_net((1, 2, 3, 4), params, extra))


def test_pooling_refuses_the_forks_local_mask():
    with pytest.raises(LayerError, match="mask_index_type"):
        load_from_text(pool_net((1, 2, 6, 6), "pool: MAX kernel_size: 2 stride: 2 mask_index_type: LOCAL", tops=2))


def test_safe_inv(tmp_path):
    x = rng(7).standard_normal((2, 3, 4, 5)).astype(F)
    x[0, 0, 0, :3] = [0, -0.0, 4]
    model = load_from_text(net('layer { name: "s" type: "SafeInv" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    want = np.array([F(0) if v == 0 else F(1) / v for v in x.ravel()], F).reshape(x.shape)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)


def test_image_output_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x = rng(8).standard_normal((2, 3, 4, 5)).astype(F)
    model = load_from_text(net('layer { name: "s" type: "SafeInv" bottom: "x" top: "o" }',
                               'layer { name: "w" type: "ImageOutput" bottom: "o" image_output_param { '
                               'output_prefix: "dump/" normalization: AutoSCALE auto_ratio: 0.5 } }',
                               inputs={"x": x.shape}))
    assert model.run({"x": x})["o"].shape == x.shape
    assert list(tmp_path.iterdir()) == []


def test_image_output_refusals():
    with pytest.raises(LayerError, match="auto_ratio"):
        load_from_text(net('layer { name: "w" type: "ImageOutput" bottom: "x" image_output_param { '
                           'normalization: AutoSCALE auto_ratio: 0 } }', inputs={"x": (1, 3, 4, 5)}))
    with pytest.raises(LayerError, match="ImageOutput takes one bottom and 0 tops"):
        load_from_text(net('layer { name: "w" type: "ImageOutput" bottom: "x" top: "y" }', inputs={"x": (1, 3, 4, 5)}))


@pytest.mark.parametrize("name, needles", [
    ("alexnet__recon__SWWAE-first__layer5_deploy.prototxt", ["Depooling", "SafeInv", "1x256x13x13; 1x256x13x13"]),
    ("alexnet__recon__SWWAE-first__layer5_dump.prototxt", ["ImageOutput", "1x96x55x55; 1x96x55x55"]),
    ("vggnet__cls__SWWAE-all__layer5_deploy.prototxt", ["Depooling", "1x64x224x224"]),
    ("vggnet__recon__SWWAE-layerwise.pretrain__layer5_for_pretrain.prototxt", ["Depooling", "1x128x112x112"]),
])
def test_corpus_files_read(name, needles):
    out = inspect_corpus_file(str(FIXTURES / (PREFIX + name)))
    for needle in needles:
        assert needle in out


def test_switch_global_mask_just_outside_its_window(tmp_path):
    """GLOBAL mask values naming cells of the map one step outside their window (left, right, above, below):
    MaxPoolBackward matches only h * W + w of a covering window's own cells, so none of them gives anything."""
    r = rng(9)
    x = r.standard_normal((2, 3, 5, 4)).astype(F)
    k, s = (3, 2), (2, 1)
    hd, wd = 4 * 2 + 3, 3 * 1 + 2
    mask = max_mask(r.standard_normal((2, 3, hd, wd)).astype(F), k, s, (0, 0))
    hs, ws = 2 * s[0], 1 * s[1]   # window (2, 1)
    for ch, (y, xc) in enumerate([(hs + 1, ws - 1), (hs, ws + k[1]), (hs - 1, ws + 1)]):
        mask[0, ch, 2, 1] = y * wd + xc
    mask[1, 0, 2, 1] = (hs + k[0]) * wd + ws
    mask[1, 1, 2, 1] = (hs + 1) * wd + ws + 1   # inside: (1, 1) of the window
    model = load_from_text(depool_net(x.shape, "pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1", mask.shape))
    top, bw = depool_ref(x, mask, "switch", k, s, (0, 0))
    assert bw[1, 1, hs + 1, ws + 1] >= 1
    check_everywhere(model, {"x": x, "m": mask}, {"o": top, "bw": bw}, tmp_path)


def test_switch_local_non_integer_masks_give_nothing(tmp_path):
    r = rng(10)
    x = r.standard_normal((2, 3, 4, 5)).astype(F)
    mask = r.integers(0, 6, x.shape).astype(F)
    mask[0, :, 1, :] = [2.5, 0.5, -0.5, 5.999, 1e-3]   # floors 2, 0, -1, 5, 0: only integers name a cell
    model = load_from_text(depool_net(x.shape, "pool: SWITCH kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 "
                                               "mask_index_type: LOCAL", x.shape))
    top, bw = depool_ref(x, mask, "switch", (3, 2), (2, 1), (0, 0), local=True)
    check_everywhere(model, {"x": x, "m": mask}, {"o": top, "bw": bw}, tmp_path)


@pytest.mark.parametrize("fields, cell", [("", (2, 0)), ("fix_x: 0", (2, 0)), ("fix_y: 1", (1, 0)),
                                          ("fix: -3", (2, 0)), ("fix: 3", (3, 3))])
def test_fix_cell_from_fix_or_fix_y(fields, cell, tmp_path):
    """LayerSetUp: fix_x and fix_y only when fix_y is set (else fix for both; fix_x alone is not read), a
    negative one the centre kernel / 2 of its own axis; a 4x1 window here so the two centres differ."""
    x = rng(11).standard_normal((2, 3, 4, 5)).astype(F)
    kw = 4 if fields == "fix: 3" else 1
    model = load_from_text(depool_net(x.shape, f"pool: FIX kernel_h: 4 kernel_w: {kw} stride_h: 3 stride_w: 2 {fields}"))
    top, bw = depool_ref(x, None, "fix", (4, kw), (3, 2), (0, 0), fix=cell)
    check_everywhere(model, {"x": x}, {"o": top, "bw": bw}, tmp_path)


def test_ave_default_stride_many_windows_per_cell(tmp_path):
    """stride defaults to 1: up to 3 x 4 windows reach a cell, added rows first as the kernel adds them."""
    x = rng(12).standard_normal((2, 3, 4, 5)).astype(F)
    model = load_from_text(depool_net(x.shape, "pool: AVE kernel_h: 3 kernel_w: 4 pad_h: 1 pad_w: 2"))
    assert model.blob_shapes["o"] == (2, 3, 4, 4)
    top, bw = depool_ref(x, None, "ave", (3, 4), (1, 1), (1, 2))
    check_everywhere(model, {"x": x}, {"o": top, "bw": bw}, tmp_path)


def test_soft_switch_refuses_pad():
    """SoftSwitchPoolBackward takes each switch pad cells further on in the window (its h and w include the pad,
    its window start too), reading the next channel's switches and, at the last channel, past the blob."""
    with pytest.raises(LayerError, match="SOFT_SWITCH with pooling_param.pad"):
        load_from_text(depool_net((1, 2, 3, 4), "pool: SOFT_SWITCH kernel_size: 3 stride: 2 pad_h: 0 pad_w: 1",
                                  (1, 9, 2, 3, 4)))


@pytest.mark.parametrize("method", ["FIX", "SWITCH", "SOFT_SWITCH", "SUM"])
def test_pooling_refuses_the_forks_methods(method):
    with pytest.raises(LayerError, match=f"pool {method}: caffe-recon-dec's"):
        load_from_text(pool_net((1, 2, 6, 6), f"pool: {method} kernel_size: 2 stride: 2"))


@pytest.mark.parametrize("field", ["fix: 1", "fix_x: 0", "fix_y: -1"])
def test_pooling_refuses_the_forks_fix_fields(field):
    with pytest.raises(LayerError, match="fix fields are read by its Depooling only"):
        load_from_text(pool_net((1, 2, 6, 6), f"pool: MAX kernel_size: 2 stride: 2 {field}"))


def test_pooling_reads_an_explicit_global_mask_index():
    model = load_from_text(pool_net((1, 2, 6, 6), "pool: MAX kernel_size: 2 stride: 2 mask_index_type: GLOBAL", tops=2))
    assert model.blob_shapes["mask"] == (1, 2, 3, 3)


def test_image_output_auto_ratio_bounds():
    """LayerSetUp CHECKs 0 < auto_ratio <= 1 under AutoSCALE only."""
    def layer(q):
        return net(f'layer {{ name: "w" type: "ImageOutput" bottom: "x" image_output_param {{ {q} }} }}',
                   inputs={"x": (1, 3, 4, 5)})
    load_from_text(layer("normalization: AutoSCALE auto_ratio: 1"))
    load_from_text(layer("normalization: SCALE auto_ratio: 0"))
    with pytest.raises(LayerError, match="auto_ratio"):
        load_from_text(layer("normalization: AutoSCALE auto_ratio: 1.5"))
