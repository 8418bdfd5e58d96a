"""PVANet's sort_box (sanghoon/caffe dev_pvanet 6068dd0, src/caffe/layers/proposal_layer.cpp): the
order its partial quicksort leaves proposals in, equal scores included (torch and model.py)."""
import torch


def pva_sort_order(scores, num_top: int):
    """Indices of the first min(len, num_top) proposals after PVANet's sort_box(list, 0, n - 1,
    num_top): a quicksort, best first, pivot the segment's first box, Hoare scans (left skips >= pivot,
    right skips <= pivot), the pivot swapped to `right`; the right part sorted only while it starts
    before num_top.  Without equal scores (or NaN) up to the cut this is the descending sort; with
    them the quicksort itself runs, on Python floats."""
    n = scores.shape[0]
    k = min(n, num_top)
    order = torch.sort(scores, descending=True, stable=True)[1]
    vals = scores[order]
    m = min(k, n - 1)   # no pair (i, i + 1) of equal scores with i < k
    has_nan = bool(torch.isnan(scores).any())
    if not has_nan and bool((vals[:m] != vals[1:m + 1]).all()):
        return order[:k]
    s, idx = scores.tolist(), list(range(n))
    stack = [(0, n - 1)]
    while stack:
        start, end = stack.pop()
        if not has_nan and end > start and s[start] >= max(s[start + 1:end + 1]):
            # a pivot no later score exceeds moves nothing: the scans only go on with the next box as
            # pivot.  Such a run (the zeros of removed boxes when fewer than num_top are left) took one
            # Python scan per box, minutes on a large map; skipped here at once
            later = torch.tensor(s[start + 1:end + 1], dtype=torch.float64)
            highest_after = later.flip(0).cummax(0).values.flip(0).tolist()   # [j]: max(s[first + 1 + j:])
            first = start
            while start + 1 < num_top and start + 1 < end:
                start += 1
                if s[start] < highest_after[start - first]:
                    break
            else:
                continue
        pivot, left, right = s[start], start + 1, end
        while left <= right:
            while left <= end and s[left] >= pivot:
                left += 1
            while right > start and s[right] <= pivot:
                right -= 1
            if left <= right:
                s[left], s[right], idx[left], idx[right] = s[right], s[left], idx[right], idx[left]
                left, right = left + 1, right - 1
        if right > start:
            s[start], s[right], idx[start], idx[right] = s[right], s[start], idx[right], idx[start]
        if start < right - 1:
            stack.append((start, right - 1))
        if right + 1 < num_top and right + 1 < end:
            stack.append((right + 1, end))
    return torch.tensor(idx[:k], dtype=torch.long, device=scores.device)
