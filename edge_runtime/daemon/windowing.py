"""Sliding windows over sensor streams: samples in, complete model-sized windows out.

A stream's windows start at samples 0, hop, 2*hop, ... of everything pushed into it, however the samples were
split into messages. With hop > size the samples between two windows are skipped. ``StreamWindows`` keeps one
``Windower`` per stream key (the device id), and forgets the least recently used stream when there are too many,
so that a flood of device ids cannot exhaust the device's memory.
Pure bookkeeping, no I/O and no locks: use each object from one thread at a time.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from edgeline.errors import PayloadError
from edgeline.manifest import Window

__all__ = ["StreamWindows", "Windower"]

_F32 = np.dtype(np.float32)


def _check_samples(samples: np.ndarray, channels: int) -> None:
    if samples.ndim != 2 or samples.shape[1] != channels:
        raise PayloadError(
            f"samples of shape {list(samples.shape)}; the window takes (n, {channels}): "
            f"{channels} channels per time step",
            code="wrong-shape",
        )


class Windower:
    """The windows of one stream. Between pushes it keeps fewer than ``window.size`` samples."""

    def __init__(self, window: Window):
        self.window = window
        self._size = window.size
        self._hop = window.hop
        self._channels = window.channels
        self._pending = np.empty((0, window.channels), _F32)  # the samples from the next window's start on
        self._skip = 0  # samples still to discard before the next window starts (hop > size)

    @property
    def pending(self) -> int:
        """Samples held towards the next window."""
        return len(self._pending)

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        """Add ``samples`` of shape (n, channels); return the windows they complete, each (size, channels) float32.

        The windows are fresh arrays: neither ``samples`` nor later pushes change them.
        """
        _check_samples(samples, self._channels)
        if self._skip:
            skipped = min(self._skip, len(samples))
            self._skip -= skipped
            samples = samples[skipped:]
        data = samples if not len(self._pending) else np.concatenate((self._pending, samples))
        size, hop = self._size, self._hop
        starts = range(0, len(data) - size + 1, hop)
        windows = [data[start : start + size].astype(_F32, copy=True) for start in starts]
        next_start = len(windows) * hop
        if next_start >= len(data):
            self._skip += next_start - len(data)  # on top of any skip this push could not finish
            self._pending = data[:0].astype(_F32)
        else:
            self._pending = data[next_start:].astype(_F32, copy=True)  # never a view of the caller's array
        return windows


class StreamWindows:
    """One ``Windower`` per stream key, created on first use; at most ``max_streams``, least recently used out."""

    def __init__(self, window: Window, *, max_streams: int = 1024):
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        self.window = window
        self.max_streams = max_streams
        self._streams: OrderedDict[str, Windower] = OrderedDict()
        self._evicted = 0

    @property
    def evicted(self) -> int:
        """Streams forgotten to make room for new ones, with their partial windows."""
        return self._evicted

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, key: object) -> bool:
        return key in self._streams

    def push(self, key: str, samples: np.ndarray) -> list[np.ndarray]:
        """``Windower.push`` on the stream ``key``."""
        windower = self._streams.get(key)
        if windower is None:
            _check_samples(samples, self.window.channels)  # a bad push must not evict anyone
            if len(self._streams) >= self.max_streams:
                self._streams.popitem(last=False)
                self._evicted += 1
            windower = self._streams[key] = Windower(self.window)
        else:
            self._streams.move_to_end(key)
        return windower.push(samples)
