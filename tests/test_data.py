"""caffeq.data: Caffe's DataTransformer against hand-computed numpy, and the dataset readers."""
import os
import zipfile

import numpy as np
import pytest

from caffeq.data import (
    ArrayDataset,
    CaffeRNG,
    Collate,
    DataTransformer,
    ImageFolderDataset,
    ImageListDataset,
    LmdbDataset,
    Normalizer,
    Preprocess,
    StridedSampler,
    detect_kind,
    open_dataset,
)
from caffeq.data.lmdb_source import decode_datum, first_datum_shape, parse_datum
from caffeq.errors import CaffeqError, DataError
from caffeq.io.schema import caffe_pb2

cv2 = pytest.importorskip("cv2")
lmdb = pytest.importorskip("lmdb")

DIGITS = os.path.join(os.path.dirname(__file__), "..", "examples", "digits")


def write_mean(path, mean):
    """A Caffe mean .binaryproto (BlobProto with num/channels/height/width)."""
    b = caffe_pb2.BlobProto()
    b.num, (b.channels, b.height, b.width) = 1, mean.shape
    b.data.extend(mean.ravel().tolist())
    with open(path, "wb") as f:
        f.write(b.SerializeToString())


def write_lmdb(path, datums):
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i, d in enumerate(datums):
            txn.put(f"{i:08d}".encode(), d.SerializeToString())
    env.close()


def raw_datum(img, label=0):
    d = caffe_pb2.Datum()
    d.channels, d.height, d.width = img.shape
    if img.dtype == np.uint8:
        d.data = img.tobytes()
    else:
        d.float_data.extend(img.ravel().tolist())
    d.label = label
    return d


def encoded_datum(hwc, label=0, ext=".png"):
    ok, buf = cv2.imencode(ext, hwc)
    assert ok
    d = caffe_pb2.Datum()
    d.data, d.encoded, d.label = buf.tobytes(), True, label
    return d


# ---- the transformer, by Caffe's index formulas ------------------------------------------------

def caffe_transform(img, scale, mean=None, mean_values=None, crop=0, h_off=0, w_off=0, mirror=False):
    """Caffe's DataTransformer::Transform(const Datum&, Dtype*) loop, literally (float32)."""
    C, H, W = img.shape
    height, width = (crop, crop) if crop else (H, W)
    out = np.zeros(C * height * width, np.float32)
    flat, mflat = img.ravel(), None if mean is None else mean.ravel()
    for c in range(C):
        for h in range(height):
            for w in range(width):
                data_index = (c * H + h_off + h) * W + w_off + w
                top_index = (c * height + h) * width + ((width - 1 - w) if mirror else w)
                e = np.float32(flat[data_index])
                if mflat is not None:
                    out[top_index] = (e - np.float32(mflat[data_index])) * np.float32(scale)
                elif mean_values is not None:
                    out[top_index] = (e - np.float32(mean_values[c])) * np.float32(scale)
                else:
                    out[top_index] = e * np.float32(scale)
    return out.reshape(C, height, width)


@pytest.fixture
def img375():
    return np.random.default_rng(0).integers(0, 256, (3, 7, 9), dtype=np.uint8)


def test_centre_crop_with_mean_file(tmp_path, img375):
    mean = np.random.default_rng(1).uniform(0, 255, (3, 7, 9)).astype(np.float32)
    write_mean(tmp_path / "mean.binaryproto", mean)
    t = DataTransformer(scale=0.017, mean_file=str(tmp_path / "mean.binaryproto"), crop_size=4)
    # centre at TEST: ((7 - 4) / 2, (9 - 4) / 2) = (1, 2); the mean is cropped at the same offset
    assert t.geometry(img375.shape) == (1, 2, False)
    want = caffe_transform(img375, 0.017, mean=mean, crop=4, h_off=1, w_off=2)
    got = t(img375)
    assert got.dtype == np.float32 and got.shape == (3, 4, 4)
    np.testing.assert_array_equal(got, want)
    # and by hand for one element: output (c=2, h=0, w=3) reads source (2, 1, 5)
    assert got[2, 0, 3] == (np.float32(img375[2, 1, 5]) - mean[2, 1, 5]) * np.float32(0.017)


def test_mean_value_per_channel_and_single(img375):
    t = DataTransformer(scale=0.5, mean_value=[104, 117, 123])
    want = (img375.astype(np.float32) - np.array([104, 117, 123], np.float32)[:, None, None]) * np.float32(0.5)
    np.testing.assert_array_equal(t(img375), want)
    np.testing.assert_array_equal(t(img375), caffe_transform(img375, 0.5, mean_values=[104, 117, 123]))
    one = DataTransformer(mean_value=[100])   # one value is replicated over the channels
    np.testing.assert_array_equal(one(img375), img375.astype(np.float32) - 100)
    with pytest.raises(DataError, match="mean_value"):
        DataTransformer(mean_value=[1, 2])(img375)


