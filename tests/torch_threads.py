"""One torch thread inside a block: for a training whose weights must not depend on the machine's core count.

The whole suite runs on one OpenMP thread per process already (``OMP_NUM_THREADS=1``, set by tests/conftest.py):
it runs one test process per core (pytest-xdist), and torch's default is one intra-op thread per core too, two
processes of two threads on two cores. The small models of the tests then spend their CPU in OpenMP's barriers, not
in their arithmetic: one 16-channel 8x8 convolution cost 15 ms of CPU on two threads of a loaded machine and 0.09 ms
on one, and a whole ``edgeline export`` of a small CNN 25.9 s of CPU against 11.4 s, with the same bytes in every
file of the bundle. A training that says its thread count in its own source (part of its cache key) keeps it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["one_torch_thread"]


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch computes on one intra-op thread inside the block; the previous count is restored after it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
