"""ExecuTorch XNNPACK int8 on models the other tests never saw (issue 53): real torch.export, the XNNPACK quantizer
and partitioner, litert-torch and LiteRT, ExecuTorch's runtime; nothing mocked.

- Mixed precision keeps the same tensors float on ExecuTorch as on LiteRT. The model is an MLP on sklearn's digits
  whose ``head.0`` (a Linear, followed by its ReLU ``head.1``) makes one output channel ``OUTLIER`` times the others,
  ``head.2`` reading it divided by the same (the same function: ReLU commutes with a positive scale). XNNPACK
  computes Linear + ReLU in one kernel, as LiteRT does: the outlier tensor is ``head.1``'s, made by ``head.0``, read
  by ``head.2``; keeping it float keeps all three.
- A Conv1d model with MaxPool1d and a global average pool (AdaptiveAvgPool1d(1), and a mean over time) runs 100% on
  XNNPACK in fp32 and int8, with the outputs of the model it was exported from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.device_profiles import Precision
from tests.outlier_model import digits
from tests.training import trained_model

pytestmark = pytest.mark.export

TRAIN = 1400  # the digits before are trained on (and calibrate); those after are held out
CALIBRATION = 32
OUTLIER = 300.0  # what channel 0 of head.0 is multiplied by
KEPT = {"head.0", "head.1", "head.2"}
"""The outlier tensor's maker (head.0, one kernel with its ReLU head.1) and its reader: what an expert keeps float."""

MLP_SOURCE = """\
import torch
from pathlib import Path
from torch import nn


class FragileHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.f(torch.flatten(x, 1)))


def fragile():
    model = FragileHead()
    weights = Path(__file__).with_name("fragile.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""


def _trained_fragile_model() -> Path:
    """The MLP trained on the digits (scaled to [0, 1] outside the model), then its outlier planted."""
    images, labels = digits()

    def plant(module: Any) -> None:
        module.head[0].weight[0] *= OUTLIER
        module.head[0].bias[0] *= OUTLIER
        module.head[2].weight[:, 0] /= OUTLIER

    x, y = images[:TRAIN] / 16.0, labels[:TRAIN]
    return trained_model(
        MLP_SOURCE, "fragile_model.py", "fragile", "fragile.pt", x, y, key=[OUTLIER], epochs=30, edit=plant
    )


@pytest.fixture(scope="module")
def fragile_model() -> Path:
    return _trained_fragile_model()


@pytest.fixture(scope="module")
def fragile_samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    images, labels = digits()
    images = (images / 16.0).astype(np.float32)
    folder = tmp_path_factory.mktemp("samples")
    np.savez(folder / "cal.npz", x=images[:CALIBRATION])
    np.savez(folder / "val.npz", x=images[TRAIN : TRAIN + 100], labels=labels[TRAIN : TRAIN + 100])
    return folder / "cal.npz", folder / "val.npz"


def _export(model: str, samples: tuple[Path, Path], out: Path, **options: Any) -> Any:
    from edgeline.export.pipeline import ExportOptions, run_export

    calibration, validation = samples
    return run_export(
        ExportOptions(model=model, profile="rpi4", calibration=calibration, validation=validation, out=out, **options)
    )


@pytest.fixture(scope="module")
def mixed_exports(
    fragile_model: Path, fragile_samples: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Any]:
    """The fragile MLP through mixed precision on LiteRT and on ExecuTorch XNNPACK: (LiteRT's, ExecuTorch's)."""
    model = f"{fragile_model}:fragile"
    litert = _export(model, fragile_samples, tmp_path_factory.mktemp("litert") / "bundle")
    executorch = _export(
        model,
        fragile_samples,
        tmp_path_factory.mktemp("executorch") / "bundle",
        backend="executorch-xnnpack",
        precision=Precision.INT8_STATIC,
    )
    return litert.outcomes[0], executorch.outcomes[0]


def _held_out_accuracy(bundle: Path) -> float:
    from edgeline.model import load

    images, labels = digits()
    deployed = load(bundle)
    found = [int(np.argmax(deployed.predict(image[None] / 16.0)[0])) for image in images[TRAIN:].astype(np.float32)]
    return float(np.mean(np.array(found) == labels[TRAIN:]))


def test_executorch_keeps_the_same_group_float_as_litert_and_meets_the_budget(mixed_exports: Any) -> None:
    """The outlier tensor's group is the same tensors on both backends, kept in one step; ExecuTorch's bundle meets
    the budget, and holds its accuracy on the held-out digits too."""
    litert, executorch = mixed_exports
    assert litert.status == "selected", litert.reason
    assert {kept.module for kept in litert.kept_float} == KEPT
    assert executorch.status == "selected", executorch.reason
    assert {kept.module for kept in executorch.kept_float} == KEPT
    # the ranking names the outlier tensor first on both: the ReLU's output, its Linear having no tensor of its own
    assert executorch.layers and min(executorch.layers, key=_added).module == "head.1"
    assert "head.0" not in {layer.module for layer in executorch.layers}
    float_accuracy, bundle_accuracy = _float_accuracy(), _held_out_accuracy(executorch.bundle)
    assert bundle_accuracy >= float_accuracy - 0.01, (bundle_accuracy, float_accuracy)


def _added(layer: Any) -> float:
    return layer.added_sqnr_db if layer.added_sqnr_db is not None else float("inf")


def _float_accuracy() -> float:
    import torch

    from edgeline.export.loading import load_model

    images, labels = digits()
    module = load_model(f"{_trained_fragile_model()}:fragile").module
    with torch.no_grad():
        found = module(torch.from_numpy(images[TRAIN:] / 16.0)).argmax(1).numpy()
    return float(np.mean(found == labels[TRAIN:]))


# -- MaxPool1d and the global average pool on XNNPACK ----------------------------------------------------------------

POOL_SOURCE = """\
import torch
from torch import nn


