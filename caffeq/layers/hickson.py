"""StevenHickson/caffe's Segmentation and LabelData (a933dcb; src/caffe/layers/segmentation_layer.cpp,
include/caffe/layers/segmentation_layer.hpp, src/caffe/layers/label_data_layer.cpp; src/caffe/proto/caffe.proto:
seg_param 148, label_data_param 149 there, 140148 and 150149 here), as StevenHickson/SemanticLabelingDemo uses them.

Segmentation (no .cu: both devices run the CPU code).  Bottoms data (N, C >= 3, H, W) [, labels (N, C', H, W)];
tops boxes [, segment labels] [, segment map].  Each image's first three channels are segmented by the
fork's own Felzenszwalb-Huttenlocher code (method 0), all in float32:

1. sigma = max(smoothing, 0.01); the mask m[i] = expf(-0.5 * (i / sigma)^2), i < ceil(4 sigma) + 1, divided by
   2 * (sum of |m[i]|, i >= 1) + |m[0]|.  Each channel is convolved with it along the rows, clamped at the
   ends, then once more along the rows: the fork's convolve_even writes its output untransposed, so it
   never smooths down the columns.
2. Edges, pixel by pixel in raster order: right, down, down-right, up-right (where they exist); weight
   sqrt((dR^2 + dG^2) + dB^2), R the smoothed channel 2, B channel 0.
3. std::sort by weight: libstdc++'s introsort (as GCC builds the fork), its order of equal weights included.
4. In that order an edge joins its two components when weight <= both thresholds; a joined component's
   threshold is weight + k / size (float32).  Then, in the same order, an edge joins components when
   either has fewer than min_size pixels.
5. Segments are numbered in raster order of their first pixel, image after image (ids go on across the
   batch).

Box row of a segment: [image, x, y, x2, y2], from its pixels' min and max column and row:
x = min(max(min_x - e, 0), W - 2), y likewise with H, x2 = min(max(max_x + e, 1), W - 1), y2 likewise
(e = bbox_extension).  With a label bottom, a segment's label is the most frequent int(label) (the first
of equal counts) over rows y .. y2 - 2 and columns x .. x2 - 2 of the image's label channel 0 (0 where
that is empty): OpenCV's MostOccuringValue crops width x2 - x - 1.  The segment map is the ids, float.

Top shapes: boxes (R, 5, 1, 1), segment labels (R, 1, 1, 1), R the batch's segment count; the fork's Reshape
gives R = 100 until its first forward (inferred here so), then the previous batch's count.  The segment
map is (N, 1, H, W) once the forward has run (Reshape gives it the data's shape first).  Tops by count:
1 bottom: boxes [, map]; 2 bottoms: boxes, labels [, map].

Refused where the fork's result is not its code's alone: method 1 (its SLIC branch is unfinished: no
segments, a crash with a map), max_k set (k drawn by rand() seeded with the clock), 1 bottom with 3 tops
(top 1 never written), a label outside 0..254 (a 255-slot count table) or a label box OpenCV refuses
(bbox_extension 0 and a one-column or one-row segment), and a batch of several images whose segments outgrow the 100
rows the blob first holds (growing it zeroes the earlier images' rows, how many depending on the forwards
before).  ONNX cannot express the sequential union-find: the export refuses.

LabelData (label_data_layer.cpp) is BVLC's ImageData under another name: it reads image_data_param
(source, batch_size, new_height / new_width, is_color, root_folder, shuffle, rand_skip), never
label_data_param; tops data (batch_size, C, H, W), label (batch_size,).
"""
import math

import torch

from ..errors import ExportError
from .data import ImageData, transform_attrs
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources

FIRST_ROWS = 100   # num_segments_ before the first forward (LayerSetUp)
INT_MAX = 2 ** 31 - 1


def hickson_f32(x: float) -> float:
    """A double rounded to float32 (half to even), as a double: float32 arithmetic done in doubles."""
    if x == 0.0 or not math.isfinite(x):
        return x
    quantum = max(math.frexp(x)[1] - 24, -149)
    y = math.ldexp(round(math.ldexp(x, -quantum)), quantum)
    return y if abs(y) < 2.0 ** 128 else math.copysign(math.inf, x)


