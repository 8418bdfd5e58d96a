"""NVIDIA DIGITS DetectNet's box clustering, the well-known Python layer
`caffe.layers.detectnet.clustering.ClusterDetections` (NVIDIA/caffe 0.17.3, 587d488,
python/caffe/layers/detectnet/clustering.py), run natively: caffeq never imports the module.

param_str: 'img_size_x, img_size_y, stride, gridbox_cvg_threshold, gridbox_rect_thresh,
gridbox_rect_eps, min_height[, num_classes]'; the module ignores any later value.  Bottoms: the coverage
(N, classes, H, W) and the boxes (N, >= 4, H, W).  Every class reads box channels 0-3 (x1, y1, x2, y2
relative to the cell), as the module does.  Each class gives one top (N, 50, 5); for each image:

1. The grid is int(img_size / stride) cells a side.  The cells of the coverage's top-left grid region
   whose float32 value >= the threshold (as float32) propose boxes, row by row.
2. A cell (x, y) proposes x1 + x * cell_w, y1 + y * cell_h, x2 + x * cell_w, y2 + y * cell_h in float64
   (cell_w = img_size_x / grid_x).
3. If any of these coordinates is non-zero, OpenCV's groupRectangles(rects, gridbox_rect_thresh, gridbox_rect_eps)
   runs on [x1, y1, x2 - x1, y2 - y1].  OpenCV 3's Python binding rounds each value to int (cvRound: half
   to even; NaN or outside int32 gives INT_MIN); OpenCV 4's refuses float rects, so the module needs
   OpenCV 3.  See group_rectangles.
4. Each group whose height >= min_height gives [x, y, x + w, y + h, ln(count)], rounded to float16.
   The rest of the 50 rows (the module's MAX_BOXES) stay 0.  More than 50 make the module's assignment
   fail, and caffeq refuses the same way.

NVCaffe up to 0.17.2 passed [x1, y1, x2, y2] to groupRectangles as [x, y, width, height] and compared
min_height with y2 - y1.  The reading note says so, since a prototxt cannot tell the two apart.

ONNX cannot express the transitive grouping, so the export refuses; `--outputs` exports the grid blobs.
The torch functions below serve `forward` and are copied into model.py (inspect.getsource); they use
torch and math only.
"""
import torch

from .registry import Layer, LayerError, need_blobs, positive_field, register_layer, torch_sources

MAX_BOXES = 50   # clustering.py's fixed rows per image


def wrap_int32(v):
    """C int arithmetic on int64 tensors: wrap to int32 as the fork's int sums do."""
    return torch.remainder(v + 2 ** 31, 2 ** 32) - 2 ** 31


def cv_round(v):
    """OpenCV's cvRound of float values (SSE conversion): half to even; NaN or outside int32 -> INT_MIN."""
    r = torch.round(v)
    bad = torch.isnan(r) | (r < -2 ** 31) | (r >= 2 ** 31)
    return torch.where(bad, torch.full_like(r, -2 ** 31), r).to(torch.int64)


def double_to_half(x):
    """float64 -> float16 rounded once, as numpy casts: through float32 rounded to odd (an inexact float32
    with an even last bit moves one step toward x), so the second rounding cannot land on a false tie."""
    f = x.to(torch.float32)
    inexact = f.double() != x
    even = (f.view(torch.int32) & 1) == 0
    toward = torch.where(x > f.double(), torch.tensor(float("inf")), torch.tensor(float("-inf"))).to(f.device)
    return torch.where(inexact & even, torch.nextafter(f, toward.float()), f).to(torch.float16)


