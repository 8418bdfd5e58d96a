"""Fork fields met in the round-80 corpora: C3D's BlobProto.length (facebook/C3D 71336a2) and
GongCheng1919's compression fields (read and sized; layers that set them refuse to run or export)."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffeq.io.schema import caffe_pb2
from caffeq.io.writer import _blobproto_array
from caffeq.layers import LayerError
from caffeq.model import load_from_text


def test_c3d_blob_length_is_the_temporal_axis():
    # C3D's Blob::FromProto: a nonzero length gives num x channels x length x height x width
    bp = text_format.Parse("num: 2 channels: 3 length: 4 height: 1 width: 5 " + " ".join(
        f"data: {i}" for i in range(120)), caffe_pb2.BlobProto())
    arr = _blobproto_array(bp)
    assert arr.shape == (2, 3, 4, 1, 5)
    assert np.array_equal(arr.reshape(-1), np.arange(120, dtype=np.float32))


def test_compress_fields_read():
    lp = text_format.Parse('name: "c" type: "Convolution" weights_compress: "Ternary_Quantize" '
                           'weights_compress: "Quantize" weights_compress_param { maxbits: 8 } '
                           'activations_compress: "Quantize"', caffe_pb2.LayerParameter())
    assert list(lp.weights_compress) == ["Ternary_Quantize", "Quantize"]
    assert lp.weights_compress_param[0].maxbits == 8 and lp.activations_compress[0] == "Quantize"


COMPRESSED = """
layer { name: "data" type: "Data" top: "data" top: "label" activations_compress: "Quantize"
  data_param { source: "missing_lmdb" batch_size: 2 } transform_param { crop_size: 6 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" weights_compress: "Ternary_Quantize"
  weights_compress_param { maxbits: 2 } convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "plain" type: "Convolution" bottom: "conv" top: "plain" convolution_param { num_output: 2 kernel_size: 1 } }
"""


def test_compressed_layers_size_as_their_type_and_refuse_to_run(tmp_path):
    model = load_from_text(COMPRESSED, random_weights=True, input_shapes={"data": (2, 3, 6, 6), "label": (2,)})
    assert model.blob_shapes["conv"] == (2, 4, 4, 4) and model.blob_shapes["plain"] == (2, 2, 4, 4)
    assert any("rounds the data with uniform noise" in w for w in model.warnings)
    feeds = {"data": np.zeros((2, 3, 6, 6), np.float32), "label": np.zeros((2,), np.float32)}
    with pytest.raises(LayerError, match=r"layer 'conv' \(Convolution\): weights_compress \['Ternary_Quantize'\].*"
                                         r"does not run or export it"):
        model.run(feeds)
    with pytest.raises(Exception, match="weights_compress"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    # without the fields the same layers run
    plain = load_from_text(COMPRESSED.replace(' weights_compress: "Ternary_Quantize"', "")
                           .replace("weights_compress_param { maxbits: 2 } ", ""), random_weights=True,
                           input_shapes={"data": (2, 3, 6, 6), "label": (2,)})
    assert plain.run(feeds)["plain"].shape == (2, 2, 4, 4)
