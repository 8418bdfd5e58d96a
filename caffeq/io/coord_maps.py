"""The offsets of the V1 CROP layer of DeconvNet / FCN (HyeonwooNoh/caffe, after longjon's FCN caffe).

That CROP has no parameters: at setup it walks back from each of its two bottoms along the
first-bottom chain of the layers that made them (util/coords.hpp, crop_layer.cpp):

- each layer maps top coordinates to bottom coordinates by a per-axis affine map (a, b):
  Convolution and Pooling give FilterMap⁻¹, Deconvolution and Unpooling give FilterMap, with
  FilterMap = (stride, (kernel - 1) / 2 - pad); neuron layers, Concat, Eltwise, LRN, Softmax,
  Split, Slice and MVN give the identity; a CROP gives (1, -offset); any other layer has none
  (Caffe stops with NOT_IMPLEMENTED);
- the two chains meet at the first blob of bottom 1's chain that bottom 0's chain passes;
- crop = map₁ ∘ map₀⁻¹ must have scale 1 and an integer shift <= 0; the offset is -shift.

The top is then bottom 0[..., off_h : off_h + H₁, off_w : off_w + W₁], which is BVLC's Crop with
axis 2 and those two offsets, so resolve_coord_map_crops rewrites each such layer into that.
"""
from fractions import Fraction

from ..errors import ParseError

_IDENTITY_TYPES = frozenset({"ReLU", "Sigmoid", "TanH", "AbsVal", "BNLL", "Dropout", "DropoutChannel", "Exp",
                             "Power", "Threshold", "Concat", "Eltwise", "LRN", "Softmax", "Split", "Slice",
                             "MVN"})


def _compose(left, right):
    return [(la * ra, la * rb + lb) for (la, lb), (ra, rb) in zip(left, right)]


def _inverse(m):
    return [(1 / a, -b / a) for a, b in m]


def _pair(param, name, default):
    """(h, w) of a kernel / stride / pad given as a scalar, a repeated value or _h/_w."""
    stem = "kernel" if name == "kernel_size" else name
    fields = param.DESCRIPTOR.fields_by_name
    if f"{stem}_h" in fields and param.HasField(f"{stem}_h"):
        return int(getattr(param, f"{stem}_h")), int(getattr(param, f"{stem}_w"))
    value = getattr(param, name)
    if isinstance(value, int):
        value = [value] if param.HasField(name) else []
    value = list(value)
    if not value:
        return default, default
    return (int(value[0]), int(value[-1])) if len(value) <= 2 else (None, None)


def _filter_map(param, layer):
    k, s, p = _pair(param, "kernel_size", None), _pair(param, "stride", 1), _pair(param, "pad", 0)
    if None in k + s + p:
        raise ParseError(f"layer '{layer.name}' ({layer.type}): the V1 CROP needs its 2-D kernel, stride "
                         f"and pad")
    return [(Fraction(st), Fraction(kk - 1, 2) - pp) for kk, st, pp in zip(k, s, p)]


def _coord_map(layer, index, offsets):
    t = layer.type
    if t in _IDENTITY_TYPES:
        return [(Fraction(1), Fraction(0))] * 2
    if t in ("Convolution", "Pooling"):
        return _inverse(_filter_map(layer.convolution_param if t == "Convolution" else layer.pooling_param,
                                    layer))
    if t == "Deconvolution":
        return _filter_map(layer.convolution_param, layer)
    if t == "Unpooling":
        return _filter_map(layer.unpooling_param, layer)
    if index in offsets:   # a V1 CROP rewritten above
        return [(Fraction(1), Fraction(-o)) for o in offsets[index]]
    return None


def resolve_coord_map_crops(net, where, notes):
    """Rewrite every CoordMapCrop layer of an upgraded net into a BVLC Crop with the fork's offsets."""
    return _resolve_crops(net, where, notes, "CoordMapCrop", "V1 CROP", _coord_map)


def resolve_auto_crops(net, where, notes):
    """Rewrite every RCF AutoCrop layer (yun-liu/RCF auto_crop_layer.cpp) into a BVLC Crop.

    AutoCrop is the V1 CROP above under a V2 name, with RCF's own coordinate maps: convolution and
    deconvolution use the dilated kernel extent d (k - 1) + 1; PReLU, ELU and Log are neuron layers
    (identity); a BVLC Crop maps by (1, -offsets[0]), (1, -offsets[1]), the offsets of its first two
    *axes* (crop_layer.hpp), which are 0 unless crop_param.axis < 2.
    """
    return _resolve_crops(net, where, notes, "AutoCrop", "AutoCrop", _rcf_coord_map)


_RCF_IDENTITY_TYPES = _IDENTITY_TYPES - {"DropoutChannel"} | {"ELU", "Log", "PReLU"}


