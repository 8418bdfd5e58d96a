"""SSD's non-maximum suppression (ApplyNMSFast) in float32 torch; also copied into model.py."""

import torch

from ..registry import torch_sources


def box_sizes(b, pixel: bool = False):
    """SSD's BBoxSize of normalized boxes (..., 4): 0 for a box with xmax < xmin or ymax < ymin.
    pixel (OpenCV's normalized_bbox: false): the inclusive pixel size (w + 1)(h + 1), w and h first."""
    w = b[..., 2] - b[..., 0]
    h = b[..., 3] - b[..., 1]
    size = (w + 1) * (h + 1) if pixel else w * h
    return torch.where((w < 0) | (h < 0), torch.zeros_like(w), size)


def jaccard_overlaps(a, b, size_a, size_b, pixel: bool = False):
    """SSD's JaccardOverlap of boxes a (M, 4) against b (K, 4) -> (M, K), float32.  Disjoint (and
    flipped) boxes have a non-positive intersection width or height: IoU 0.  pixel (OpenCV's
    JaccardOverlap<false>): the intersection is the pixel size of the intersection box, (iw + 1)(ih + 1),
    0 where iw < 0 or ih < 0 (boxes that touch share one pixel row; a gap under one pixel shares none)."""
    iw = torch.minimum(a[:, None, 2], b[None, :, 2]) - torch.maximum(a[:, None, 0], b[None, :, 0])
    ih = torch.minimum(a[:, None, 3], b[None, :, 3]) - torch.maximum(a[:, None, 1], b[None, :, 1])
    if pixel:
        inter = torch.where((iw < 0) | (ih < 0), torch.zeros_like(iw), (iw + 1) * (ih + 1))
    else:
        inter = torch.clamp(iw, min=0) * torch.clamp(ih, min=0)
    union = size_a[:, None] + size_b[None, :] - inter
    return torch.where(inter > 0, inter / union, torch.zeros_like(inter))


def overlaps_with_later(b, sizes, full, j: int, pixel: bool = False):
    """IoU of candidate j with each candidate after it: a row of the whole matrix `full` where it
    was computed, else computed on the spot."""
    if full is not None:
        return full[j, j + 1:]
    return jaccard_overlaps(b[j:j + 1], b[j + 1:], sizes[j:j + 1], sizes[j + 1:], pixel)[0]


def nms_candidates(scores, score_threshold: float, top_k: int):
    """SSD's GetMaxScoreIndex: the indices scoring above score_threshold (float32), best first, ties by
    index, at most top_k of them (-1: all)."""
    cand = torch.nonzero(scores > torch.tensor(score_threshold, dtype=torch.float32)).flatten()
    order = cand[torch.sort(-scores[cand], stable=True)[1]]
    return order[:top_k] if top_k > -1 else order


def ssd_nms(boxes, scores, score_threshold: float, nms_threshold: float, eta: float = 1.0,
            top_k: int = -1, pixel: bool = False):
    """SSD's ApplyNMSFast for one class: boxes (P, 4), scores (P,) -> the indices kept, best first.

    The candidates score above score_threshold, best first (ties: lower index first), at most
    top_k of them (-1: all).  A candidate is kept when its IoU with every box kept before it is
    <= the threshold in force; with eta < 1 the threshold shrinks by eta after each kept box
    while it is above 0.5.  Up to 2048 candidates the whole IoU matrix is computed at once.
    pixel: OpenCV's pixel sizes and overlaps (box_sizes, jaccard_overlaps)."""
    f32 = torch.float32
    order = nms_candidates(scores, score_threshold, top_k)
    if order.numel() == 0:
        return []
    b = boxes[order]
    sizes = box_sizes(b, pixel)
    k = order.numel()
    full = jaccard_overlaps(b, b, sizes, sizes, pixel) if k <= 2048 else None
    thr = torch.tensor(nms_threshold, dtype=f32)
    picked = order.tolist()
    kept = []
    if eta >= 1:
        # a fixed threshold: each kept box strikes out the later ones it overlaps too much
        struck = [False] * k
        for j in range(k):
            if struck[j]:
                continue
            kept.append(picked[j])
            if j + 1 < k:
                row = overlaps_with_later(b, sizes, full, j, pixel)
                for i in torch.nonzero(row > thr).flatten().tolist():
                    struck[j + 1 + i] = True
        return kept
    # adaptive (eta < 1): each candidate's largest IoU with a kept box so far, against the threshold
    # in force when it is examined
    worst = torch.zeros(k, dtype=f32)
    for j in range(k):
        if worst[j] > thr:
            continue
        kept.append(picked[j])
        if j + 1 < k:
            worst[j + 1:] = torch.maximum(worst[j + 1:], overlaps_with_later(b, sizes, full, j, pixel))
        if thr > 0.5:
            thr = thr * torch.tensor(eta, dtype=f32)
    return kept


TORCH_SSD_NMS = torch_sources(box_sizes, jaccard_overlaps, overlaps_with_later, nms_candidates, ssd_nms)