def hickson_gauss_mask(smoothing: float) -> list:
    """make_fgauss then normalize: the row mask, float32 values."""
    sigma = max(hickson_f32(smoothing), hickson_f32(0.01))
    mask = []
    for i in range(int(math.ceil(sigma * 4.0)) + 1):
        t = hickson_f32(i / sigma)
        mask.append(hickson_f32(math.exp(-0.5 * hickson_f32(t * t))))
    total = 0.0
    for v in mask[1:]:
        total = hickson_f32(total + abs(v))
    total = hickson_f32(2.0 * total + abs(mask[0]))
    return [hickson_f32(v / total) for v in mask]


def hickson_smooth_rows(plane, mask: list):
    """convolve_even: each row against the symmetric mask, the columns clamped at both ends (float32)."""
    width = plane.shape[1]
    cols = torch.arange(width, device=plane.device)
    out = plane * mask[0]
    for i in range(1, len(mask)):
        side = plane[:, (cols - i).clamp(min=0)] + plane[:, (cols + i).clamp(max=width - 1)]
        out = out + side * mask[i]
    return out


def hickson_edges(smoothed):
    """iBuildGraph's edges of a (3, H, W) smoothed image: (weights, first pixels, second pixels) as lists,
    in the fork's order: pixel by pixel, right, down, down-right, up-right."""
    _, height, width = smoothed.shape
    shifted = torch.zeros((4,) + tuple(smoothed.shape), dtype=smoothed.dtype)
    shifted[0, :, :, :-1] = smoothed[:, :, 1:]
    shifted[1, :, :-1, :] = smoothed[:, 1:, :]
    shifted[2, :, :-1, :-1] = smoothed[:, 1:, 1:]
    shifted[3, :, 1:, :-1] = smoothed[:, :-1, 1:]
    d = smoothed[None] - shifted
    sq = d * d
    weights = torch.sqrt((sq[:, 2] + sq[:, 1]) + sq[:, 0])   # (kind, H, W)
    rows = torch.arange(height)[:, None]
    cols = torch.arange(width)[None, :]
    valid = torch.stack([(cols < width - 1) & (rows >= 0), (rows < height - 1) & (cols >= 0),
                         (cols < width - 1) & (rows < height - 1), (cols < width - 1) & (rows > 0)])
    first = (rows * width + cols).expand(height, width)
    steps = torch.tensor([1, width, width + 1, 1 - width])
    keep = valid.permute(1, 2, 0).reshape(-1)
    a = first[:, :, None].expand(height, width, 4).reshape(-1)[keep]
    b = (first[:, :, None] + steps).reshape(-1)[keep]
    return weights.permute(1, 2, 0).reshape(-1)[keep].tolist(), a.tolist(), b.tolist()