def _dilated_filter_map(param, layer):
    k, s, p = _pair(param, "kernel_size", None), _pair(param, "stride", 1), _pair(param, "pad", 0)
    d = _pair(param, "dilation", 1)
    if None in k + s + p + d:
        raise ParseError(f"layer '{layer.name}' ({layer.type}): RCF's AutoCrop needs its 2-D kernel, "
                         f"stride, pad and dilation")
    return [(Fraction(st), Fraction(dd * (kk - 1), 2) - pp) for kk, st, pp, dd in zip(k, s, p, d)]


def _bvlc_crop_axis_offsets(param):
    """The offsets BVLC's Crop keeps for axes 0 and 1 (crop_layer.cpp: 0 before crop_param.axis)."""
    axis, given = int(param.axis), list(param.offset)
    if axis < 0:
        axis += 4   # RCF crops 4-axis blobs; a negative axis counts from the end
    found = []
    for i in (0, 1):
        if i < axis or not given:
            found.append(0)
        else:
            found.append(int(given[0] if len(given) == 1 else given[i - axis]))
    return found


def _rcf_coord_map(layer, index, offsets):
    t = layer.type
    if t in _RCF_IDENTITY_TYPES:
        return [(Fraction(1), Fraction(0))] * 2
    if t == "Convolution":
        return _inverse(_dilated_filter_map(layer.convolution_param, layer))
    if t == "Deconvolution":
        return _dilated_filter_map(layer.convolution_param, layer)
    if t == "Pooling":
        if layer.pooling_param.global_pooling:
            raise ParseError(f"layer '{layer.name}' (Pooling): a global pooling on the way back from an "
                             f"AutoCrop's bottoms has a kernel only the input size fixes")
        return _inverse(_filter_map(layer.pooling_param, layer))
    if t == "Crop" and index not in offsets:
        return [(Fraction(1), Fraction(-o)) for o in _bvlc_crop_axis_offsets(layer.crop_param)]
    if index in offsets:   # an AutoCrop rewritten above
        return [(Fraction(1), Fraction(-o)) for o in offsets[index]]
    return None


def _resolve_crops(net, where, notes, crop_type, label, coord_map):
    layers = list(net.layer)
    producer = {}
    for i, lp in enumerate(layers):
        for top in lp.top:
            producer.setdefault(top, i)   # the first layer to write a blob (in-place ones skipped)
    offsets = {}   # layer index -> (h, w) offsets: FCN names all its crops 'crop'
    for index, lp in enumerate(layers):
        if lp.type != crop_type:
            continue
        if len(lp.bottom) != 2 or len(lp.top) != 1:
            raise ParseError(f"{where}: layer '{lp.name}' ({label}) takes two bottoms and one top")

        def chain(blob):
            blobs = [blob]
            while blob in producer and len(layers[producer[blob]].bottom):
                blob = layers[producer[blob]].bottom[0]
                blobs.append(blob)
            return blobs

        first = chain(lp.bottom[0])
        meet = next((b for b in chain(lp.bottom[1]) if b in first), None)
        if meet is None:
            raise ParseError(f"{where}: layer '{lp.name}' ({label}): its bottoms '{lp.bottom[0]}' and "
                             f"'{lp.bottom[1]}' share no earlier blob, so the fork cannot align them")
        maps = []
        for blob in lp.bottom[:2]:
            m = [(Fraction(1), Fraction(0))] * 2
            while blob != meet:
                layer = layers[producer[blob]]
                step = coord_map(layer, producer[blob], offsets)
                if step is None:
                    raise ParseError(f"{where}: layer '{lp.name}' ({label}): layer '{layer.name}' "
                                     f"({layer.type}) on the way from '{lp.bottom[0]}' / '{lp.bottom[1]}' "
                                     f"back to '{meet}' has no coordinate map in the fork")
                m = _compose(m, step)
                blob = layer.bottom[0]
            maps.append(m)
        crop = _compose(maps[1], _inverse(maps[0]))
        found = []
        for axis, (a, b) in zip("hw", crop):
            if a != 1 or b > 0 or b.denominator != 1:
                raise ParseError(f"{where}: layer '{lp.name}' ({label}): the {axis} coordinate map from "
                                 f"'{lp.bottom[0]}' to '{lp.bottom[1]}' is {float(a):g} x + {float(b):g}; "
                                 f"the fork needs scale 1 and a whole shift <= 0")
            found.append(int(-b))
        offsets[index] = found
        lp.type = "Crop"
        lp.crop_param.axis = 2
        lp.crop_param.ClearField("offset")
        lp.crop_param.offset.extend(found)
        notes.append(f"{where}: {label} layer '{lp.name}' takes offsets (h {found[0]}, w {found[1]}) "
                     f"from the coordinate maps back to '{meet}', as the fork computes them; it is a "
                     f"Crop with those offsets")
    return notes
