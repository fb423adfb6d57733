"""Windowing: the windows of a stream do not depend on how its samples were split into messages."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgeline.daemon.windowing import StreamWindows, Windower
from edgeline.errors import PayloadError
from edgeline.manifest import Window

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

PROPERTY = settings(deadline=None, max_examples=200)


def sliced(stream: np.ndarray, window: Window) -> list[np.ndarray]:
    """The reference: windows cut from the whole stream at 0, hop, 2*hop, ..."""
    starts = range(0, len(stream) - window.size + 1, window.hop)
    return [stream[start : start + window.size] for start in starts]


def chunked(stream: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    bounds = [0, *sorted(cut % (len(stream) + 1) for cut in cuts), len(stream)]
    return [stream[low:high] for low, high in pairwise(bounds)]


windows = st.builds(Window, size=st.integers(1, 8), hop=st.integers(1, 10), channels=st.integers(1, 3))


@PROPERTY
@given(window=windows, length=st.integers(0, 60), cuts=st.lists(st.integers(0, 60), max_size=12), data=st.data())
def test_any_chunking_yields_the_windows_of_slicing_the_whole_stream(
    window: Window, length: int, cuts: list[int], data: st.DataObject
) -> None:
    stream = data.draw(
        hnp.arrays(np.float32, (length, window.channels), elements=st.floats(-1e6, 1e6, width=32)), label="stream"
    )
    windower = Windower(window)
    got = [w for chunk in chunked(stream, cuts) for w in windower.push(chunk)]
    expected = sliced(stream, window)
    assert len(got) == len(expected)
    for mine, reference in zip(got, expected, strict=True):
        assert mine.shape == (window.size, window.channels)
        assert mine.dtype == np.float32
        np.testing.assert_array_equal(mine, reference)
    assert windower.pending < window.size


@PROPERTY
@given(window=windows, length=st.integers(0, 40))
def test_one_sample_at_a_time_is_one_more_chunking(window: Window, length: int) -> None:
    stream = np.arange(length * window.channels, dtype=np.float32).reshape(length, window.channels)
    windower = Windower(window)
    got = [w for index in range(length) for w in windower.push(stream[index : index + 1])]
    expected = sliced(stream, window)
    assert len(got) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_windows_are_copies_that_later_pushes_and_the_caller_cannot_change() -> None:
    windower = Windower(Window(size=3, hop=1, channels=1))
    samples = np.array([[1], [2], [3]], dtype=np.float32)
    (first,) = windower.push(samples)
    samples[:] = 0  # the caller reuses its buffer
    (second,) = windower.push(np.array([[4]], dtype=np.float32))
    assert first.ravel().tolist() == [1, 2, 3]
    assert second.ravel().tolist() == [2, 3, 4]
    second[:] = -1
    (third,) = windower.push(np.array([[5]], dtype=np.float32))
    assert third.ravel().tolist() == [3, 4, 5]


def test_a_hop_longer_than_the_window_skips_the_samples_between_windows() -> None:
    windower = Windower(Window(size=2, hop=5, channels=1))
    stream = np.arange(12, dtype=np.float32).reshape(-1, 1)
    got = [w.ravel().tolist() for chunk in np.split(stream, [1, 3, 4, 9]) for w in windower.push(chunk)]
    assert got == [[0, 1], [5, 6], [10, 11]]


def test_float64_samples_come_out_as_float32_windows() -> None:
    (window,) = Windower(Window(size=2, hop=2, channels=2)).push(np.ones((2, 2)))
    assert window.dtype == np.float32


@pytest.mark.parametrize("shape", [(4,), (4, 2), (2, 4, 3), (0,)])
def test_samples_with_the_wrong_channel_count_are_the_wrong_shape(shape: tuple[int, ...]) -> None:
    windower = Windower(Window(size=2, hop=1, channels=3))
    windower.push(np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(PayloadError, match="3 channels") as info:
        windower.push(np.zeros(shape, dtype=np.float32))
    assert info.value.code == "wrong-shape"
    assert windower.pending == 1  # the bad push changed nothing


# ---------------------------------------------------------------------------------------------------------------------
# many streams


def test_streams_are_windowed_independently() -> None:
    streams = StreamWindows(Window(size=2, hop=2, channels=1))
    assert streams.push("a", np.array([[1]], dtype=np.float32)) == []
    assert streams.push("b", np.array([[10]], dtype=np.float32)) == []
    (a,) = streams.push("a", np.array([[2]], dtype=np.float32))
    (b,) = streams.push("b", np.array([[20]], dtype=np.float32))
    assert a.ravel().tolist() == [1, 2] and b.ravel().tolist() == [10, 20]


def test_a_flood_of_stream_keys_evicts_the_least_recently_used_and_counts_it() -> None:
    streams = StreamWindows(Window(size=2, hop=2, channels=1), max_streams=3)
    one = np.array([[1]], dtype=np.float32)
    for key in ("a", "b", "c"):
        streams.push(key, one)
    streams.push("a", np.zeros((0, 1), dtype=np.float32))  # a is now the most recently used
    for index in range(100):
        streams.push(f"flood-{index}", one)
        assert len(streams) <= 3
    assert streams.evicted == 100
    assert "a" not in streams and f"flood-{99}" in streams


def test_recently_used_streams_survive_eviction_with_their_partial_window() -> None:
    streams = StreamWindows(Window(size=2, hop=2, channels=1), max_streams=2)
    streams.push("a", np.array([[1]], dtype=np.float32))
    streams.push("b", np.array([[1]], dtype=np.float32))
    streams.push("a", np.zeros((0, 1), dtype=np.float32))
    streams.push("c", np.array([[1]], dtype=np.float32))  # evicts b, not a
    assert "b" not in streams and streams.evicted == 1
    (window,) = streams.push("a", np.array([[2]], dtype=np.float32))
    assert window.ravel().tolist() == [1, 2]


def test_a_bad_push_on_a_new_key_evicts_nobody() -> None:
    streams = StreamWindows(Window(size=2, hop=2, channels=2), max_streams=1)
    streams.push("a", np.zeros((1, 2), dtype=np.float32))
    with pytest.raises(PayloadError):
        streams.push("b", np.zeros((1, 3), dtype=np.float32))
    assert "a" in streams and "b" not in streams and streams.evicted == 0


def test_at_least_one_stream_is_kept() -> None:
    with pytest.raises(ValueError, match="max_streams"):
        StreamWindows(Window(size=2, hop=2, channels=1), max_streams=0)