def test_scale_only_and_float_data():
    img = np.random.default_rng(2).normal(size=(2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(DataTransformer(scale=3.0)(img), img * np.float32(3.0))


def _seed_for(mirror_wanted, h, w, crop):
    for seed in range(100):
        r = np.random.RandomState(seed).randint(0, 2 ** 32, size=3, dtype=np.uint32).astype(np.int64)
        if (r[0] % 2 == 1) == mirror_wanted:
            return seed, bool(r[0] % 2), int(r[1] % (h - crop + 1)), int(r[2] % (w - crop + 1))
    raise AssertionError("no seed")


@pytest.mark.parametrize("mirror_wanted", [True, False])
def test_train_mirror_and_random_crop_with_seed(tmp_path, img375, mirror_wanted):
    mean = np.random.default_rng(3).uniform(0, 255, (3, 7, 9)).astype(np.float32)
    write_mean(tmp_path / "m.binaryproto", mean)
    seed, mirror, h_off, w_off = _seed_for(mirror_wanted, 7, 9, 5)
    t = DataTransformer(scale=0.25, mean_file=str(tmp_path / "m.binaryproto"), crop_size=5, mirror=True,
                        phase="TRAIN")
    # Caffe's order: Rand(2) for the mirror, then Rand(H - crop + 1), then Rand(W - crop + 1)
    got = t(img375, rng=CaffeRNG(seed))
    want = caffe_transform(img375, 0.25, mean=mean, crop=5, h_off=h_off, w_off=w_off, mirror=mirror)
    np.testing.assert_array_equal(got, want)
    assert mirror == mirror_wanted


def test_mirror_is_off_at_test(img375):
    t = DataTransformer(mirror=True, phase="TEST")
    np.testing.assert_array_equal(t(img375), img375.astype(np.float32))


def test_caffe_rng_is_mt19937():
    # std::mt19937 / boost::mt19937 with the default seed 5489: 3499211612, 581869302, ...
    r = CaffeRNG(5489)
    assert r.rand(1 << 32) == 3499211612 and r.rand(1 << 32) == 581869302


def test_transformer_checks(tmp_path, img375):
    with pytest.raises(DataError, match="mean_file and mean_value"):
        DataTransformer(mean_file="x", mean_value=[1])
    with pytest.raises(DataError, match="force_color and force_gray"):
        DataTransformer(force_color=True, force_gray=True)
    with pytest.raises(DataError, match="mean file not found"):
        DataTransformer(mean_file=str(tmp_path / "nope.binaryproto"))
    with pytest.raises(DataError, match="smaller than crop_size"):
        DataTransformer(crop_size=8)(img375)
    write_mean(tmp_path / "m.binaryproto", np.zeros((3, 5, 5), np.float32))
    with pytest.raises(DataError, match="mean file is 3x5x5"):
        DataTransformer(mean_file=str(tmp_path / "m.binaryproto"))(img375)


def test_batch_normalizer_equals_per_image(tmp_path):
    rng = np.random.default_rng(4)
    imgs = rng.integers(0, 256, (5, 3, 10, 12), dtype=np.uint8)
    mean = rng.uniform(0, 255, (3, 10, 12)).astype(np.float32)
    write_mean(tmp_path / "m.binaryproto", mean)
    t = DataTransformer(scale=0.0078125, mean_file=str(tmp_path / "m.binaryproto"), crop_size=7)
    pre = Preprocess(t, defer_normalize=True)
    raw = np.stack([pre(im, i, "x") for i, im in enumerate(imgs)])
    assert raw.dtype == np.uint8
    norm = Normalizer(t.mean_for((3, 10, 12)), t.scale)
    want = np.stack([t(im) for im in imgs])
    np.testing.assert_array_equal(norm.numpy(raw), want)
    import torch
    np.testing.assert_array_equal(norm.torch(torch.from_numpy(raw)).numpy(), want)


def test_rgb_channel_order(img375):
    pre = Preprocess(DataTransformer(mean_value=[1, 2, 3]), channel_order="RGB")
    want = img375[::-1].astype(np.float32) - np.array([1, 2, 3], np.float32)[:, None, None]
    np.testing.assert_array_equal(pre(img375, 0, "x"), want)


# ---- encoded datums: force_gray / force_color / native -----------------------------------------

def test_force_gray_and_force_color_on_encoded_datums(tmp_path):
    rng = np.random.default_rng(5)
    grey_values = rng.integers(0, 256, (6, 5), dtype=np.uint8)
    # a colour PNG whose B, G and R are equal: every grey conversion gives that value exactly
    colour = np.repeat(grey_values[:, :, None], 3, axis=2)
    grey_png = grey_values[:, :, None]
    write_lmdb(tmp_path / "db", [encoded_datum(colour, 3), encoded_datum(grey_png, 4)])
    native = LmdbDataset(tmp_path / "db", Preprocess(DataTransformer()))
    assert native[0][1].shape == (3, 6, 5) and native[1][1].shape == (1, 6, 5)
    assert first_datum_shape(str(tmp_path / "db")) == (3, 6, 5)
    gray = LmdbDataset(tmp_path / "db", Preprocess(DataTransformer(force_gray=True)), force_gray=True)
    for i in range(2):
        _, arr, label, err = gray[i]
        assert err is None and label == 3 + i
        np.testing.assert_array_equal(arr, grey_values[None].astype(np.float32))
    color = LmdbDataset(tmp_path / "db", Preprocess(DataTransformer(force_color=True)), force_color=True)
    np.testing.assert_array_equal(color[1][1], np.repeat(grey_values[None], 3, 0).astype(np.float32))


def test_raw_float_datum_and_corrupt_record(tmp_path):
    f = np.random.default_rng(6).normal(size=(2, 3, 4)).astype(np.float32)
    bad = caffe_pb2.Datum()
    bad.channels, bad.height, bad.width, bad.data = 1, 2, 2, b"\x01\x02"   # 2 bytes for 4 pixels
    write_lmdb(tmp_path / "db", [raw_datum(f, 7), bad])
    ds = LmdbDataset(tmp_path / "db", Preprocess(DataTransformer(scale=2.0)))
    _, arr, label, err = ds[0]
    assert err is None and label == 7
    np.testing.assert_array_equal(arr, f * np.float32(2))
    _, arr, _, err = ds[1]
    assert arr is None and "2 values for a 1x2x2 datum" in err and "00000001" in err
    d = parse_datum(raw_datum(f, 1).SerializeToString())
    arr, label = decode_datum(d)
    assert arr.dtype == np.float32 and label == 1


def test_lmdb_limit_and_missing(tmp_path):
    ds = LmdbDataset(os.path.join(DIGITS, "test_lmdb"), None, limit=10)
    assert len(ds) == 10 and ds[9][1].dtype == np.uint8
    with pytest.raises(DataError, match="no such LMDB"):
        LmdbDataset(tmp_path / "nope")


# ---- ImageData lists, folders, arrays ------------------------------------------------------------

def test_digits_lmdb_and_png_list_agree():
    t = DataTransformer(scale=0.00390625, mean_file=os.path.join(DIGITS, "mean.binaryproto"))
    a = LmdbDataset(os.path.join(DIGITS, "test_lmdb"), Preprocess(t))
    b = ImageListDataset(os.path.join(DIGITS, "test_list.txt"), Preprocess(t), is_color=False)
    assert len(a) == len(b) == 400
    for i in (0, 17, 399):
        np.testing.assert_array_equal(a[i][1], b[i][1])
        assert a[i][2] == b[i][2]


def test_image_list_resize_is_opencv_bilinear(tmp_path):
    img = np.random.default_rng(7).integers(0, 256, (8, 12, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "a.png"), img)
    (tmp_path / "list.txt").write_text("a.png 1\n")
    ds = ImageListDataset(str(tmp_path / "list.txt"), None, new_height=4, new_width=6, base_dir=str(tmp_path))
    _, got, label, err = ds[0]
    assert err is None and label == 1 and got.shape == (3, 4, 6)
    # halving with bilinear weights samples between 2x2 blocks: their mean, rounded half up
    blocks = img.reshape(4, 2, 6, 2, 3).astype(np.int64).sum(axis=(1, 3))
    want = np.floor(blocks / 4 + 0.5).astype(np.uint8).transpose(2, 0, 1)
    np.testing.assert_array_equal(got, want)


def test_image_list_new_dim_resizes_the_shorter_side(tmp_path):
    """yihui-he/caffe-pro new_dim: the shorter side becomes new_dim, the other round(scale * side)."""
    rng = np.random.default_rng(3)
    tall = rng.integers(0, 256, (15, 6, 3), dtype=np.uint8)    # 6 -> 4, 15 * 4/6 = 10
    wide = rng.integers(0, 256, (6, 9, 3), dtype=np.uint8)     # 6 -> 4, 9 * 4/6 = 6
    cv2.imwrite(str(tmp_path / "t.png"), tall)
    cv2.imwrite(str(tmp_path / "w.png"), wide)
    (tmp_path / "list.txt").write_text("t.png 0\nw.png 1\n")
    for bicubic, interp in [(False, cv2.INTER_LINEAR), (True, cv2.INTER_CUBIC)]:
        ds = ImageListDataset(str(tmp_path / "list.txt"), None, new_dim=4, bicubic=bicubic,
                              base_dir=str(tmp_path))
        for k, (img, size) in enumerate([(tall, (4, 10)), (wide, (6, 4))]):   # cv2 sizes are (w, h)
            _, got, _, err = ds[k]
            assert err is None
            np.testing.assert_array_equal(got, cv2.resize(img, size, interpolation=interp).transpose(2, 0, 1))
    with pytest.raises(DataError, match="new_dim and new_height"):
        ImageListDataset(str(tmp_path / "list.txt"), None, new_dim=4, new_height=3, new_width=3)


def test_image_data_new_dim_gives_the_top_shape(tmp_path):
    from caffeq.model import load_from_text
    cv2.imwrite(str(tmp_path / "t.png"), np.zeros((15, 6, 3), np.uint8))
    (tmp_path / "list.txt").write_text("t.png 0\n")
    text = f"""layer {{ name: "data" type: "ImageData" top: "data" top: "label"
      image_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 2 new_dim: 4 bicubic: true }} }}"""
    model = load_from_text(text)
    assert model.inputs["data"] == (2, 3, 10, 4)
    cropped = load_from_text(text.replace("bicubic: true }", "bicubic: true } transform_param { crop_size: 3 }"))
    assert cropped.inputs["data"] == (2, 3, 3, 3)
    with pytest.raises(CaffeqError, match="new_dim and new_height"):
        load_from_text(text.replace("new_dim: 4", "new_dim: 4 new_height: 5 new_width: 5"))


def test_image_list_smaller_side_size_scales_after_the_read(tmp_path):
    """cvjena/caffe_pp2's smaller_side_size: cv::resize by float(S / shorter side) both ways; OpenCV
    itself sizes the result, which the shape inference must predict."""
    from caffeq.data.images import scaled_shorter_size
    from caffeq.model import load_from_text
    rng = np.random.default_rng(5)
    images = {"t.png": rng.integers(0, 256, (15, 6, 3), dtype=np.uint8),
              "w.png": rng.integers(0, 256, (7, 11, 3), dtype=np.uint8)}
    for name, img in images.items():
        cv2.imwrite(str(tmp_path / name), img)
    (tmp_path / "list.txt").write_text("t.png 0\nw.png 1\n")
    ds = ImageListDataset(str(tmp_path / "list.txt"), None, smaller_side=(8,), base_dir=str(tmp_path))
    for k, img in enumerate(images.values()):
        ratio = float(np.float32(8 / min(img.shape[:2])))
        want = cv2.resize(img, None, fx=ratio, fy=ratio, interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
        _, got, _, err = ds[k]
        assert err is None and want.shape[1:] == scaled_shorter_size(img.shape[:2], 8)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(DataError, match="at random"):
        ImageListDataset(str(tmp_path / "list.txt"), None, smaller_side=(5, 9))
    text = f"""layer {{ name: "data" type: "ImageData" top: "data" top: "label"
      image_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 2 smaller_side_size: 8 }} }}"""
    assert load_from_text(text).inputs["data"] == (2, 3) + scaled_shorter_size((15, 6), 8)
    cropped = text.replace("smaller_side_size: 8 }", "smaller_side_size: 8 } transform_param { crop_size: 5 }")
    assert load_from_text(cropped).inputs["data"] == (2, 3, 5, 5)
    with pytest.raises(CaffeqError, match="shorter side at random"):
        load_from_text(text.replace("smaller_side_size: 8", "smaller_side_size: 8 smaller_side_size: 9"))


def test_face_alignment_image_data_resizes_only_when_shuffling():
    """CamlinZ/face_alignment's ImageData (rate_height / rate_width, its random crop margin): new_height x
    new_width when it shuffles, each image's own size otherwise (so the shape comes from --input-shape)."""
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "ImageData" top: "data" top: "label" image_data_param { source: "no.txt" '
            'batch_size: 10 new_height: 24 new_width: 20 rate_height: 0.1 rate_width: 0.1 %s } }')
    assert load_from_text(text % "shuffle: true").inputs["data"] == (10, 3, 24, 20)
    with pytest.raises(CaffeqError, match="keeps each image's own size unless it shuffles"):
        load_from_text(text % "shuffle: false").inputs
    assert load_from_text(text % "", input_shapes={"data": (2, 3, 30, 31)}).inputs["data"] == (2, 3, 30, 31)


def test_lrcn_min_size_grows_small_images_only(tmp_path):
    """lisa-caffe-public's min_height / min_width (io.cpp ReadImageToCVMat): an image smaller than either
    grows, aspect kept, along the side that falls further short; the other is min * (side / other) + 0.5
    truncated, in float; larger images stay as they are."""
    rng = np.random.default_rng(4)
    small = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)   # 40 - 20 > 40 - 30: height 40, width 60
    narrow = rng.integers(0, 256, (45, 7, 3), dtype=np.uint8)   # 40 - 7 > 40 - 45: width 40, height 257
    big = rng.integers(0, 256, (41, 50, 3), dtype=np.uint8)
    for name, img in (("s.png", small), ("n.png", narrow), ("b.png", big)):
        cv2.imwrite(str(tmp_path / name), img)
    (tmp_path / "list.txt").write_text("s.png 0\nn.png 1\nb.png 2\n")
    ds = ImageListDataset(str(tmp_path / "list.txt"), None, min_size=(40, 40), base_dir=str(tmp_path))
    for k, (img, size) in enumerate([(small, (60, 40)), (narrow, (40, 257)), (big, (50, 41))]):  # cv2: (w, h)
        _, got, _, err = ds[k]
        assert err is None and got.shape[1:] == size[::-1]
        want = img if img is big else cv2.resize(img, size, interpolation=cv2.INTER_LINEAR)
        np.testing.assert_array_equal(got, want.transpose(2, 0, 1))
    from caffeq.model import load_from_text
    text = f"""layer {{ name: "data" type: "ImageData" top: "data" top: "label"
      image_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 2 min_height: 40 min_width: 40 }} }}"""
    assert load_from_text(text).inputs["data"] == (2, 3, 40, 60)     # the first image's grown size
    with pytest.raises(CaffeqError, match="min_height and min_width must be set together"):
        load_from_text(text.replace(" min_width: 40", ""))


def test_image_list_root_folder_and_errors(tmp_path):
    os.makedirs(tmp_path / "imgs")
    cv2.imwrite(str(tmp_path / "imgs" / "a.png"), np.full((4, 4), 9, np.uint8))
    (tmp_path / "imgs" / "b.png").write_bytes(b"not a png")
    (tmp_path / "list.txt").write_text("a.png 0\nb.png 1\nmissing.png 2\n")
    ds = ImageListDataset(str(tmp_path / "list.txt"), None, root_folder="imgs/", is_color=False,
                          base_dir=str(tmp_path))
    assert ds[0][3] is None and ds[0][1].shape == (1, 4, 4)
    assert "imgs/b.png" in ds[1][3] and "cannot decode" in ds[1][3]
    assert "imgs/missing.png" in ds[2][3] and "cannot read" in ds[2][3]
    with pytest.raises(DataError, match="image list file not found"):
        ImageListDataset(str(tmp_path / "nope.txt"))
    (tmp_path / "bad.txt").write_text("a.png x\n")
    with pytest.raises(DataError, match="bad.txt:1: label 'x'"):
        ImageListDataset(str(tmp_path / "bad.txt"))


def test_image_folder_sorted_classes(tmp_path):
    for cls, v in (("zebra", 1), ("ant", 2), ("cat", 3)):
        os.makedirs(tmp_path / cls)
        for k in range(2):
            cv2.imwrite(str(tmp_path / cls / f"{k}.png"), np.full((3, 3), v * 10 + k, np.uint8))
    (tmp_path / "ant" / "notes.txt").write_text("skip me")
    ds = ImageFolderDataset(str(tmp_path), None, is_color=False)
    assert ds.classes == ["ant", "cat", "zebra"] and len(ds) == 6
    assert [ds[i][2] for i in range(6)] == [0, 0, 1, 1, 2, 2]
    assert ds[2][1][0, 0, 0] == 30 and ds[5][1][0, 0, 0] == 11
    assert detect_kind(str(tmp_path)) == "image_folder"


def test_arrays_npy_npz_memory_mapped(tmp_path):
    data = np.random.default_rng(8).integers(0, 256, (5, 1, 4, 4), dtype=np.uint8)
    labels = np.arange(5) % 3
    np.save(tmp_path / "x.npy", data)
    np.savez(tmp_path / "xy.npz", data=data, label=labels)
    np.savez_compressed(tmp_path / "c.npz", images=data)
    a = ArrayDataset(str(tmp_path / "x.npy"))
    assert not a.has_labels and isinstance(a._data, np.memmap)
    b = ArrayDataset(str(tmp_path / "xy.npz"))
    assert b.has_labels and isinstance(b._data, np.memmap)
    for i in range(5):
        np.testing.assert_array_equal(a[i][1], data[i])
        np.testing.assert_array_equal(b[i][1], data[i])
        assert b[i][2] == labels[i]
    c = ArrayDataset(str(tmp_path / "c.npz"))
    np.testing.assert_array_equal(c[4][1], data[4])
    assert detect_kind(str(tmp_path / "xy.npz")) == "array"
    with zipfile.ZipFile(tmp_path / "xy.npz") as z:
        assert z.getinfo("data.npy").compress_type == zipfile.ZIP_STORED


def test_detect_kind_and_missing(tmp_path):
    assert detect_kind(os.path.join(DIGITS, "test_lmdb")) == "lmdb"
    assert detect_kind(os.path.join(DIGITS, "test_list.txt")) == "image_list"
    with pytest.raises(DataError, match="not found"):
        detect_kind(str(tmp_path / "nothing"))
    with pytest.raises(DataError, match="not found"):
        open_dataset(str(tmp_path / "nothing"))


# ---- batching and sharding --------------------------------------------------------------------

def test_collate_drops_bad_and_misshaped_items():
    items = [(0, np.zeros((1, 2, 2), np.uint8), 3, None), (1, None, -1, "item 1: broken"),
             (2, np.zeros((1, 3, 3), np.uint8), 4, None), (3, np.ones((1, 2, 2), np.uint8), 5, None)]
    b = Collate((1, 2, 2))(items)
    assert b["index"].tolist() == [0, 3] and b["label"].tolist() == [3, 5]
    assert b["data"].shape == (2, 1, 2, 2) and b["data"].dtype.is_floating_point is False
    assert [i for i, _ in b["bad"]] == [1, 2] and "shape 1x3x3" in b["bad"][1][1]


@pytest.mark.parametrize("n,world", [(10, 3), (7, 2), (1, 4), (0, 2)])
def test_strided_sampler_covers_each_item_once(n, world):
    shards = [list(StridedSampler(n, r, world)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(StridedSampler(n, r, world)) for r in range(world)] == [len(s) for s in shards]
    assert shards[0] == list(range(0, n, world))


def test_lmdb_dataset_in_worker_processes():
    import torch
    t = DataTransformer(scale=0.00390625, mean_file=os.path.join(DIGITS, "mean.binaryproto"))
    ds = LmdbDataset(os.path.join(DIGITS, "test_lmdb"), Preprocess(t), limit=40)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=Collate((1, 16, 16)))
    got = torch.cat([b["data"] for b in loader]).numpy()
    want = np.stack([ds[i][1] for i in range(40)])
    np.testing.assert_array_equal(got, want)
    ds.close()


def test_memory_data_reads_naibaf7_caffes_n_d_dims():
    # naibaf7/caffe (the OpenCL Caffe of the connectomics U-Nets): memory_data_param { dim: ... } gives
    # the whole N-D shape, and the label is (N, 1, ..., 1) with one axis per data axis
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "MemoryData" top: "data" top: "label" '
            'memory_data_param { dim: 2 dim: 1 dim: 5 dim: 7 dim: 3 } }')
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (2, 1, 5, 7, 3) and shapes["label"] == (2, 1, 1, 1, 1)
    plain = load_from_text('layer { name: "data" type: "MemoryData" top: "data" top: "label" '
                           'memory_data_param { batch_size: 2 channels: 3 height: 4 width: 5 } }').blob_shapes
    assert plain["data"] == (2, 3, 4, 5) and plain["label"] == (2,)


@pytest.mark.parametrize("field, channels", [("images_in_color: false", 1), ("images_in_color: true", 3),
                                             ("is_color: false", 1), ("", 3)])
def test_image_data_images_in_color_is_is_color(field, channels):
    # Evolving-AI-Lab/fooling's Caffe named is_color images_in_color (the same field 11)
    from caffeq.model import load_from_text
    model = load_from_text('layer { name: "data" type: "ImageData" top: "data" top: "label" image_data_param { '
                           f'source: "missing.txt" batch_size: 2 new_height: 28 new_width: 24 {field} }} }}')
    assert model.blob_shapes["data"] == (2, channels, 28, 24)


def test_memory_data_transpose_keeps_the_blob_shape():
    # happynear/caffe-windows (its MTCNN v2 nets): transpose only changes how its reader lays out the
    # images it is handed; the declared blob shape holds, and the user is told
    from caffeq.model import load_from_text
    model = load_from_text('layer { name: "data" type: "MemoryData" top: "data" top: "label" '
                           'memory_data_param { batch_size: 1 channels: 3 height: 24 width: 20 transpose: true } }')
    assert model.blob_shapes["data"] == (1, 3, 24, 20)
    assert any("memory_data_param.transpose" in n for n in model.warnings)


def test_deeplab_data_dim_tops_are_each_images_height_and_width():
    # DeepLab v2's ImageSegData and the memory reader built on it (yilei0620/DeepLab-V2-Read-Memory-Data)
    # give a third top, data_dim: (N, 1, 1, 2), each image's size before the crop
    from caffeq.model import load_from_text
    seg = load_from_text('layer { name: "data" type: "ImageSegData" top: "data" top: "label" top: "data_dim" '
                         'image_data_param { source: "missing.txt" batch_size: 2 } '
                         'transform_param { crop_size: 9 } }').blob_shapes
    assert seg["data"] == (2, 3, 9, 9) and seg["label"] == (2, 1, 9, 9) and seg["data_dim"] == (2, 1, 1, 2)
    mem = load_from_text('layer { name: "data" type: "MemoryData" top: "data" top: "label" top: "data_dim" '
                         'memory_data_param { batch_size: 1 channels: 3 height: 7 width: 5 } }').blob_shapes
    assert mem["data"] == (1, 3, 7, 5) and mem["label"] == (1,) and mem["data_dim"] == (1, 1, 1, 2)


def test_a_digits_train_val_without_sources_reads():
    # DIGITS writes its train_val nets with data layers that name no source (it fills them in when it
    # trains): they read; the channels only the dataset could tell come from --input-shape, or stay
    # unknown when the net is only listed
    from caffeq.model import load_from_text
    text = ('layer { name: "train-data" type: "Data" top: "data" top: "label" include { stage: "train" } '
            'transform_param { mirror: true crop_size: 9 } data_param { batch_size: 4 } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }')
    shapes = load_from_text(text, stages=("train",), input_shapes={"data": (4, 3, 9, 9)}).blob_shapes
    assert shapes["data"] == (4, 3, 9, 9) and shapes["ip"] == (4, 2)
    assert load_from_text(text, stages=("train",), unknown_shapes_ok=True).blob_shapes["ip"] is None
    with pytest.raises(CaffeqError, match=r"data_param names no source\); give it with --input-shape data="):
        load_from_text(text, stages=("train",))


def test_a_fork_label_that_a_layer_reads_as_multi_axis_is_sized_by_input_shape():
    # caffe-ocr's ImageData reads every label of a list line: its label top is (N, labels, 1, 1), where
    # BVLC Caffe's is (N,). Without the list nothing tells the count: listing the net leaves the label
    # branch unsized with one note, --input-shape sizes it, and commands that need shapes say so
    from caffeq.model import load
    path = os.path.join(os.path.dirname(__file__), "fixtures", "realworld",
               "wudigepimao__caffe-ocr-linux__examples__ocr-duan__inception-bn__pla1-pla2-blue-withType__train_val.prototxt")
    listed = load(path, unknown_shapes_ok=True)
    assert listed.blob_shapes["label"] == (90,) and listed.blob_shapes["label1"] is None
    assert listed.blob_shapes["fc1x5990"] == (13, 90, 37)   # the net itself is sized
    note = [n for n in listed.warnings if "Slice_label" in n]
    assert len(note) == 1 and "--input-shape label=" in note[0] and "the shapes after it are unknown" in note[0]
    sized = load(path, input_shapes={"label": (90, 9, 1, 1)}).blob_shapes
    assert sized["label1"] == (90, 1, 1, 1) and sized["label2"] == (90, 8, 1, 1)
    with pytest.raises(CaffeqError, match=r"slice_param.axis 1 out of range .*label of data layer 'data' "
                                          r"\(ImageData\), shaped \[90\].*--input-shape label="):
        load(path)


def test_the_multi_label_recipes_label_dim_shapes_the_label():
    # the multi-label ImageData recipe (label_dim labels a list line): the label top is (N, label_dim),
    # which the nets then slice along axis 1, one loss per label
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "ImageData" top: "data" top: "label" '
            'image_data_param { source: "missing.txt" batch_size: 4 new_height: 7 new_width: 5 label_dim: 3 } }\n'
            'layer { name: "slice" type: "Slice" bottom: "label" top: "a" top: "b" '
            'slice_param { axis: 1 slice_point: 1 } }')
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (4, 3, 7, 5) and shapes["label"] == (4, 3)
    assert shapes["a"] == (4, 1) and shapes["b"] == (4, 2)
    one = load_from_text(text.replace("label_dim: 3", "label_dim: 1").split("\n")[0]).blob_shapes
    assert one["label"] == (4, 1)      # set, even to its default: the recipe's (N, 1)
    bvlc = load_from_text(text.replace(" label_dim: 3", "").split("\n")[0]).blob_shapes
    assert bvlc["label"] == (4,)


