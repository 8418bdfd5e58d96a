"""Steps of SSD's DetectionOutput (weiliu89/caffe bbox_util.cpp, detection_output_layer.cpp) that forks keep as
they are, as the tests' float32 reference: the CENTER_SIZE decoding of one box and keep_top_k over the classes
of one image.  test_layers_act_detection_output.py (ACT's tubes), test_layers_openvino_forks.py (OpenVINO's
reference) and test_layers_opencv_forks97.py (OpenCV's pixel boxes) call them."""
import numpy as np

F = np.float32


def center_size_decode(prior, var, t):
    """DecodeBBox, CENTER_SIZE: (xmin, ymin, xmax, ymax) of offsets t against the prior corners with variances
    var (ones where they are encoded in the target), each step rounded to float32 as the C++ computes it."""
    pw, ph = F(prior[2] - prior[0]), F(prior[3] - prior[1])
    pcx, pcy = F(F(prior[0] + prior[2]) / F(2)), F(F(prior[1] + prior[3]) / F(2))
    cx = F(F(F(var[0] * t[0]) * pw) + pcx)
    cy = F(F(F(var[1] * t[1]) * ph) + pcy)
    w = F(np.exp(F(var[2] * t[2])) * pw)
    h = F(np.exp(F(var[3] * t[3])) * ph)
    return np.array([cx - F(w / F(2)), cy - F(h / F(2)), cx + F(w / F(2)), cy + F(h / F(2))], F)


def apply_keep_top_k(kept, scores, k):
    """keep_top_k of one image: `kept` ({class: [prior, ...]} after NMS) cut to the k best (score, class, prior)
    of all classes when it holds more than k (k -1: no cut).  scores: (priors, classes).  The sort is stable
    over the classes in order and each class's priors as kept, so ties keep that order."""
    if k < 0 or sum(len(v) for v in kept.values()) <= k:
        return kept
    pool = sorted([(scores[p, c], c, p) for c in sorted(kept) for p in kept[c]], key=lambda x: -x[0])
    out = {}
    for _, c, p in pool[:k]:
        out.setdefault(c, []).append(p)
    return out