def group_rectangles(rects, threshold: int, eps: float):
    """OpenCV's groupRectangles(rects, threshold, eps) on (K, 4) int64 [x, y, w, h] (int32 values) ->
    (kept rects (M, 4), their counts (M,)), in OpenCV's order."""
    n = rects.shape[0]
    if threshold <= 0 or n == 0:
        return rects, torch.ones(n, dtype=torch.int64, device=rects.device)
    x, y, w, h = rects.unbind(1)
    right, bottom = wrap_int32(x + w), wrap_int32(y + h)
    # SimilarRects, the relation partition() closes transitively: delta = eps * (min widths + min heights)
    # * 0.5 in doubles; each edge (int differences, abs of INT_MIN staying negative) within delta
    similar = torch.zeros(n, n, dtype=torch.bool, device=rects.device)
    for s in range(0, n, 512):
        e = slice(s, s + 512)
        sums = wrap_int32(torch.minimum(w[e, None], w[None, :]) + torch.minimum(h[e, None], h[None, :]))
        delta = eps * sums.double() * 0.5
        near = torch.ones_like(similar[e])
        for a in (x, y, right, bottom):
            d = wrap_int32(a[e, None] - a[None, :])
            d = torch.where(d == -2 ** 31, d, d.abs())
            near &= d.double() <= delta
        similar[e] = near
    # connected components: every rect takes its neighbours' smallest label, then follows labels to
    # their own labels, until nothing changes; each component ends with its smallest index, so sorted
    # labels number the classes in order of first appearance, as partition() does
    label = torch.arange(n, device=rects.device)
    while True:
        new = label.clone()
        for s in range(0, n, 512):
            e = slice(s, s + 512)
            new[e] = torch.minimum(new[e], torch.where(similar[e], label[None, :], n).min(dim=1).values)
        while True:
            hop = new[new]
            if torch.equal(hop, new):
                break
            new = hop
        if torch.equal(new, label):
            break
        label = new
    _, cls = torch.unique(label, sorted=True, return_inverse=True)
    classes = int(cls.max()) + 1
    counts = torch.bincount(cls, minlength=classes)
    sums = torch.zeros(classes, 4, dtype=torch.int64, device=rects.device).index_add_(0, cls, rects)
    # the mean: the int sum (wrapped) as float32 times float32 1 / count, cvRound-ed
    scale = 1.0 / counts.to(torch.float32)
    mean = cv_round(wrap_int32(sums).to(torch.float32) * scale[:, None])
    mx, my, mw, mh = mean.unbind(1)
    # a group is dropped when it lies inside another big group (edges widened by cvRound(size * eps))
    # that has more members than max(3, its own) or when it has fewer than 3
    big = counts > threshold
    dx, dy = cv_round(mw.double() * eps), cv_round(mh.double() * eps)
    inside = ((mx[:, None] >= wrap_int32(mx - dx)[None, :]) & (my[:, None] >= wrap_int32(my - dy)[None, :])
              & (wrap_int32(mx + mw)[:, None] <= wrap_int32(mx + mw + dx)[None, :])
              & (wrap_int32(my + mh)[:, None] <= wrap_int32(my + mh + dy)[None, :])
              & ((counts[None, :] > torch.clamp(counts, min=3)[:, None]) | (counts[:, None] < 3))
              & big[None, :] & ~torch.eye(classes, dtype=torch.bool, device=rects.device))
    keep = big & ~inside.any(dim=1)
    return mean[keep], counts[keep]


def detectnet_cluster(coverage, boxes, size_x: int, size_y: int, stride: int, cvg_threshold: float,
                      rect_threshold: int, rect_eps: float, min_height: int):
    """clustering.py's cluster() for one class: coverage (N, 1, H, W), boxes (N, >= 4, H, W) ->
    (N, 50, 5) float32 rows [x1, y1, x2, y2, ln(count)] rounded to float16, zeros after the last."""
    n = coverage.shape[0]
    grid_x, grid_y = int(size_x / stride), int(size_y / stride)
    cell_w, cell_h = size_x / grid_x, size_y / grid_y
    out = torch.zeros(n, 50, 5, dtype=torch.float32, device=coverage.device)
    threshold = torch.tensor(cvg_threshold, dtype=torch.float32)
    for i in range(n):
        ys, xs = torch.nonzero(coverage[i, 0, :grid_y, :grid_x].float() >= threshold, as_tuple=True)
        b = boxes[i, :4][:, ys, xs].float().double()
        ox, oy = xs.double() * cell_w, ys.double() * cell_h
        x1, y1, x2, y2 = b[0] + ox, b[1] + oy, b[2] + ox, b[3] + oy
        if not bool((torch.stack([x1, y1, x2, y2]) != 0).any()):   # `propose_boxes.any()`: none, or all 0
            continue
        rects = cv_round(torch.stack([x1, y1, x2 - x1, y2 - y1], dim=1))
        kept, counts = group_rectangles(rects, rect_threshold, rect_eps)
        tall = kept[:, 3] >= min_height
        kept, counts = kept[tall], counts[tall]
        if kept.shape[0] > 50:
            raise ValueError(f"ClusterDetections: image {i} gives {kept.shape[0]} boxes, more than the "
                             f"module's 50 rows (its assignment fails there too)")
        x, y, w, h = kept.unbind(1)
        rows = torch.stack([x.double(), y.double(), wrap_int32(x + w).double(), wrap_int32(y + h).double(),
                            torch.log(counts.double())], dim=1)
        out[i, :rows.shape[0]] = double_to_half(rows).float()
    return out


