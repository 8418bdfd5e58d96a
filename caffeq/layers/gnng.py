"""herenvarno/gnng's MemoryData (cb711ed, gnng.20160512/src/caffe/layers/memory_data_layer.cu,
include/caffe/layers/memory_data_layer.hpp; GPU_COUNT = 2 in include/caffe/common.hpp, the same in gnng_ppl/).

gnng maps a LeNet onto GPU_COUNT GPUs, one copy of every blob per GPU: its MemoryData makes 2 x GPU_COUNT
= 4 tops (ExactNumTopBlobs), GPU_COUNT data tops, then GPU_COUNT label tops.  memory_data_param is BVLC's
(batch_size, channels, height, width, the same numbers).  DataLayerSetUp shapes each data top (batch_size,
channels, height, width) and each label top (batch_size,); its Forward_gpu points every data top at the
same batch (and reshapes the labels (batch_size, 1, 1, 1)).  caffeq reads the tops as graph inputs with
the setup's shapes; the data tops are separate inputs, so a note says to feed them the same array.
"""
from .data import MemoryData
from .registry import LayerError, claim_layers

GNNG_GPU_COUNT = 2


def _gnng_memory_data(lp):
    """gnng's reader by its top count, 2 x GPU_COUNT (BVLC's makes 2, DeepLab's readers 3)."""
    return len(lp.top) == 2 * GNNG_GPU_COUNT


@claim_layers("MemoryData", _gnng_memory_data)
class GnngMemoryData(MemoryData):
    reading_note = (f"herenvarno/gnng's MemoryData: {GNNG_GPU_COUNT} data tops then {GNNG_GPU_COUNT} label "
                    f"tops, one per GPU; the fork gives every data top the same batch, so feed each the same "
                    f"array")

    def parse(self, lp):
        attrs = super().parse(lp)
        c, h, w = attrs["chw"]
        if attrs["dims"]:
            raise LayerError("memory_data_param.dim is naibaf7/caffe's N-D shape; gnng's message has no such "
                             "field: give batch_size, channels, height and width")
        if attrs["batch_size"] * c * h * w <= 0:
            raise LayerError("memory_data_param.batch_size, channels, height and width must be given and "
                             "positive (gnng's DataLayerSetUp checks their product)")
        return attrs

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or self.data_shape(attrs))
        shapes = [tuple(given.get(i) or data) for i in range(GNNG_GPU_COUNT)]
        return shapes + [tuple(given.get(i) or (data[0],)) for i in range(GNNG_GPU_COUNT, 2 * GNNG_GPU_COUNT)]

    def guessed_label_tops(self, attrs, given):
        return ()   # the fork's setup shapes them (batch_size,)
