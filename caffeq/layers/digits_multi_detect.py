"""SidHard/digits-multi-detect (371385e): DIGITS' DetectNet made multi-class.  Its caffe.proto declares
DetectNetGroundTruthParameter.object_class a class count (read by DetectNetTransformation, detectnet.py), and
its caffe/python/caffe/layers/detectnet/clustering.py gives ClusterDetections ONE top holding every class:

param_str: 'img_size_x, img_size_y, stride, gridbox_cvg_threshold, gridbox_rect_thresh, gridbox_rect_eps,
min_height[, num_classes]' (num_classes 1 when left out; a later value is ignored).  Bottoms: the coverage
(N, num_classes, H, W), checked by its reshape, and the boxes (N, >= 4, H, W).  Top: (num_classes, N, 50, 5),
class c's rows at [c].  NVCaffe's module (detectnet_clustering.py) gives one top per class and refuses one top
for several classes, so a layer of that form is this fork's.

The module is Python 2 (xrange) and differs from detectnet_clustering.py's reading in three ways:
1. `/` of ints floors: the grid is img_size // stride cells a side and a cell img_size // grid pixels
   (1096 // 68 = 16, not 16.12).
2. `cvg[0:grid_y][0:grid_x]` slices the rows twice: it reads the first min(grid_y, grid_x) rows of the
   coverage, every column of them.
3. The corners x1, y1, x2, y2 go to OpenCV's groupRectangles as x, y, width, height (cvRound each), a group
   is kept when its mean "height" minus its mean y (int32) >= min_height, and its row is those four means
   and ln(count), rounded to float16.
ONNX cannot express the transitive grouping, so the export refuses; `--outputs` exports the grid blobs.
"""
import torch

from .detectnet_clustering import MAX_BOXES, cv_round, double_to_half, group_rectangles, wrap_int32
from .registry import Layer, LayerError, claim_layers, need_blobs, positive_field, torch_sources

CLUSTER_KEY = "Python:caffe.layers.detectnet.clustering.ClusterDetections"
PARAM_KINDS = (int, int, int, float, int, float, int, int)
PARAM_NAMES = ("size_x", "size_y", "stride", "cvg_threshold", "rect_threshold", "rect_eps", "min_height")


def multi_detect_cluster(coverage, boxes, size_x: int, size_y: int, stride: int, cvg_threshold: float,
                         rect_threshold: int, rect_eps: float, min_height: int):
    """The fork's cluster() for one class: coverage (N, 1, H, W), boxes (N, >= 4, H, W) -> (N, 50, 5)
    float32 rows [x1, y1, x2, y2, ln(count)] rounded to float16, zeros after the last."""
    grid_x, grid_y = size_x // stride, size_y // stride
    cell_w, cell_h = size_x // grid_x, size_y // grid_y
    rows_read = min(grid_y, grid_x)
    out = torch.zeros(coverage.shape[0], 50, 5, dtype=torch.float32, device=coverage.device)
    threshold = torch.tensor(cvg_threshold, dtype=torch.float32)
    for i in range(coverage.shape[0]):
        ys, xs = torch.nonzero(coverage[i, 0, :rows_read].float() >= threshold, as_tuple=True)
        b = boxes[i, :4][:, ys, xs].float().double()
        ox, oy = (xs * cell_w).double(), (ys * cell_h).double()
        corners = torch.stack([b[0] + ox, b[1] + oy, b[2] + ox, b[3] + oy], dim=1)
        if not bool((corners != 0).any()):
            continue
        kept, counts = group_rectangles(cv_round(corners), rect_threshold, rect_eps)
        tall = wrap_int32(kept[:, 3] - kept[:, 1]) >= min_height
        kept, counts = kept[tall], counts[tall]
        if kept.shape[0] > 50:
            raise ValueError(f"ClusterDetections: image {i} gives {kept.shape[0]} boxes, more than the "
                             f"module's 50 rows (its assignment fails there too)")
        rows = torch.cat([kept.double(), torch.log(counts.double())[:, None]], dim=1)
        out[i, :rows.shape[0]] = double_to_half(rows).float()
    return out