def test_caffe_multilabel_txt_label_size_shapes_a_4_axis_label(tmp_path):
    # imistyrain/caffe-multilabel-txt's image_data_layer.cpp: top[1]->Reshape(batch_size, label_size, 1, 1)
    from caffeq.data.plan import data_layer, plan_data
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "ImageData" top: "data" top: "label" '
            'image_data_param { source: "missing.txt" batch_size: 4 new_height: 7 new_width: 5 label_size: 2 } }\n'
            'layer { name: "slice" type: "Slice" bottom: "label" top: "brand" top: "body" '
            'slice_param { axis: 1 slice_point: 1 } }')
    model = load_from_text(text)
    shapes = model.blob_shapes
    assert shapes["label"] == (4, 2, 1, 1) and shapes["brand"] == shapes["body"] == (4, 1, 1, 1)
    # eval reads one label per list line: a multi-label list is refused, not misread
    with pytest.raises(DataError, match=r"layer 'data' \(ImageData\): its list lines hold 2 labels each"):
        plan_data(data_layer(model), model.inputs, str(tmp_path), data=str(tmp_path))
    with pytest.raises(CaffeqError, match="image_data_param.label_size must be >= 1"):
        load_from_text(text.replace("label_size: 2", "label_size: 0"))


def test_yuqj1991s_identity_batches_shape_three_tops(tmp_path):
    # yuqj1991/caffe_train image_data_layer.cpp: CHECK_EQ(label_num * sample_num, batch_size); top[1] is
    # (label_num,), top[2] (batch_size,); its source lists identity folders, which eval does not read
    from caffeq.data.plan import data_layer, plan_data
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "ImageData" top: "data" top: "label" top: "labelIndex" '
            'image_data_param { source: "labelmap.txt" batch_size: 6 new_height: 7 new_width: 5 sample_num: 3 '
            'label_num: 2 probability: 0.5 min_aspect_ratio: 0.3 max_aspect_ratio: 0.7 lower: 0.2 higher: 0.9 } }')
    shapes = load_from_text(text).blob_shapes
    assert (shapes["data"], shapes["label"], shapes["labelIndex"]) == ((6, 3, 7, 5), (2,), (6,))
    (tmp_path / "labelmap.txt").write_text("person0001 0\n")
    with pytest.raises(DataError, match=r"label_num / sample_num make its source a list of identity folders"):
        plan_data(data_layer(load_from_text(text)), {}, str(tmp_path), data=str(tmp_path / "labelmap.txt"))
    with pytest.raises(CaffeqError, match=r"label_num x sample_num \(2 x 4\) must equal batch_size \(6\)"):
        load_from_text(text.replace("sample_num: 3", "sample_num: 4"))


