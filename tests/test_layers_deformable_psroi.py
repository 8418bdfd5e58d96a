"""DeformablePSROIPooling (makefile/frcnn 8d9b9eb, src/caffe/DeformConv/deformable_psroi_pooling_layer.cpp):
Deformable R-FCN's position-sensitive pooling with learned offsets.

The reference is a numpy loop written here from the fork's DeformablePSROIPoolForward (CPU and CUDA alike),
in float32 scalars as its Dtype.
"""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def c_round(v):
    v = float(v)     # in double, as C's round: float32's 0.49999997 + 0.5 would round up to 1
    return float(np.sign(v) * np.floor(abs(v) + 0.5))


def bilinear(plane, x, y):
    x1, x2, y1, y2 = int(np.floor(x)), int(np.ceil(x)), int(np.floor(y)), int(np.ceil(y))
    dx, dy = x - F(x1), y - F(y1)
    one = F(1)
    return ((one - dx) * (one - dy) * plane[y1, x1] + (one - dx) * dy * plane[y2, x1]
            + dx * (one - dy) * plane[y1, x2] + dx * dy * plane[y2, x2])


def ref_deformable_psroi(x, rois, trans, dim, g, part, samples, std, scale):
    _n, c, h, w = x.shape
    scale, std = F(scale), F(std)
    flat = None if trans is None else trans.reshape(-1)
    classes = 1 if trans is None else trans.shape[1] // 2
    each = dim if trans is None else dim // classes
    out = np.zeros((len(rois), dim, g, g), F)
    for n, roi in enumerate(rois):
        b = int(roi[0])
        sw = F(c_round(roi[1])) * scale - F(0.5)
        sh = F(c_round(roi[2])) * scale - F(0.5)
        ew = F(c_round(roi[3]) + 1.0) * scale - F(0.5)
        eh = F(c_round(roi[4]) + 1.0) * scale - F(0.5)
        rw, rh = max(ew - sw, F(0.1)), max(eh - sh, F(0.1))
        bh, bw = rh / F(g), rw / F(g)
        subh, subw = bh / F(samples), bw / F(samples)
        for ctop in range(dim):
            for ph in range(g):
                for pw in range(g):
                    part_h = int(np.floor(F(ph) / F(g) * F(part)))
                    part_w = int(np.floor(F(pw) / F(g) * F(part)))
                    cls = ctop // each
                    tx = ty = F(0)
                    if flat is not None:
                        tx = flat[(((n * classes + cls) * 2) * part + part_h) * part + part_w] * std
                        ty = flat[(((n * classes + cls) * 2 + 1) * part + part_h) * part + part_w] * std
                    wstart = F(pw) * bw + sw
                    wstart = wstart + tx * rw
                    hstart = F(ph) * bh + sh
                    hstart = hstart + ty * rh
                    total, count = F(0), 0
                    chan = (ctop * g + ph) * g + pw
                    for ih in range(samples):
                        for iw in range(samples):
                            xx = wstart + F(iw) * subw
                            yy = hstart + F(ih) * subh
                            if xx < -0.5 or xx > w - 0.5 or yy < -0.5 or yy > h - 0.5:
                                continue
                            xx = min(max(xx, F(0)), F(w - 1))
                            yy = min(max(yy, F(0)), F(h - 1))
                            total = total + bilinear(x[b, chan], xx, yy)
                            count += 1
                    out[n, ctop, ph, pw] = 0 if count == 0 else total / F(count)
    return out


DIM, G = 4, 3
X_SHAPE = (2, DIM * G * G, 7, 11)       # N, C, H, W all different
# input pixels (spatial_scale 0.5): inside, crossing the top-left border, on image 1 with fractional
# corners (.5 rounds away from 0), one pixel, wholly off the map (no sample taken: 0), and x2 < x1, y2 = y1 - 1
# (sizes below 0: the kernel's minimum 0.1)
ROIS = np.array([[0, 2.3, 1.6, 15.2, 9.4],
                 [0, -3.0, -2.5, 6.5, 5.49],
                 [1, 4.5, 0.5, 20.7, 13.2],
                 [1, 8.0, 6.0, 8.0, 6.0],
                 [0, 40.0, 30.0, 48.0, 36.0],
                 [1, 12.0, 9.0, 3.0, 8.0]], F)


def layer(params, trans=True):
    bottoms = 'bottom: "x" bottom: "rois"' + (' bottom: "t"' if trans else "")
    return (f'layer {{ name: "d" type: "DeformablePSROIPooling" {bottoms} top: "o" '
            f"deformable_psroi_pooling_param {{ {params} }} }}")


def model_for(params, trans_shape=None, rois=ROIS):
    inputs = {"x": X_SHAPE, "rois": rois.shape}
    if trans_shape is not None:
        inputs["t"] = trans_shape
    return load_from_text(net(layer(params, trans_shape is not None), inputs=inputs))


