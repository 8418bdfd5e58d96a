"""The input size a net's shapes fit, for the error when the size its file declares does not.

Deploy files copied between projects often keep a placeholder size (PSPNet's `dim: 100` where the
net's fixed pooling needs 473): Caffe refuses them, and so does caffeq, but the error can say which
size works, so the user only has to pass --input-shape.
"""
import time

from .errors import CaffeqError

# sides real nets are trained at, tried nearest the declared side first
COMMON_SIDES = (32, 64, 96, 112, 128, 160, 192, 224, 227, 256, 288, 299, 300, 320, 321, 368, 384, 416,
                448, 473, 480, 500, 512, 513, 544, 576, 600, 608, 640, 713, 800, 1024)
_BUDGET_S = 2.0    # an error path: give up rather than keep the user waiting


def declared_image_input(net):
    """(top name, its declared N, C, H, W) of the net's one 4-D Input, or None."""
    found = []
    for lp in net.layer:
        if lp.type != "Input":
            continue
        shapes = list(lp.input_param.shape)
        for i, top in enumerate(lp.top):
            shape = shapes[i] if i < len(shapes) else (shapes[0] if len(shapes) == 1 else None)
            if shape is not None and len(shape.dim) == 4 and min(shape.dim) >= 0:   # -1: left to --input-shape
                found.append((top, tuple(int(d) for d in shape.dim)))
    return found[0] if len(found) == 1 else None


def candidate_sides(declared):
    """Square sides to try for a declared side: the common ones and the declared side rounded up to
    the strides nets downsample by.  Not one off the declared side: a net that fits 417 but not 416
    is a converted net whose layers mean something else in the fork it came from, not a wrong size."""
    rounded = {-(-declared // m) * m for m in (8, 16, 32, 64)}
    sides = set(COMMON_SIDES) | rounded
    return sorted((s for s in sides if abs(s - declared) > 1), key=lambda s: (abs(s - declared), s))


def fitting_input_hint(net, build, input_shapes):
    """'; ... pass --input-shape ...' naming the square input size nearest the declared one at which
    build({top: shape}) succeeds, or '' when the user chose the size, or none fits in the budget."""
    found = declared_image_input(net)
    if found is None:
        return ""
    top, (n, c, h, w) = found
    if top in (input_shapes or {}) or h in COMMON_SIDES or w in COMMON_SIDES:
        # a size nets are trained at is no placeholder: the layers mean something else (a fork's)
        return ""
    deadline = time.monotonic() + _BUDGET_S
    for side in candidate_sides(max(h, w)):
        if time.monotonic() > deadline:
            return ""
        try:
            build(dict(input_shapes or {}, **{top: (n, c, side, side)}))
        except CaffeqError:
            continue
        return (f"; the file declares {top} {n}x{c}x{h}x{w}, and the net fits {side}x{side}: "
                f"pass --input-shape {top}={n},{c},{side},{side}")
    return ""