def test_r3cnns_label_lists_give_the_label_in_both_tops(tmp_path):
    # RojunLin/R-3CNN image_data_layer.cpp, reference: false: no image opened, each line's float label in both
    # (batch_size,) tops (its R2Net feeds them to EuclideanLoss as regression targets); eval reads images
    from caffeq.data.plan import data_layer, plan_data
    from caffeq.model import load_from_text
    text = ('layer { name: "label3" type: "ImageData" top: "label3_none" top: "label3" '
            'image_data_param { source: "single.txt" batch_size: 4 reference: false shuffle: false } }')
    model = load_from_text(text)
    assert model.blob_shapes["label3_none"] == model.blob_shapes["label3"] == (4,)
    assert any("reference: false" in w for w in model.warnings)
    (tmp_path / "single.txt").write_text("a.jpg 0.25\n")
    with pytest.raises(DataError, match=r"reference: false \(RojunLin/R-3CNN\) makes it a list of float labels"):
        plan_data(data_layer(model), {}, str(tmp_path), data=str(tmp_path / "single.txt"))
    # model.py says what the inputs hold (R-3CNN's R2Net train file exported with them as inputs)
    from caffeq.backends.pytorch_source import export_pytorch
    scaled = load_from_text(text + '\nlayer { name: "p" type: "Power" bottom: "label3" top: "p" power_param { scale: 2 } }')
    export_pytorch(scaled, tmp_path / "py")
    assert "no image read (R-3CNN's reference: false)" in (tmp_path / "py" / "model.py").read_text()
    with pytest.raises(CaffeqError, match=r"writes top\[1\] whatever the tops"):
        load_from_text(text.replace('top: "label3_none" ', ""))
    with pytest.raises(CaffeqError, match=r"image_data_param.batch_size must be >= 1, got 0"):
        load_from_text(text.replace("batch_size: 4", "batch_size: 0"))