TORCH_CLUSTER = torch_sources(wrap_int32, cv_round, double_to_half, group_rectangles, detectnet_cluster)


@register_layer("Python:caffe.layers.detectnet.clustering.ClusterDetections")
class ClusterDetections(Layer):
    onnx_refusal = ("OpenCV's groupRectangles (boxes grouped transitively by similarity) has no ONNX form; "
                    "export up to the coverage and bbox blobs with --outputs")
    reading_note = ("DetectNet's ClusterDetections runs as NVCaffe 0.17.3's clustering.py with OpenCV 3's "
                    "groupRectangles on x, y, width, height; NVCaffe up to 0.17.2 passed x2, y2 as the width and "
                    "height, which groups differently")

    def parse(self, lp):
        need_blobs(lp, "ClusterDetections", 2, len(lp.top) or 1, "coverage, bboxes")
        text = lp.python_param.param_str
        fields = [f.strip() for f in text.split(",")]
        if len(fields) < 7:
            raise LayerError(f"python_param.param_str: ClusterDetections takes 'img_size_x, img_size_y, stride, "
                             f"cvg threshold, rect threshold, rect eps, min height[, num_classes]', got {text!r}")
        kinds = (int, int, int, float, int, float, int, int)
        try:   # the module reads at most 8 values: a later one is ignored
            values = [kind(v) for kind, v in zip(kinds, fields)]
        except ValueError:
            raise LayerError(f"python_param.param_str: ClusterDetections values of the wrong type in {text!r} "
                             f"(the module reads them with int() and float())") from None
        names = ("size_x", "size_y", "stride", "cvg_threshold", "rect_threshold", "rect_eps", "min_height")
        attrs = dict(zip(names, values))
        for key in ("size_x", "size_y", "stride"):
            positive_field(attrs[key], f"python_param.param_str's {key}")
        if attrs["stride"] > min(attrs["size_x"], attrs["size_y"]):
            raise LayerError(f"python_param.param_str: stride {attrs['stride']} leaves no grid cell in a "
                             f"{attrs['size_x']}x{attrs['size_y']} image (the module divides by zero)")
        classes = values[7] if len(values) > 7 else 1
        if len(lp.top) != classes:
            raise LayerError(f"ClusterDetections gives one top per class: {classes} class(es), {len(lp.top)} tops")
        return {"name": lp.name, "classes": classes, **attrs}

    def infer(self, attrs, in_shapes):
        coverage, boxes = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(coverage) != 4 or coverage[1] != attrs["classes"]:
            raise LayerError(f"ClusterDetections: the coverage needs {attrs['classes']} channel(s) (one per class), "
                             f"(N, classes, H, W), got {list(coverage)}")
        rows = min(coverage[2], int(attrs["size_y"] / attrs["stride"]))
        cols = min(coverage[3], int(attrs["size_x"] / attrs["stride"]))
        if len(boxes) != 4 or boxes[0] < coverage[0] or boxes[1] < 4 or boxes[2] < rows or boxes[3] < cols:
            raise LayerError(f"ClusterDetections reads box channels 0-3 at the coverage's {rows}x{cols} grid "
                             f"cells for each of its {coverage[0]} images, got boxes {list(boxes)}")
        return [(coverage[0], MAX_BOXES, 5)] * attrs["classes"]

    @staticmethod
    def _settings(attrs):
        return tuple(attrs[k] for k in ("size_x", "size_y", "stride", "cvg_threshold", "rect_threshold",
                                        "rect_eps", "min_height"))

    def forward(self, attrs, params, coverage, boxes):
        try:
            tops = [detectnet_cluster(coverage[:, c:c + 1], boxes, *self._settings(attrs))
                    for c in range(attrs["classes"])]
        except ValueError as e:
            raise LayerError(f"layer '{attrs['name']}': {e}") from None
        return tops if len(tops) > 1 else tops[0]

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_CLUSTER)
        settings = ", ".join(emit.lit(v) for v in self._settings(node.attrs))
        coverage, boxes = emit.inputs
        calls = [f"{fn}({coverage}[:, {c}:{c + 1}], {boxes}, {settings})" for c in range(node.attrs["classes"])]
        return calls if len(calls) > 1 else calls[0]


__all__ = ["ClusterDetections", "cv_round", "detectnet_cluster", "double_to_half", "group_rectangles"]
