"""MehdiNoroozi/JigsawPuzzleSolver's fork fields: the Data layer's puzzle tiles on the channels (caffeq/layers/data.py)
and MergeData, read and sized but not run (caffeq/layers/jigsaw.py)."""
import numpy as np
import pytest
from conftest import net

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

DATA = ('layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }} transform_param {{ '
        'mirror: false crop_size: 225 mean_value: 104 mean_value: 117 mean_value: 123 hash_file: "hash.bin" '
        'siamese_size: 9 patch_size: {p} jitter_size: 7 }} data_param {{ source: "lmdb" batch_size: 5 '
        'backend: LMDB rand_jump: 1 }} }}')
SLICE = ('layer { name: "slice_pair_0" type: "Slice" bottom: "data" top: "a" top: "b" slice_param { '
         'axis: 1 slice_point: 12 } }')


def test_the_puzzle_data_stacks_nine_tiles_on_the_channels():
    # DataTransformer::InferBlobShape: (N, channels x siamese_size, patch_size, patch_size); 27 channels slice at 12
    model = load_from_text(net(DATA.format(p=64), SLICE, inputs={}))
    assert model.blob_shapes["data"] == (5, 27, 64, 64)
    assert model.blob_shapes["a"] == (5, 12, 64, 64) and model.blob_shapes["b"] == (5, 15, 64, 64)


def test_merge_data_is_sized_and_refused_at_run():
    tiles = {f"t{i}": (2, 3, 4, 4) for i in range(4)}
    text = net('layer { name: "merge" type: "MergeData" bottom: "t0" bottom: "t1" bottom: "t2" bottom: "t3" '
               'top: "m0" top: "m1" top: "sub_num" merge_data_param { min_substitute: 0 max_substitute: 3 } }',
               inputs=tiles)
    model = load_from_text(text)
    assert model.blob_shapes["m1"] == (2, 3, 4, 4) and model.blob_shapes["sub_num"] == (2, 1)
    with pytest.raises(CaffeqError, match="random number of the second image's tiles"):
        model.run({k: np.zeros(s, np.float32) for k, s in tiles.items()})
    with pytest.raises(CaffeqError, match="2K bottoms"):
        load_from_text(net('layer { name: "merge" type: "MergeData" bottom: "t0" bottom: "t1" bottom: "t2" '
                           'top: "m0" top: "sub_num" }', inputs={k: tiles[k] for k in ("t0", "t1", "t2")}))