def test_randvec_noise_is_an_input_of_its_declared_shape():
    # AtlantixJJ/caffe's GAN generators (models/gan/generator.prototxt): RandVec draws N(0, 4) at every forward;
    # caffeq makes it an input, fed the noise
    from caffeq.model import load_from_text
    text = ('layer { name: "noise" type: "RandVec" top: "noise" randvec_param { batch_size: 3 dim: 5 lower: -1 } }\n'
            'layer { name: "fc" type: "InnerProduct" bottom: "noise" top: "fc" inner_product_param { num_output: 2 } }')
    model = load_from_text(text, random_weights=True)
    assert model.inputs == {"noise": (3, 5, 1, 1)}
    assert any("draws N(0, 2^2) noise at every forward" in w for w in model.warnings)
    z = np.random.default_rng(2).standard_normal((3, 5, 1, 1)).astype(np.float32)
    w, b = next(n for n in model.layers if n.name == "fc").blobs
    np.testing.assert_allclose(model.run({"noise": z})["fc"], z.reshape(3, 5) @ w.T + b, rtol=1e-5, atol=1e-6)
    with pytest.raises(CaffeqError, match=r"randvec_param: batch_size and dim must be >= 1, got 3 and 0"):
        load_from_text(text.replace("dim: 5", "dim: 0"))
    # height or width 0: the fork's (batch_size, dim) blob
    assert load_from_text(text.replace("lower: -1", "height: 0")).inputs == {"noise": (3, 5)}