def multi_detect_clusters(coverage, boxes, classes: int, size_x: int, size_y: int, stride: int,
                          cvg_threshold: float, rect_threshold: int, rect_eps: float, min_height: int):
    """Every class's rows, stacked as the fork's one top: (classes, N, 50, 5)."""
    return torch.stack([multi_detect_cluster(coverage[:, c:c + 1], boxes, size_x, size_y, stride, cvg_threshold,
                                             rect_threshold, rect_eps, min_height) for c in range(classes)])


TORCH_MULTI_CLUSTER = torch_sources(wrap_int32, cv_round, double_to_half, group_rectangles, multi_detect_cluster,
                                    multi_detect_clusters)


def _param_values(lp):
    """param_str's values by the module's int() / float(), or None where NVCaffe's spec should report."""
    fields = [f.strip() for f in lp.python_param.param_str.split(",")]
    try:
        return [kind(v) for kind, v in zip(PARAM_KINDS, fields)]
    except ValueError:
        return None


def _one_top_for_classes(lp):
    """One top for several classes: only this fork's module gives that (NVCaffe's refuses it)."""
    values = _param_values(lp)
    return len(lp.top) == 1 and values is not None and len(values) == 8 and values[7] != 1


@claim_layers(CLUSTER_KEY, _one_top_for_classes)
class MultiDetectClusterDetections(Layer):
    onnx_refusal = ("OpenCV's groupRectangles (boxes grouped transitively by similarity) has no ONNX form; "
                    "export up to the coverage and bbox blobs with --outputs")
    reading_note = ("ClusterDetections with one top for several classes runs as SidHard/digits-multi-detect's "
                    "Python 2 clustering.py (classes stacked in one top, integer cell sizes, corners passed to "
                    "groupRectangles as x, y, width, height)")

    def parse(self, lp):
        need_blobs(lp, "ClusterDetections", 2, 1, "coverage, bboxes")
        values = _param_values(lp)
        attrs = dict(zip(PARAM_NAMES, values))
        for key in ("size_x", "size_y", "stride"):
            positive_field(attrs[key], f"python_param.param_str's {key}")
        if attrs["stride"] > min(attrs["size_x"], attrs["size_y"]):
            raise LayerError(f"python_param.param_str: stride {attrs['stride']} leaves no grid cell in a "
                             f"{attrs['size_x']}x{attrs['size_y']} image (the module divides by zero)")
        if values[7] < 1:
            raise LayerError(f"python_param.param_str: num_classes {values[7]} gives no class to cluster")
        return {"name": lp.name, "classes": values[7], **attrs}

    def infer(self, attrs, in_shapes):
        coverage, boxes = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(coverage) != 4 or coverage[1] != attrs["classes"]:
            raise LayerError(f"ClusterDetections: the coverage needs {attrs['classes']} channel(s) (one per class), "
                             f"(N, classes, H, W), got {list(coverage)} (one top for {attrs['classes']} classes is "
                             f"SidHard/digits-multi-detect's module; NVCaffe's gives one top per class)")
        rows = min(coverage[2], attrs["size_y"] // attrs["stride"], attrs["size_x"] // attrs["stride"])
        if len(boxes) != 4 or boxes[0] < coverage[0] or boxes[1] < 4 or boxes[2] < rows or boxes[3] < coverage[3]:
            raise LayerError(f"ClusterDetections reads box channels 0-3 at the coverage's first {rows} rows, all "
                             f"{coverage[3]} columns, for each of its {coverage[0]} images, got boxes {list(boxes)}")
        return [(attrs["classes"], coverage[0], MAX_BOXES, 5)]

    @staticmethod
    def _settings(attrs):
        return (attrs["classes"],) + tuple(attrs[k] for k in PARAM_NAMES)

    def forward(self, attrs, params, coverage, boxes):
        try:
            return multi_detect_clusters(coverage, boxes, *self._settings(attrs))
        except ValueError as e:
            raise LayerError(f"layer '{attrs['name']}': {e}") from None

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_MULTI_CLUSTER)
        settings = ", ".join(emit.lit(v) for v in self._settings(node.attrs))
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {settings})"


__all__ = ["MultiDetectClusterDetections", "multi_detect_cluster", "multi_detect_clusters"]
