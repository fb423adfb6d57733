"""The float reference runs in batches when that gives what single calls give, and progress is shown honestly."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from edgeline.export.fidelity import _batched_call, run_float
from edgeline.export.progress import Progress
from edgeline.samples import SampleSet


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class BatchDependent(nn.Module):
    """Each sample's output depends on the others in its batch (a direct batch would change the reference), and
    ``float()`` of a tensor cannot be vectorised: one sample per call is the only faithful way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) - float(x.mean())


def samples(count: int) -> SampleSet:
    rng = np.random.default_rng(0)
    return SampleSet([rng.standard_normal((count, 1, 8, 8)).astype(np.float32)], None, "test")


def one_by_one(module: nn.Module, data: SampleSet) -> list[np.ndarray]:
    with torch.no_grad():
        return [module(torch.from_numpy(data.sample(i)[0])).numpy() for i in range(len(data))]


@pytest.mark.quick
def test_a_module_that_takes_batches_is_called_with_batches() -> None:
    module, data = Net().eval(), samples(150)
    with torch.no_grad():
        assert _batched_call(module, data).__name__ == "direct"  # type: ignore[union-attr]
    reference = run_float(module, data)
    expected = one_by_one(module, data)
    assert len(reference.outputs) == 150
    for got, want in zip(reference.outputs, expected, strict=True):
        assert got[0].shape == want.shape == (1, 5)
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.export
def test_a_program_exported_for_a_batch_of_1_is_vectorised(tmp_path: Path) -> None:
    module, data = Net().eval(), samples(70)
    path = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(module, (torch.zeros(1, 1, 8, 8),)), str(path))
    program = torch.export.load(str(path)).module()
    with torch.no_grad():
        assert _batched_call(program, data).__name__ == "vectorised"  # type: ignore[union-attr]
    reference = run_float(program, data)
    for got, want in zip(reference.outputs, one_by_one(module, data), strict=True):
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.quick
def test_a_module_whose_outputs_depend_on_the_batch_runs_one_sample_at_a_time() -> None:
    module, data = BatchDependent(), samples(5)
    with torch.no_grad():
        assert _batched_call(module, data) is None
    reference = run_float(module, data)
    for got, want in zip(reference.outputs, one_by_one(module, data), strict=True):
        np.testing.assert_array_equal(got[0], want)


@pytest.mark.quick
def test_progress_on_a_terminal_is_one_live_line_with_counts() -> None:
    stream = io.StringIO()
    with Progress(stream, live=True) as progress:
        progress("float reference")
        progress.count(64, 150)
        progress("fidelity")
    text = stream.getvalue()
    assert "\r" in text and "float reference  64/150" in text
    assert text.count("\n") == 2  # each step ends its line once


@pytest.mark.quick
def test_progress_in_a_log_is_one_plain_line_per_step_without_counts() -> None:
    stream = io.StringIO()
    with Progress(stream, live=False) as progress:
        progress("float reference")
        progress.count(64, 150)
        progress("fidelity")
    lines = stream.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["float reference", "fidelity"]
    assert "\r" not in stream.getvalue() and "64/150" not in stream.getvalue()