def test_label_num_without_sample_num_is_the_multi_label_reader():
    # liquidmetal/caffe-tests' box-regression nets: the 2016 multi-label ImageData (lhmRyan/DSH's label_num),
    # label_num labels a line, the label (N, label_num, 1, 1); yuqj1991's identity batches need sample_num
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "ImageData" top: "data" top: "label" '
            'image_data_param { source: "train.txt" batch_size: 5 new_height: 7 new_width: 6 label_num: 4 } }')
    shapes = load_from_text(text).blob_shapes
    assert (shapes["data"], shapes["label"]) == ((5, 3, 7, 6), (5, 4, 1, 1))
    with pytest.raises(CaffeqError, match="image_data_param.label_num must be >= 1"):
        load_from_text(text.replace("label_num: 4", "label_num: 0"))
    with pytest.raises(CaffeqError, match="label_num \\(labels a line\\) with label_size or label_dim: give one"):
        load_from_text(text.replace("label_num: 4", "label_num: 4 label_size: 4"))
    # three tops are yuqj1991's identity batches, whose check stands
    with pytest.raises(CaffeqError, match="label_num x sample_num \\(4 x 0\\) must equal batch_size \\(5\\)"):
        load_from_text(text.replace('top: "label"', 'top: "label" top: "index"'))