class Pools1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(3, 16, 5, padding=2)
        self.act1 = nn.ReLU()
        self.pool1 = nn.MaxPool1d(2)
        self.conv2 = nn.Conv1d(16, 16, 3, padding=1)
        self.act2 = nn.ReLU()
        self.pool2 = nn.MaxPool1d(3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(16, 24, 3, padding=1)
        self.act3 = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(24 + 16, 4)

    def forward(self, x):
        x = self.pool1(self.act1(self.conv1(x)))
        x = self.pool2(self.act2(self.conv2(x)))
        over_time = x.mean(dim=-1)
        pooled = self.gap(self.act3(self.conv3(x))).flatten(1)
        return self.fc(torch.cat([pooled, over_time], dim=1))


def pools():
    torch.manual_seed(0)
    return Pools1d().eval()
"""


@pytest.fixture(scope="module")
def pool_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from edgeline.export.loading import load_model

    source = tmp_path_factory.mktemp("pools") / "pool_model.py"
    source.write_text(POOL_SOURCE, encoding="utf-8")
    return load_model(f"{source}:pools").module


def _signals(count: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.standard_normal((count, 1, 3, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def pool_exports(pool_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[Precision, tuple[Any, Path]]:
    """The pooling model through the XNNPACK exporter, fp32 and int8-static: per precision, the placement and the
    program file."""
    import torch

    from edgeline.export.backends import ExportRequest, get_exporter

    calibration = [(torch.from_numpy(s),) for s in _signals(16)]
    made = {}
    for precision in (Precision.FP32, Precision.INT8_STATIC):
        out = tmp_path_factory.mktemp(f"pools-{precision.value}")
        request = ExportRequest(pool_model, calibration[0], calibration, precision, out, ("x",))
        exported = get_exporter("executorch-xnnpack").export(request)
        made[precision] = (exported.placement, out / exported.model_file)
    return made


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.INT8_STATIC])
def test_one_dimensional_pools_run_on_xnnpack(pool_exports: Any, pool_model: Any, precision: Precision) -> None:
    """Every operator of the model on XNNPACK, in int8 for int8-static: MaxPool1d (one with padding), the
    AdaptiveAvgPool1d(1) and the mean over time included; the program, run by ExecuTorch, computes the model's
    function (fp32: its values; int8: within int8's noise)."""
    import torch
    from executorch.runtime import Runtime

    placement, path = pool_exports[precision]
    assert placement.accelerator_ops == placement.ops, placement.fallback
    assert placement.fallback == {}
    if precision.integer:
        assert placement.quantized_ops == placement.ops, placement
    method = Runtime.get().load_program(path).load_method("forward")
    expected, got = [], []
    for signal in _signals(16):
        with torch.no_grad():
            expected.append(pool_model(torch.from_numpy(signal)).numpy())
        got.append(method.execute([torch.from_numpy(signal)])[0].numpy())
    if precision is Precision.FP32:
        np.testing.assert_allclose(np.concatenate(got), np.concatenate(expected), rtol=1e-5, atol=1e-5)
    else:
        reference, deployed = np.concatenate(expected).ravel(), np.concatenate(got).ravel()
        cosine = float(reference @ deployed / np.linalg.norm(reference) / np.linalg.norm(deployed))
        assert cosine > 0.99, cosine


def test_the_rewritten_graph_is_the_same_function(pool_model: Any) -> None:
    """The 1-D pools as 2-D ones, before any quantizer or partitioner: exactly the same values, every new node with
    the module (and source line) of the pool it replaces."""
    import torch

    from edgeline.export.graph import module_path
    from edgeline.export.xnnpack_forms import xnnpack_pools

    signals = _signals(4)
    graph = torch.export.export(pool_model, (torch.from_numpy(signals[0]),)).module()
    assert xnnpack_pools(graph) == 4  # two MaxPool1d, the AdaptiveAvgPool1d, the mean over time
    for signal in signals:
        x = torch.from_numpy(signal)
        with torch.no_grad():
            assert torch.equal(graph(x), pool_model(x))
    made = {module_path(n) for n in graph.graph.nodes if n.op == "call_function" and "pool2d" in str(n.target)}
    assert made == {"pool1", "pool2"}


LEFT_SOURCE = """\
import torch
from torch import nn


class LeftOver(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool1d(2, stride=3)

    def forward(self, x):
        x = self.pool(self.conv(x))
        return torch.cumsum(x, dim=-1)


def left_over():
    torch.manual_seed(0)
    return LeftOver().eval()
"""


def test_the_placement_names_the_module_and_line_of_what_xnnpack_left(tmp_path: Path) -> None:
    """Operators XNNPACK does not take (a max pool whose stride is longer than its window, a cumulative sum) are
    named in the placement with the module and the model's line that made them, not only counted."""
    import torch

    from edgeline.export.backends import ExportRequest, get_exporter
    from edgeline.export.loading import load_model

    source = tmp_path / "left_model.py"
    source.write_text(LEFT_SOURCE, encoding="utf-8")
    module = load_model(f"{source}:left_over").module
    sample = (torch.from_numpy(_signals(1)[0]),)
    request = ExportRequest(module, sample, [sample], Precision.FP32, tmp_path / "out", ("x",))
    (tmp_path / "out").mkdir()
    placement = get_exporter("executorch-xnnpack").export(request).placement
    assert placement is not None and placement.accelerator_ops is not None and placement.ops is not None
    assert placement.accelerator_ops < placement.ops
    assert set(placement.fallback_sources) == set(placement.fallback), placement
    (cumsum,) = [name for name in placement.fallback if "cumsum" in name]
    assert placement.fallback_sources[cumsum] == ["forward() (left_model.py:13)"]
    pooled = [name for name in placement.fallback if "max_pool" in name]
    assert pooled and all(placement.fallback_sources[name] == ["pool (left_model.py:12)"] for name in pooled)
