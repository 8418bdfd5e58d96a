"""MehdiNoroozi/JigsawPuzzleSolver's MergeData (caffe-master-jps++ 8c7ec09, merge_data_layer.cpp/.cu): read and
sized, not run.

Bottoms: K puzzle tiles, then K tiles of another image; tops: K tiles (bottom 0's shape) and sub_num (N, 1).
Each forward, TEST included, puts rand() % max_substitute + min_substitute tiles of the second image in
random slots (libc rand(); caffeq does not draw it).  The Data layer before it crops its tiles at random too.
"""
from .registry import LayerError, ReadOnlyLayer, register_layer


@register_layer("MergeData")
class MergeData(ReadOnlyLayer):
    def parse(self, lp):
        k = len(lp.bottom) // 2
        if k < 1 or len(lp.bottom) != 2 * k or len(lp.top) != k + 1:
            raise LayerError(f"MergeData takes 2K bottoms (K tiles, then K substitutes) and K + 1 tops (the tiles "
                             f"and sub_num), got {len(lp.bottom)} and {len(lp.top)}")
        return {"name": lp.name, "tiles": k}

    def infer(self, attrs, in_shapes):
        first = tuple(in_shapes[0])
        if not first:
            raise LayerError("MergeData's tiles need a batch axis")
        return [first] * attrs["tiles"] + [(first[0], 1)]

    def why_not_run(self, attrs):
        return ("it puts a random number of the second image's tiles in random slots at every forward, TEST "
                "included (libc rand()); caffeq does not draw them")