def test_a_data_layer_with_input_param_and_no_data_param_reads_as_an_input():
    # dgschwend/zynqnet's nets type their input layer "Data" but give input_param (OpenCV's importer
    # reads a Data layer as an input too): its shape, with a note; a real Data layer keeps its checks
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "Data" top: "data" input_param { shape { dim: 2 dim: 3 dim: 7 dim: 5 } } }\n'
            'layer { name: "relu" type: "ReLU" bottom: "data" top: "y" }')
    model = load_from_text(text)
    assert model.inputs == {"data": (2, 3, 7, 5)}
    assert any("read as an Input layer of shape [2, 3, 7, 5]" in w for w in model.warnings)
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 5)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"data": x})["y"], np.maximum(x, 0))
    with pytest.raises(CaffeqError, match="batch_size must be >= 1"):
        load_from_text(text.replace("input_param", "data_param { source: 'x' } input_param"))


def test_a_data_layer_without_a_batch_size_takes_the_input_shape():
    # KaiJin1995/MTCNN-VGG-face's det4 (LNet) net: a TRAIN Data layer with no data_param; Caffe needs a
    # batch size to train, reading needs only the shape the user gives
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "Data" top: "data" top: "label" }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }')
    model = load_from_text(text, input_shapes={"data": (3, 15, 4, 4)}, random_weights=True)
    assert model.inputs["data"] == (3, 15, 4, 4) and model.blob_shapes["ip"] == (3, 2)
    with pytest.raises(CaffeqError, match=r"batch_size must be >= 1, got 0\); give it with --input-shape data="):
        load_from_text(text)


def test_memory_data_label_size_shapes_the_label():
    # xbpeng/DeepTerrainRL's memory_data_layer.cpp: top[1] is (batch_size, label_size, 1, 1)
    from caffeq.model import load_from_text
    text = ('layer { name: "data" type: "MemoryData" top: "data" top: "label" '
            'memory_data_param { batch_size: 32 channels: 1 height: 1 width: 283 label_size: 90 } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 90 } }\n'
            'layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "label" top: "loss" }')
    shapes = load_from_text(text, phase="TRAIN").blob_shapes
    assert shapes["data"] == (32, 1, 1, 283) and shapes["label"] == (32, 90, 1, 1) and shapes["loss"] == ()
