"""``edgeline.imaging``: pre-processing keys, the manifest's ``image``, frames into input 0 and boxes back out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import ValidationError

from edgeline.errors import EdgelineError, PayloadError
from edgeline.imaging import (
    PLAN_CACHE,
    FramePrep,
    format_preprocess,
    image_preprocess,
    parse_preprocess,
    preprocess_table,
    read_image,
)
from edgeline.manifest import ImagePreprocess, TensorSpec

pytestmark = pytest.mark.quick

RNG = np.random.default_rng(0)


def _input(*shape: int) -> TensorSpec:
    return TensorSpec(name="image", dtype="float32", shape=shape)


def _prep(text: str, *shape: int) -> FramePrep:
    spec = _input(*shape)
    return FramePrep(image_preprocess(parse_preprocess(text), spec), spec)


def _frame(height: int, width: int, channels: int = 3) -> np.ndarray:
    shape = (height, width, channels) if channels else (height, width)
    return RNG.integers(0, 256, shape, dtype=np.uint8)


# --- keys -------------------------------------------------------------------------------------------------------


def test_parse_reads_every_key_typed() -> None:
    keys = parse_preprocess(
        "resize=center-crop, pad=0,color=BGR,scale=1/255,mean=0.485/0.456/0.406,std=0.5,layout=nhwc,size=224x200"
    )
    assert keys == {
        "resize": "center-crop",
        "pad": 0,
        "color": "bgr",
        "scale": pytest.approx(1 / 255),
        "mean": (0.485, 0.456, 0.406),
        "std": (0.5,),
        "layout": "nhwc",
        "size": (224, 200),
    }
    assert parse_preprocess(format_preprocess(keys)) == keys


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("resize=stretch", "letterbox | squash | center-crop"),
        ("pad=300", "0..255"),
        ("pad=1.5", "0..255"),
        ("color=hsv", "rgb | bgr | gray"),
        ("scale=0", "> 0"),
        ("scale=1/0", "> 0"),
        ("mean=a/b/c", "per channel"),
        ("mean=1/2/3/4", "per channel"),
        ("std=0.5/0/0.5", "std="),
        ("layout=chw", "nchw | nhwc"),
        ("size=224", "HxW"),
        ("size=0x10", "HxW"),
        ("colour=rgb", "valid keys: size, resize, pad, color, scale, mean, std, layout"),
        ("resize", "not KEY=VALUE"),
        ("pad=1,pad=2", "pad is given twice"),
        ("", "empty"),
    ],
)
def test_parse_refuses_naming_the_key_and_the_valid_values(text: str, named: str) -> None:
    with pytest.raises(EdgelineError, match="--preprocess") as caught:
        parse_preprocess(text)
    assert named in str(caught.value)


def test_a_toml_table_reads_numbers_and_arrays_as_the_flag_reads_text() -> None:
    table = {"mean": [0.485, 0.456, 0.406], "size": [96, 96], "scale": "1/255", "pad": 0, "resize": "squash"}
    assert preprocess_table(table, "config.toml [preprocess]") == parse_preprocess(
        "mean=0.485/0.456/0.406,size=96x96,scale=1/255,pad=0,resize=squash"
    )
    with pytest.raises(EdgelineError, match=r"config.toml \[preprocess\]: pad=True"):
        preprocess_table({"pad": True}, "config.toml [preprocess]")


# --- the manifest's image -----------------------------------------------------------------------------------------


def test_size_and_channels_come_from_the_input() -> None:
    spec = image_preprocess({}, _input(1, 3, 96, 128))
    assert (spec.size, spec.color, spec.layout, spec.resize, spec.pad) == ((96, 128), "rgb", "nchw", "letterbox", 114)
    assert image_preprocess({"layout": "nhwc"}, _input(1, 96, 128, 1)).color == "gray"
    assert image_preprocess({}, _input(1, 28, 28)).size == (28, 28)  # (C, H, W) without a batch


@pytest.mark.parametrize(
    ("keys", "shape", "named"),
    [
        ({"color": "gray"}, (1, 3, 32, 32), "color=gray makes 1 channel, but input 'image' of shape [1, 3, 32, 32]"),
        ({"color": "rgb"}, (1, 1, 32, 32), "color=rgb makes 3 channels"),
        ({"size": (64, 64)}, (1, 3, 32, 32), "size=64x64 does not fit input 'image' of shape [1, 3, 32, 32]"),
        ({}, (1, 32, 32, 3), "is the layout nhwc?"),
        ({}, (2, 3, 32, 32), "a batch of 2"),
        ({}, (10,), "not an image's"),
        ({"mean": (0.1, 0.2)}, (1, 3, 8, 8), "mean has 2 values; color rgb has 3 channels"),
    ],
)
def test_a_spec_that_does_not_fit_the_input_is_refused_naming_both(
    keys: dict[str, object], shape: tuple[int, ...], named: str
) -> None:
    with pytest.raises(EdgelineError) as caught:
        image_preprocess(keys, _input(*shape))
    assert named in str(caught.value)


def test_the_manifest_model_validates_itself() -> None:
    with pytest.raises(ValidationError, match="std must be > 0"):
        ImagePreprocess(size=(8, 8), std=(1.0, 0.0, 1.0))
    with pytest.raises(ValidationError, match="size"):
        ImagePreprocess(size=(0, 8))
    with pytest.raises(ValidationError, match="mean has 3 values; color gray has 1 channel"):
        ImagePreprocess(size=(8, 8), color="gray", mean=(0.1, 0.2, 0.3))
    assert ImagePreprocess(size=(8, 8)).describe() == "8x8 rgb, letterbox (pad 114), (x * 0.003922 - 0) / 1, nchw"


# --- frames -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("height", "width", "out_h", "out_w"), [(7, 5, 19, 23), (12, 16, 40, 33), (3, 3, 9, 9)])
def test_an_upscale_equals_pillows_bilinear(height: int, width: int, out_h: int, out_w: int) -> None:
    frame = _frame(height, width)
    got = _prep("resize=squash,scale=1", 1, 3, out_h, out_w)(frame)[0].transpose(1, 2, 0)
    pillow = np.asarray(Image.fromarray(frame).resize((out_w, out_h), Image.Resampling.BILINEAR), dtype=np.float32)
    # Pillow rounds to 8 bits after each of its two passes: within one level of the exact value
    assert np.abs(got - pillow).max() <= 1.0


def _reference(
    frame: np.ndarray, out_h: int, out_w: int, scale_y: float, scale_x: float, pad_y: float, pad_x: float
) -> np.ndarray:
    """Bilinear at half-pixel centres, one output pixel at a time, edges clamped: the formula itself."""
    height, width = frame.shape[:2]
    out = np.empty((out_h, out_w, frame.shape[2]))
    for i in range(out_h):
        for j in range(out_w):
            y = min(max((i + 0.5 - pad_y) / scale_y - 0.5, 0), height - 1)
            x = min(max((j + 0.5 - pad_x) / scale_x - 0.5, 0), width - 1)
            y0, x0 = int(y), int(x)
            y1, x1 = min(y0 + 1, height - 1), min(x0 + 1, width - 1)
            dy, dx = y - y0, x - x0
            top = frame[y0, x0] * (1 - dx) + frame[y0, x1] * dx
            bottom = frame[y1, x0] * (1 - dx) + frame[y1, x1] * dx
            out[i, j] = top * (1 - dy) + bottom * dy
    return out


def test_a_downscale_letterbox_and_crop_equal_the_formula() -> None:
    frame = _frame(30, 40).astype(np.float64)
    letterbox = _prep("resize=letterbox,pad=7,scale=1", 1, 3, 16, 16)
    got = letterbox(frame.astype(np.uint8))[0].transpose(1, 2, 0)
    # 40x30 into 16x16: 16x12, bands of 2 rows above and below
    assert np.all(got[:2] == 7) and np.all(got[14:] == 7)
    np.testing.assert_allclose(got[2:14], _reference(frame, 12, 16, 12 / 30, 16 / 40, 0, 0), atol=1e-3)
    crop = _prep("resize=center-crop,scale=1", 1, 3, 10, 10)
    geometry = crop.geometry(30, 40)
    assert geometry.crop_x == pytest.approx(5) and geometry.crop_y == 0
    np.testing.assert_allclose(
        crop(frame.astype(np.uint8))[0].transpose(1, 2, 0),
        _reference(frame, 10, 10, 1 / 3, 1 / 3, 0, geometry.pad_x),
        atol=1e-3,
    )


def test_normalisation_layout_and_colour_order() -> None:
    frame = _frame(6, 8)
    rgb = _prep("resize=squash,mean=0.5/0.4/0.3,std=0.2/0.25/0.5", 1, 3, 6, 8)(frame)
    expected = (frame / 255 - [0.5, 0.4, 0.3]) / [0.2, 0.25, 0.5]
    np.testing.assert_allclose(rgb[0].transpose(1, 2, 0), expected, atol=1e-5)
    # a BGR frame of the same picture gives the same input; a BGR-trained model gets the channels reversed
    same = _prep("resize=squash,mean=0.5/0.4/0.3,std=0.2/0.25/0.5", 1, 3, 6, 8)(frame[:, :, ::-1].copy(), "bgr")
    np.testing.assert_allclose(same, rgb, atol=1e-5)
    bgr = _prep("resize=squash,color=bgr,scale=1", 1, 3, 6, 8)(frame)
    np.testing.assert_allclose(bgr[0], frame[:, :, ::-1].transpose(2, 0, 1), atol=1e-4)
    nhwc = _prep("resize=squash,layout=nhwc,scale=1", 1, 6, 8, 3)(frame)
    assert nhwc.shape == (1, 6, 8, 3) and nhwc.dtype == np.float32
    np.testing.assert_allclose(nhwc[0], frame, atol=1e-4)


def test_gray_is_bt601_luma_and_a_gray_frame_feeds_a_colour_model() -> None:
    frame = _frame(5, 7)
    gray = _prep("resize=squash,scale=1", 1, 1, 5, 7)(frame)
    luma = frame @ np.array([0.299, 0.587, 0.114])
    np.testing.assert_allclose(gray[0, 0], luma, atol=1e-3)
    np.testing.assert_allclose(
        _prep("resize=squash,scale=1", 1, 1, 5, 7)(frame[:, :, ::-1].copy(), "bgr")[0, 0], luma, atol=1e-3
    )
    flat = _frame(5, 7, channels=0)
    colour = _prep("resize=squash,scale=1", 1, 3, 5, 7)(flat, "gray")
    assert np.all(colour[0] == flat[None].astype(np.float32))
    np.testing.assert_array_equal(_prep("resize=squash,scale=1", 1, 1, 5, 7)(flat[:, :, None]), colour[:, :1])


@pytest.mark.parametrize(
    ("frame", "named"),
    [
        (np.zeros((4, 4, 4), np.uint8), "shape [4, 4, 4] is not an image"),
        (np.zeros((0, 4, 3), np.uint8), "shape [0, 4, 3] is not an image"),
        (np.zeros((4,), np.uint8), "shape [4] is not an image"),
        (np.zeros((4, 4, 3), np.float32), "dtype float32 of shape [4, 4, 3]"),
        ([[1, 2], [3, 4]], "list"),
    ],
)
def test_a_frame_that_is_not_an_image_is_refused_naming_its_shape(frame: object, named: str) -> None:
    with pytest.raises(PayloadError) as caught:
        _prep("resize=letterbox", 1, 3, 8, 8)(frame)  # type: ignore[arg-type]
    assert caught.value.code == "wrong-shape" and named in str(caught.value)


def test_frames_of_another_size_reuse_a_bounded_set_of_tables() -> None:
    prep = _prep("resize=letterbox", 1, 3, 32, 32)
    first = _frame(48, 64)
    expected = prep(first)
    for step in range(3 * PLAN_CACHE):
        out = prep(_frame(40 + step, 50 + 2 * step))
        assert out.shape == (1, 3, 32, 32)
        assert len(prep.plan_sizes) <= PLAN_CACHE
    assert (48, 64, "rgb") not in prep.plan_sizes
    np.testing.assert_array_equal(prep(first), expected)  # made again, the same
    assert prep.plan_sizes[-1] == (48, 64, "rgb")


@settings(max_examples=60, deadline=None)
@given(
    height=st.integers(1, 900),
    width=st.integers(1, 900),
    resize=st.sampled_from(["letterbox", "squash", "center-crop"]),
    box=st.tuples(*(st.floats(0.0, 1.0) for _ in range(4))),
)
def test_boxes_mapped_into_the_input_and_back_are_the_same(
    height: int, width: int, resize: str, box: tuple[float, float, float, float]
) -> None:
    prep = _prep(f"resize={resize}", 1, 3, 64, 96)
    geometry = prep.geometry(height, width)
    x1, x2 = sorted(box[0::2])
    y1, y2 = sorted(box[1::2])
    frame_box = np.array([[x1, y1, x2, y2]])
    inside = geometry.to_input(frame_box)
    if resize == "letterbox":  # the frame lies inside the input
        assert np.all(inside >= -1e-9) and np.all(inside[:, 0::2] <= 96 + 1e-9) and np.all(inside[:, 1::2] <= 64 + 1e-9)
    np.testing.assert_allclose(geometry.to_frame(inside), frame_box, atol=1e-9)


def test_a_box_in_the_letterbox_band_is_clipped_to_the_frame() -> None:
    geometry = _prep("resize=letterbox", 1, 3, 320, 320).geometry(480, 640)
    assert (geometry.pad_x, geometry.pad_y, geometry.scale_x) == (0.0, 40.0, 0.5)
    np.testing.assert_allclose(geometry.to_frame(np.array([[0, 0, 160, 160]])), [[0, 0, 0.5, 0.5]])


def test_read_image_gives_rgb_and_refuses_what_is_not_an_image(tmp_path: Path) -> None:
    picture = _frame(5, 6)
    Image.fromarray(picture).save(tmp_path / "a.png")
    np.testing.assert_array_equal(read_image(tmp_path / "a.png"), picture)
    Image.fromarray(picture[:, :, 0]).save(tmp_path / "gray.png")
    assert read_image(tmp_path / "gray.png").shape == (5, 6, 3)
    (tmp_path / "b.jpg").write_bytes(b"not a picture")
    with pytest.raises(EdgelineError, match=r"b\.jpg: not an image"):
        read_image(tmp_path / "b.jpg")
    with pytest.raises(EdgelineError, match="no such file"):
        read_image(tmp_path / "missing.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "a.png").read_bytes()[:40])
    with pytest.raises(EdgelineError, match=r"cut\.png"):
        read_image(tmp_path / "cut.png")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_the_other_colour_order_s_inputs_are_made_exactly_from_the_declared_one_s(layout: str) -> None:
    """What the export's colour-order check feeds the float model: the inputs the same pictures make in the other
    order, with a per-channel normalisation undone and redone (edgeline.export.colour_order)."""
    from edgeline.export.colour_order import swapped_channels

    rng = np.random.default_rng(3)
    picture = rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)
    keys = {"size": (24, 24), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225), "layout": layout}
    shape = (1, 3, 24, 24) if layout == "nchw" else (1, 24, 24, 3)
    spec = TensorSpec(name="image", dtype="float32", shape=shape)
    rgb = ImagePreprocess.model_validate(keys)
    declared = FramePrep(rgb, spec)(picture)
    other = FramePrep(rgb, spec)(np.ascontiguousarray(picture[..., ::-1]))
    np.testing.assert_allclose(swapped_channels(declared, rgb), other, atol=1e-5)