@pytest.mark.parametrize("classes, part", [(1, 3), (2, 3), (2, 5)])
def test_with_trans(tmp_path, classes, part):
    """Offsets per class and part (part_size 3 = group_size, and 5: parts 0, 1, 3 of 5), sample_per_part 2;
    offsets of up to a few tenths of the roi push samples off the map."""
    g = rng(1)
    x = g.standard_normal(X_SHAPE).astype(F)
    t = g.standard_normal((len(ROIS), 2 * classes, part, part)).astype(F)
    params = (f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} pooled_size: 7 part_size: {part} "
              f"sample_per_part: 2 trans_std: 0.3")
    model = model_for(params, t.shape)
    ref = ref_deformable_psroi(x, ROIS, t, DIM, G, part, 2, 0.3, 0.5)
    assert (ref[4] == 0).all() and (ref[:4] != 0).any()
    check_everywhere(model, {"x": x, "rois": ROIS, "t": t}, {"o": ref}, tmp_path, atol=0, rtol=0)


def test_no_trans(tmp_path):
    """no_trans: two bottoms, plain bins with sample_per_part^2 samples each (here 3 x 3)."""
    x = rng(2).standard_normal(X_SHAPE).astype(F)
    model = model_for(f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} sample_per_part: 3 no_trans: true")
    ref = ref_deformable_psroi(x, ROIS, None, DIM, G, 0, 3, 0.0, 0.5)
    check_everywhere(model, {"x": x, "rois": ROIS}, {"o": ref}, tmp_path, atol=0, rtol=0)


def test_part_size_default_reads_the_first_offset(tmp_path):
    """part_size left at the fork's 0: every bin of every roi reads trans[0] for both x and y."""
    g = rng(3)
    x = g.standard_normal(X_SHAPE).astype(F)
    t = g.standard_normal((len(ROIS), 2, 3, 3)).astype(F)
    model = model_for(f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} trans_std: 0.2", t.shape)
    ref = ref_deformable_psroi(x, ROIS, t, DIM, G, 0, 1, 0.2, 0.5)
    moved = t.copy()
    moved.reshape(-1)[1:] = 9.0    # nothing but trans[0] matters
    assert np.array_equal(ref, ref_deformable_psroi(x, ROIS, moved, DIM, G, 0, 1, 0.2, 0.5))
    check_everywhere(model, {"x": x, "rois": ROIS, "t": t}, {"o": ref}, tmp_path, atol=0, rtol=0)


def test_trans_read_flat_up_to_the_last_part_read(tmp_path):
    """part_size 5 with group_size 3 reads parts 0, 1, 3: the kernel reads trans as a flat buffer, and a
    (3, 2, 4, 6) trans (144 values) holds the last offset 3 rois read, ((5 * 5 + 3) * 5 + 3 = 143)."""
    g = rng(6)
    x = g.standard_normal(X_SHAPE).astype(F)
    rois = ROIS[:3]
    t = g.standard_normal((3, 2, 4, 6)).astype(F)
    inputs = {"x": X_SHAPE, "rois": rois.shape, "t": t.shape}
    params = f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} part_size: 5 sample_per_part: 2 trans_std: 0.3"
    model = load_from_text(net(layer(params), inputs=inputs))
    ref = ref_deformable_psroi(x, rois, t, DIM, G, 5, 2, 0.3, 0.5)
    moved = t.copy()
    moved.reshape(-1)[143] += 1.0
    assert not np.array_equal(ref, ref_deformable_psroi(x, rois, moved, DIM, G, 5, 2, 0.3, 0.5))
    check_everywhere(model, {"x": x, "rois": rois, "t": t}, {"o": ref}, tmp_path, atol=0, rtol=0)


def test_no_rois():
    x = rng(4).standard_normal(X_SHAPE).astype(F)
    rois = np.zeros((0, 5), F)
    model = model_for(f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} no_trans: true", rois=np.zeros((1, 5), F))
    assert model.run({"x": x, "rois": rois})["o"].shape == (0, DIM, G, G)


def test_missing_output_dim_is_read_from_the_channels(tmp_path):
    """makefile/frcnn's fpn-res50 dcn nets leave output_dim out (group_size 1, pooled_size 7): one bin per
    roi and channel, output_dim = channels."""
    x = rng(5).standard_normal(X_SHAPE).astype(F)
    model = model_for("group_size: 1 pooled_size: 7 part_size: 7 sample_per_part: 4 no_trans: true "
                      "spatial_scale: 0.25")
    assert any("output_dim is missing" in n for n in model.warnings)
    ref = ref_deformable_psroi(x, ROIS, None, X_SHAPE[1], 1, 7, 4, 0.0, 0.25)
    check_everywhere(model, {"x": x, "rois": ROIS}, {"o": ref}, tmp_path, atol=0, rtol=0)


@pytest.mark.parametrize("params, trans, message", [
    (f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G}", None, "third bottom"),
    (f"spatial_scale: 0.5 output_dim: 3 group_size: {G} no_trans: true", None, "channels"),
    (f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} sample_per_part: 0 no_trans: true", None,
     "sample_per_part"),
    (f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} part_size: 3", (5, 6, 3, 3), "num_classes"),
    (f"spatial_scale: 0.5 output_dim: {DIM} group_size: {G} part_size: 4", (5, 2, 3, 3), "holds"),
])
def test_bad_parameters(params, trans, message):
    with pytest.raises(CaffeqError, match=message) as e:
        model_for(params, trans)
    assert "\n" not in str(e.value)
