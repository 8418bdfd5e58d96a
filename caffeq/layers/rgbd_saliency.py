"""sshige/rgbd-saliency's superpixel feature layers (ae7740c caffe/src/caffe/layers; its RGBDNet test and
training nets), read and sized but not run: all three have only a GPU forward, a port of gSLICr's SLIC
superpixels with OpenCV's 8-bit HSV and Lab conversions of the mean-restored image, which caffeq does not
reproduce.  gylee1103/ELDNet 28bae54 (caffe/src/caffe/layers), the ELD saliency net these layers come from,
has the same GenSlicinfo and a LowlevelDistance with two tops: its kernel writes the features and labels only,
the third top (the regions' superpixel indices, which sshige's LowlevelDepth reads) is sshige's addition.

- GenSlicinfo (gen_slicinfo_param): image (N, 3, H, W), H = image_size (the fork's CHECK; its kernels take the
  width to be the same) -> superpixel ids (N, 1, H, W) and dead-superpixel flags (N, 1, M, M),
  M = image_size / slic_size.
- LowlevelDistance (lowlevel_distance_param): image, ids, flags (and a training label map; both forks take 3 or
  more bottoms and read 4) -> region features (N R, D, G, G), region labels (N R) and, in sshige's form, the
  regions' superpixel indices (N R); ELDNet's takes exactly 2 tops, sshige's exactly 3.  G = grid_size, R =
  train_region_per_image or, when 0, every superpixel (M M from the flags' shape); D by feature_option:
  164 (0, and any unknown value), 2 (1), 20 (2) or 29 (3).
- LowlevelDepth (lowlevel_depth_param): depth, fill, gap images (3 channels each), ids, flags and the
  region indices -> (N R, 10, G, G).
"""
from .registry import AT_LEAST, LayerError, ReadOnlyLayer, need_blobs, register_layer

_FEATURES = {0: 164, 1: 2, 2: 20, 3: 29}
WHY = ("sshige/rgbd-saliency's GPU-only superpixel features (as gylee1103/ELDNet's; a gSLICr port with OpenCV's "
       "colour conversions), which caffeq reads and sizes but does not compute")


def _regions(attrs, shapes, flags_at):
    n = shapes[0][0]
    flags = shapes[flags_at]
    if len(flags) != 4:
        raise LayerError(f"bottom {flags_at} (the dead-superpixel flags) must have 4 axes, got {list(flags)}")
    per_image = attrs["regions"] or flags[2] * flags[3]
    return n * per_image


def _grid_params(p, what):
    if p.grid_size < 1:
        raise LayerError(f"{what}.grid_size must be >= 1, got {p.grid_size}")
    return {"grid": int(p.grid_size), "regions": int(p.train_region_per_image)}


class _SuperpixelLayer(ReadOnlyLayer):
    def why_not_run(self, attrs):
        return WHY


@register_layer("GenSlicinfo")
class GenSlicinfo(_SuperpixelLayer):
    def parse(self, lp):
        need_blobs(lp, "GenSlicinfo", 1, 2)
        p = lp.gen_slicinfo_param
        if p.slic_size < 1 or p.image_size < p.slic_size:
            raise LayerError(f"gen_slicinfo_param: slic_size ({p.slic_size}) must be 1 to image_size ({p.image_size})")
        return {"name": lp.name, "image_size": int(p.image_size), "cells": int(p.image_size // p.slic_size)}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4 or s[1] != 3 or s[2] != attrs["image_size"] or s[3] != attrs["image_size"]:
            raise LayerError(f"GenSlicinfo takes a 3-channel {attrs['image_size']}x{attrs['image_size']} image "
                             f"(gen_slicinfo_param.image_size; the fork's kernels take the width to be the height), "
                             f"got {list(s)}")
        m = attrs["cells"]
        return [(s[0], 1, s[2], s[3]), (s[0], 1, m, m)]


@register_layer("LowlevelDistance")
class LowlevelDistance(_SuperpixelLayer):
    def parse(self, lp):
        # ExactNumTopBlobs: 2 in gylee1103/ELDNet, 3 in sshige/rgbd-saliency (its region indices)
        need_blobs(lp, "LowlevelDistance", range(3, AT_LEAST), (2, 3))
        p = lp.lowlevel_distance_param
        attrs = _grid_params(p, "lowlevel_distance_param")
        attrs.update(name=lp.name, channels=_FEATURES.get(int(p.feature_option), 164), tops=len(lp.top))
        return attrs

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) != 4 or in_shapes[0][1] != 3:
            raise LayerError(f"LowlevelDistance's image must be (N, 3, H, W), got {list(in_shapes[0])}")
        rows = _regions(attrs, in_shapes, 2)
        return [(rows, attrs["channels"], attrs["grid"], attrs["grid"])] + [(rows,)] * (attrs["tops"] - 1)


@register_layer("LowlevelDepth")
class LowlevelDepth(_SuperpixelLayer):
    def parse(self, lp):
        need_blobs(lp, "LowlevelDepth", 6, 1)
        p = lp.lowlevel_depth_param
        attrs = _grid_params(p, "lowlevel_depth_param")
        attrs["name"] = lp.name
        return attrs

    def infer(self, attrs, in_shapes):
        for i, what in enumerate(("depth", "fill", "gap")):
            if len(in_shapes[i]) != 4 or in_shapes[i][1] != 3:
                raise LayerError(f"LowlevelDepth's {what} image must be (N, 3, H, W), got {list(in_shapes[i])}")
        return [(_regions(attrs, in_shapes, 4), 10, attrs["grid"], attrs["grid"])]


__all__ = ["GenSlicinfo", "LowlevelDepth", "LowlevelDistance"]
