"""dengshuo/D-M-F-ConvNets' DeformableConvolution (sized, refused) and herenvarno/gnng's 4-top MemoryData."""
import numpy as np
import pytest
from conftest import REPO, cli_process, net, node_of, ok
from test_layers_deformable_conv import deform_model, layer

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
REALWORLD = REPO / "tests" / "fixtures" / "realworld"


@pytest.mark.parametrize("param, x_shape, off_shape, y_shape", [
    # offsets from a plain convolution, another size than the data: only the data shapes the top
    ("num_output: 2 kernel_size: 5", (2, 6, 9, 7), (2, 5, 4, 3), (2, 2, 5, 3)),
    ("num_output: 4 kernel_h: 3 kernel_w: 2 stride: 2 pad: 1 group: 2 bias_term: false", (3, 4, 7, 10),
     (1, 7, 2, 2), (3, 4, 4, 6)),
])
def test_dengshuo_deformable_is_sized_not_run(param, x_shape, off_shape, y_shape, tmp_path):
    model, node = deform_model(param, x_shape, off_shape)
    assert model.blob_shapes["y"] == y_shape and node.attrs["dengshuo"]
    kh, kw = node.attrs["kernel"]
    assert node.blobs[0].shape == (y_shape[1], x_shape[1] // node.attrs["group"], kh, kw)
    assert len(node.blobs) == (2 if node.attrs["bias_term"] else 1)
    feeds = {"x": np.zeros(x_shape, F32), "o": np.zeros(off_shape, F32)}
    why = r"layer 'd' \(DeformableConvolution\): dengshuo/D-M-F-ConvNets' forward is unfinished"
    with pytest.raises(LayerError, match=why):
        model.run(feeds)
    with pytest.raises(ExportError, match=why):
        model.export_onnx(tmp_path / "m.onnx")
    with pytest.raises(ExportError, match=why):
        model.export_pytorch(tmp_path / "model.py")


def test_other_deformable_layers_read_as_before(tmp_path):
    """Offsets of 2 x 3 x 3 x 4 channels are SAR_plane's / Xdet's (group 4): they run, or keep those forks'
    errors; a deformable_group in the file is never dengshuo's."""
    model, node = deform_model("num_output: 2 kernel_size: 3 pad: 1", (1, 4, 5, 6), (1, 72, 5, 6))
    assert not node.attrs["dengshuo"] and model.run({"x": np.ones((1, 4, 5, 6), F32),
                                                    "o": np.zeros((1, 72, 5, 6), F32)})["y"].shape == (1, 2, 5, 6)
    with pytest.raises(LayerError, match="must have the data's height and width 8 x 8"):
        load_from_text(net(layer("num_output: 4 kernel_size: 3"), inputs={"x": (1, 8, 8, 8), "o": (1, 72, 4, 4)}))
    with pytest.raises(LayerError, match="need 2 x kernel_h x kernel_w x deformable_group = 2 x 3 x 3 x 4 = 72 "
                                         "channels, got 32"):
        load_from_text(net(layer("num_output: 4 kernel_size: 3 deformable_group: 4"),
                           inputs={"x": (1, 8, 8, 8), "o": (1, 32, 8, 8)}))


def test_dengshuo_deformable_bad_groups():
    with pytest.raises(LayerError, match=r"layer 'd' \(DeformableConvolution\).*num_output 3 not divisible by "
                                         r"group 2"):
        load_from_text(net(layer("num_output: 3 kernel_size: 3 group: 2"), inputs={"x": (1, 4, 5, 5),
                                                                                   "o": (1, 8, 5, 5)}))


def test_realworld_dengshuo_cifar10_full():
    res = cli_process("inspect", REALWORLD / "dengshuo__D-M-F-ConvNets__caffe__examples__cifar10_full.prototxt")
    out = ok(res)
    assert "read as dengshuo/D-M-F-ConvNets' DeformableConvolution" in res.stderr
    row = next(line for line in out.splitlines() if line.startswith("deformable_conv1 "))
    assert "conv1,conv11 -> conv12" in row and "1x2x28x28" in row


GNNG_DATA = ('layer { name: "data1" type: "MemoryData" top: "d0" top: "d1" top: "l0" top: "l1" '
             'memory_data_param { batch_size: 3 channels: 2 height: 5 width: 7 } }')


def test_gnng_memory_data_tops():
    model = load_from_text(GNNG_DATA + ' layer { name: "c" type: "Convolution" bottom: "d0" bottom: "d1" '
                           'top: "c0" top: "c1" convolution_param { num_output: 4 kernel_size: 3 } }',
                           random_weights=True)
    s = model.blob_shapes
    assert (s["d0"], s["d1"], s["l0"], s["l1"]) == ((3, 2, 5, 7), (3, 2, 5, 7), (3,), (3,))
    x = np.random.default_rng(0).standard_normal((3, 2, 5, 7)).astype(F32)
    out = model.run({"d0": x, "d1": x, "l0": np.zeros(3, F32), "l1": np.zeros(3, F32)})
    np.testing.assert_array_equal(out["c0"], out["c1"])   # the fork feeds every data top the same batch
    assert node_of(model, "data1").attrs["chw"] == (2, 5, 7)


def test_gnng_memory_data_needs_its_sizes():
    with pytest.raises(LayerError, match=r"layer 'data1' \(MemoryData\).*memory_data_param.batch_size, channels, "
                                         r"height and width must be given"):
        load_from_text(GNNG_DATA.replace("height: 5 ", ""))


def test_realworld_gnng_modified_net():
    """data1's four tops now read, and Convolution's bottom / top pairs are BVLC's; the net stops at gnng's Pooling
    over GPU_COUNT pairs: BVLC's (and caffeq's) takes one bottom, so the second is refused, not read as a mask."""
    res = cli_process("inspect", REALWORLD / "herenvarno__gnng__gnng.20160512__modified_net.prototxt")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "layer 'pool1' (Pooling): Pooling takes 1 bottom, got 2" in res.stderr


def test_dengshuo_deformable_reads_channels_at_axis_1_only():
    with pytest.raises(LayerError, match=r"layer 'd' \(DeformableConvolution\).*axis must be 1.*got 0"):
        load_from_text(net(layer("num_output: 2 kernel_size: 3 axis: 0"), inputs={"x": (1, 4, 5, 5),
                                                                                  "o": (1, 8, 5, 5)}))


def test_gnng_memory_data_has_no_nd_shape():
    with pytest.raises(LayerError, match=r"layer 'data1' \(MemoryData\).*memory_data_param.dim is naibaf7"):
        load_from_text(GNNG_DATA.replace("batch_size: 3", "dim: 3 dim: 2 dim: 5 dim: 7 batch_size: 3"))