def hickson_heap_sort(idx: list, keys: list, first: int, last: int):
    """libstdc++'s __partial_sort(first, last, last) of idx[first:last] by keys: make_heap, then sort_heap."""
    def adjust(hole, length, value):   # __adjust_heap, then __push_heap
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if keys[idx[first + child]] < keys[idx[first + child - 1]]:
                child -= 1
            idx[first + hole] = idx[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            idx[first + hole] = idx[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and keys[idx[first + parent]] < keys[value]:
            idx[first + hole] = idx[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        idx[first + hole] = value

    n = last - first
    if n >= 2:
        parent = (n - 2) // 2
        while True:
            adjust(parent, n, idx[first + parent])
            if parent == 0:
                break
            parent -= 1
    end = n
    while end > 1:
        end -= 1
        value = idx[first + end]
        idx[first + end] = idx[first]
        adjust(0, end, value)


def hickson_sort_order(keys: list) -> list:
    """The order in which libstdc++'s std::sort leaves items keyed by `keys` (compared with <): its
    __introsort_loop (median of three to the front, unguarded partition, heap sort at depth 2 log2 n), then
    the final insertion sort, which is a stable sort of what the loop left."""
    n = len(keys)
    idx = list(range(n))
    if n < 2:
        return idx
    pending = [(0, n, 2 * (n.bit_length() - 1))]
    while pending:
        first, last, depth = pending.pop()
        while last - first > 16:
            if depth == 0:
                hickson_heap_sort(idx, keys, first, last)
                break
            depth -= 1
            a, b, c = first + 1, first + (last - first) // 2, last - 1
            ka, kb, kc = keys[idx[a]], keys[idx[b]], keys[idx[c]]
            if ka < kb:
                median = b if kb < kc else (c if ka < kc else a)
            else:
                median = a if ka < kc else (c if kb < kc else b)
            idx[first], idx[median] = idx[median], idx[first]
            pivot = keys[idx[first]]
            lo, hi = first + 1, last
            while True:
                while keys[idx[lo]] < pivot:
                    lo += 1
                hi -= 1
                while pivot < keys[idx[hi]]:
                    hi -= 1
                if lo >= hi:
                    break
                idx[lo], idx[hi] = idx[hi], idx[lo]
                lo += 1
            pending.append((lo, last, depth))
            last = lo
    return sorted(idx, key=keys.__getitem__)


def hickson_root(parent: list, a: int) -> int:
    """The fork's universe::find: the component of `a`, halving the path on the way (parent[a] = its grandparent)."""
    while parent[a] != a:
        parent[a] = parent[parent[a]]
        a = parent[a]
    return a


def hickson_fh_segment(image, smoothing: float, k: float, min_size: int):
    """FHGraphSegment of a (3, H, W) float32 image -> (segment of each pixel (H * W,) int64, 0-based in raster
    order of first appearance, the segment count)."""
    _, height, width = image.shape
    mask = hickson_gauss_mask(smoothing)
    smoothed = torch.stack([hickson_smooth_rows(hickson_smooth_rows(image[c], mask), mask) for c in range(3)])
    weights, ends_a, ends_b = hickson_edges(smoothed)
    order = hickson_sort_order(weights)
    count = height * width
    c = hickson_f32(k)
    # k / size in float32 for every size a component can reach
    share = (torch.tensor(c, dtype=torch.float32) / torch.arange(1, count + 1, dtype=torch.float32)).tolist()
    parent = list(range(count))
    size = [1] * count
    threshold = [c] * count
    for e in order:
        a = hickson_root(parent, ends_a[e])
        b = hickson_root(parent, ends_b[e])
        w = weights[e]
        if a != b and w <= threshold[a] and w <= threshold[b]:
            if size[a] < size[b]:
                a, b = b, a
            parent[b] = a
            size[a] += size[b]
            threshold[a] = hickson_f32(w + share[size[a] - 1])
    for e in order:   # iJoin_graph: components under min_size join across the cheapest edges first
        a = hickson_root(parent, ends_a[e])
        b = hickson_root(parent, ends_b[e])
        if a != b and (size[a] < min_size or size[b] < min_size):
            if size[a] < size[b]:
                a, b = b, a
            parent[b] = a
            size[a] += size[b]
    number = [-1] * count
    segments = []
    total = 0
    for p in range(count):
        r = p
        while parent[r] != r:
            r = parent[r]
        if number[r] < 0:
            number[r] = total
            total += 1
        segments.append(number[r])
    return torch.tensor(segments, dtype=torch.int64), total


def hickson_segment_labels(label, boxes):
    """MostOccuringValue over each box (rows y .. y2 - 2, columns x .. x2 - 2) of a (H, W) label plane."""
    out = []
    for x, y, x2, y2 in boxes.tolist():
        width, height = x2 - x - 1, y2 - y - 1
        if x < 0 or y < 0 or width < 0 or height < 0:
            raise ValueError(f"OpenCV refuses the label crop x {x}, y {y}, width {width}, height {height} of a "
                             f"segment's box (the fork's crop is x2 - x - 1 wide): give bbox_extension > 0")
        region = label[y:y + height, x:x + width].reshape(-1)
        if not bool(((region > -1) & (region < 255)).all()):
            raise ValueError("labels must lie in 0..254 inside the segments' boxes (the fork counts them in a "
                             "255-slot table)")
        counts = torch.bincount(region.to(torch.int64), minlength=255)
        out.append(int(torch.argmax(counts)))
    return out


def hickson_segmentation(data, labels: torch.Tensor | None, smoothing: float, k: float, min_size: int,
                         extension: int, with_map: bool, first_rows: int):
    """The fork's Segmentation forward: [boxes (R, 5, 1, 1)] + [labels (R, 1, 1, 1)] + [map (N, 1, H, W)];
    `first_rows`, the rows its blob holds before the first forward."""
    device = data.device
    data = data.detach().to("cpu", torch.float32)
    n, _, height, width = data.shape
    if not bool(torch.isfinite(data[:, :3]).all()):
        raise ValueError("the data's first three channels must be finite (edge weights of NaN break std::sort)")
    rows, seg_labels, maps = [], [], []
    start = 0
    for i in range(n):
        segments, count = hickson_fh_segment(data[i, :3], smoothing, k, min_size)
        if i > 0 and start + count > first_rows:
            raise ValueError(f"image {i} brings the batch to {start + count} segments, past the {first_rows} rows "
                             f"the fork's blob first holds: growing it zeroes the earlier images' boxes, how many "
                             f"depending on earlier forwards; run one image at a time")
        xs = torch.arange(width).repeat(height)
        ys = torch.arange(height).repeat_interleave(width)
        low_x = torch.full((count,), width).scatter_reduce(0, segments, xs, "amin")
        low_y = torch.full((count,), height).scatter_reduce(0, segments, ys, "amin")
        high_x = torch.zeros(count, dtype=torch.int64).scatter_reduce(0, segments, xs, "amax")
        high_y = torch.zeros(count, dtype=torch.int64).scatter_reduce(0, segments, ys, "amax")
        x = torch.clamp(low_x - extension, min=0).clamp(max=width - 2)
        y = torch.clamp(low_y - extension, min=0).clamp(max=height - 2)
        x2 = torch.clamp(high_x + extension, min=1).clamp(max=width - 1)
        y2 = torch.clamp(high_y + extension, min=1).clamp(max=height - 1)
        boxes = torch.stack([x, y, x2, y2], 1)
        rows.append(torch.cat([torch.full((count, 1), float(i)), boxes.float()], 1))
        if labels is not None:
            seg_labels += hickson_segment_labels(labels[i, 0].detach().to("cpu", torch.float32), boxes)
        maps.append((segments + start).float().reshape(1, height, width))
        start += count
    tops = [torch.cat(rows).reshape(-1, 5, 1, 1).to(device)]
    if labels is not None:
        tops.append(torch.tensor(seg_labels, dtype=torch.float32).reshape(-1, 1, 1, 1).to(device))
    if with_map:
        tops.append(torch.stack(maps).to(device))
    return tops


TORCH_SEGMENTATION = torch_sources(hickson_f32, hickson_gauss_mask, hickson_smooth_rows, hickson_edges, hickson_root,
                                   hickson_heap_sort, hickson_sort_order, hickson_fh_segment,
                                   hickson_segment_labels, hickson_segmentation)


@register_layer("Segmentation")
class HicksonSegmentation(Layer):
    data_dependent_shape = True   # R rows: 100 until a forward counts the segments
    onnx_refusal = ("its Felzenszwalb-Huttenlocher segmentation (an introsort and a sequential union-find over "
                    "the pixel graph) has no ONNX form; export the rest of the net with --outputs")
    reading_note = ("Segmentation runs as GCC builds the fork by default: libstdc++'s std::sort orders equal edge "
                    "weights, and float32 sums are not fused into multiply-adds")

    def parse(self, lp):
        need_blobs(lp, "Segmentation", (1, 2), (1, 2, 3), "data, labels")
        if len(lp.bottom) == 2 and len(lp.top) == 1:
            raise LayerError("Segmentation with a label bottom writes the segments' labels to a second top: give "
                             "2 or 3 tops (boxes, labels[, map]); with one the fork writes past its tops")
        p = lp.seg_param
        for key in ("method", "bbox_extension", "min_size", "s", "m", "iter"):   # uint32 read into int
            if getattr(p, key) > INT_MAX:
                raise LayerError(f"seg_param.{key} must be < 2^31 (the fork reads it into an int and checks it "
                                 f"is not negative), got {getattr(p, key)}")
        if p.method > 1:
            raise LayerError(f"seg_param.method must be 0 (FH) or 1 (SLIC), got {p.method}")
        for key in ("smoothing", "k"):
            if not getattr(p, key) >= 0:
                raise LayerError(f"seg_param.{key} must be >= 0, got {getattr(p, key)}")
        return {"name": lp.name, "method": int(p.method), "smoothing": float(p.smoothing), "k": float(p.k),
                "max_k": float(p.max_k), "min_size": int(p.min_size), "extension": int(p.bbox_extension),
                "with_labels": len(lp.bottom) == 2, "num_tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Segmentation", "data bottom")
        if c < 3 or h * w < 2:
            raise LayerError(f"Segmentation segments the data's first 3 channels over 2 or more pixels, got "
                             f"{[n, c, h, w]}")
        if attrs["extension"] + max(h, w) - 1 > INT_MAX:
            raise LayerError(f"seg_param.bbox_extension {attrs['extension']} overflows the fork's int box corners")
        tops = [(FIRST_ROWS, 5, 1, 1)]
        if attrs["with_labels"]:
            ln, _, lh, lw = four_axes(in_shapes[1], "Segmentation", "labels bottom")
            if ln < n or (lh, lw) != (h, w):
                raise LayerError(f"Segmentation reads each image's label plane at the data's {h}x{w}: labels "
                                 f"(N >= {n}, C, {h}, {w}), got {list(in_shapes[1])}")
            tops.append((FIRST_ROWS, 1, 1, 1))
        elif attrs["num_tops"] == 3:   # Reshape sizes the labels top that this forward never writes
            tops.append((FIRST_ROWS, 1, 1, 1))
        if len(tops) < attrs["num_tops"]:
            tops.append((n, 1, h, w))
        return tops[:attrs["num_tops"]]

    def cannot_run(self, attrs, in_shapes):
        if attrs["method"] == 1:
            return ("seg_param.method 1 (SLIC) is unfinished in the fork: it gives no segments (and crashes "
                    "copying an empty segment map)")
        if attrs["max_k"] != 0:
            return "seg_param.max_k set: the fork draws each image's k with rand() seeded by the clock"
        if not attrs["with_labels"] and attrs["num_tops"] == 3:
            return "with one bottom the fork never writes its second top (segment labels): give 1 or 2 tops"
        return None

    def _args(self, attrs):
        return (attrs["smoothing"], attrs["k"], attrs["min_size"], attrs["extension"],
                attrs["num_tops"] == 3 or (attrs["num_tops"] == 2 and not attrs["with_labels"]), FIRST_ROWS)

    def forward(self, attrs, params, data, labels=None):
        self.refuse_if_cannot_run(attrs["name"], attrs, None, LayerError)
        try:
            tops = hickson_segmentation(data, labels, *self._args(attrs))
        except ValueError as e:
            raise LayerError(f"layer '{attrs['name']}' (Segmentation): {e}") from None
        return tuple(tops) if len(tops) > 1 else tops[0]

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, None, ExportError)
        fn = emit.helper(TORCH_SEGMENTATION)
        labels = emit.inputs[1] if node.attrs["with_labels"] else "None"
        args = ", ".join(emit.lit(v, exact=isinstance(v, float)) for v in self._args(node.attrs))
        out = emit.tmp("segments")
        emit.stmt(f"{out} = {fn}({emit.inputs[0]}, {labels}, {args})")
        return [f"{out}[{i}]" for i in range(len(node.outputs))]


@register_layer("LabelData")
class HicksonLabelData(ImageData):
    def parse(self, lp):
        need_blobs(lp, "LabelData (tops data, label)", 0, 2)
        p = lp.image_data_param
        if (p.new_height > 0) != (p.new_width > 0):
            raise LayerError("image_data_param.new_height and new_width must be set together (LabelData's CHECK)")
        if p.batch_size < 1:
            raise LayerError(f"image_data_param.batch_size must be > 0, got {p.batch_size}")
        notes = (["label_data_param is not read: the fork's LabelData reads image_data_param"]
                 if lp.HasField("label_data_param") else [])
        return {"source": p.source, "batch_size": int(p.batch_size), "new_height": int(p.new_height),
                "new_width": int(p.new_width), "is_color": bool(p.is_color), "new_dim": 0, "bicubic": False,
                "min_size": None, "root_folder": p.root_folder, "shuffle": bool(p.shuffle), "smaller_side": (),
                "label_dim": 0, "gps": False, "identities": None, "label_size": 0, "windows": None,
                "window_scales": (0.0, 0.0), "transform": transform_attrs(lp), "num_tops": 2, "top": lp.top[0],
                "own_size_unshuffled": False, "reading_notes": notes}

    def guessed_label_tops(self, attrs, given):
        return ()   # DataLayerSetUp shapes the label (batch_size,)


__all__ = ["HicksonLabelData", "HicksonSegmentation", "hickson_fh_segment", "hickson_sort_order"]
