"""Every failure inside one target is that target's failure; a failure of the model itself is said once.

A small transformer with a GELU feed-forward and a SIGN before its head, trained on scikit-learn's real digits: LiteRT
converts and runs it, TFLite Micro has no SIGN kernel (GELU it gets as its tanh approximation: see
``edgeline.export.full_integer``), so the Ethos-U and TFLite Micro targets fail when their model is loaded back (the
staging folder holding it is gone by the time the user reads the message: the message names the bundle's file). A
model whose forward loops or branches on a tensor's value cannot be captured by torch.export, which every exporter
starts from: one error naming the model's line, no target tried. Real converters and runtimes, nothing mocked.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import edgeline
from edgeline.cli import main
from edgeline.device_profiles import load_profile
from edgeline.export.reference.data import calibration_subset, load_digits_split
from edgeline.export.reference.training import fit_classifier, seeded_build

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.export  # real conversions: vela, TFLite Micro and LiteRT (a minute or two on two cores)

TRANSFORMER_SOURCE = '''\
from pathlib import Path

import torch
from torch import nn


class TinyTransformer(nn.Module):
    """An 8x8 digit as 8 row tokens: embedding, one encoder layer (GELU feed-forward), mean pool, 10 logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.encoder = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, activation="gelu", batch_first=True
        )
        self.head = nn.Linear(16, 10)

    def forward(self, image):
        tokens = self.encoder(self.embed(image.reshape(image.shape[0], 8, 8)))
        pooled = tokens.mean(dim=1)
        return self.head(torch.sign(pooled) * pooled)  # |x| as SIGN and MUL: TFLite Micro has no SIGN kernel


def model():
    net = TinyTransformer()
    net.load_state_dict(torch.load(Path(__file__).with_name("weights.pt")))
    return net
'''

# Forwards that decide on a tensor's value in Python; the marked line is the one to name.
DATA_DEPENDENT = {
    "while": """\
        x = image.flatten(1)
        while x.abs().sum() > 1.0:  # the model's line
            x = x / 2
        return self.fc(x)
""",
    "range": """\
        x = image.flatten(1)
        for _ in range(int(x.max() * 4)):  # the model's line
            x = torch.relu(x - 0.1)
        return self.fc(x)
""",
    "if": """\
        x = image.flatten(1)
        if x.mean() > 0.25:  # the model's line
            x = x * 0.5
        return self.fc(x)
""",
}

DATA_DEPENDENT_SOURCE = """\
import torch
from torch import nn


class Decides(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 10)

    def forward(self, image):
{body}

def model():
    return Decides()
"""


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real 8x8 digits: 64 training images to calibrate, 96 held-out ones with their labels to validate."""
    split = load_digits_split()
    root = tmp_path_factory.mktemp("digits")
    files = {"calibration": root / "calibration.npz", "validation": root / "validation.npz"}
    np.savez(files["calibration"], image=calibration_subset(split.train_images[:, None], 0, 64))
    np.savez(files["validation"], image=split.validation_images[:96, None], labels=split.validation_labels[:96])
    return files


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny transformer's file, its weights trained next to it once (the export loads them)."""
    root = tmp_path_factory.mktemp("transformer")
    source = root / "tiny_transformer.py"
    source.write_text(TRANSFORMER_SOURCE, encoding="utf-8")
    split = load_digits_split()
    net = seeded_build(runpy.run_path(str(source))["TinyTransformer"], 0)
    net = fit_classifier(
        net, split.train_images[:, None], split.train_labels, steps=60, batch_size=64, learning_rate=0.01, seed=0
    )
    torch.save(net.state_dict(), root / "weights.pt")
    return source


def _export(model: str, profile: str, digits: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """The command line."""
    return [
        "export", model, "--profile", profile, "--calibration", str(digits["calibration"]),
        "--validation", str(digits["validation"]), "--out", str(out), *extra,
    ]  # fmt: skip


def _edgeline(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: all it shows (the converters' own output is kept from the terminal) must
    name no staging folder, deleted by then, and hold no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "edgeline.cli", *args], capture_output=True, text=True, timeout=600, check=False
    )
    shown = done.stdout + done.stderr
    assert f".{out.name}.staging" not in shown and "Traceback" not in shown, shown
    return done


def test_a_target_its_runtime_cannot_load_fails_alone_and_the_next_is_picked(
    tmp_path: Path, transformer: Path, digits: dict[str, Path]
) -> None:
    # a Linux board whose first target is TFLite Micro (no SIGN kernel), then LiteRT
    text = (REPO / "device_profiles" / "profiles" / "imx93.toml").read_text()
    start = text.index("[[targets]]")
    targets = "".join(
        f'[[targets]]\nbackend = "{backend}"\nprecision = "{precision}"\nthreads = 2\n\n'
        for backend, precision in (("tflite-micro", "int8-static"), ("litert", "fp32"))
    )
    profile = tmp_path / "board.toml"
    profile.write_text(text[:start] + targets + text[text.index("[budgets]") :])
    out = tmp_path / "tiny"
    done = _edgeline(_export(f"{transformer}:model", str(profile), digits, out, "--json"), out)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    first, second = report["targets"]
    assert first["backend"] == "tflite-micro"
    assert first["status"] == "failed" and "SIGN" in first["reason"]
    assert "whose runtime has it (LiteRT): litert fp32" in first["reason"], first["reason"]
    named = first["reason"].split(":")[0]  # the file inside the bundle, not the deleted staging folder's path
    assert "/" not in named and named.endswith(".tflite"), first["reason"]
    assert second["status"] == "selected" and second["backend"] == "litert"
    assert report["bundle"] == str(out)
    assert edgeline.load(out).manifest.precision == second["precision"]


def test_the_imx93_npu_target_checks_the_cpu_s_operators_with_litert_as_the_device_runs_them(
    tmp_path: Path, transformer: Path, digits: dict[str, Path]
) -> None:
    """On the i.MX 93 (Linux), LiteRT runs what vela leaves to the Cortex-A55: SIGN included, which TFLite Micro
    lacks. The Ethos-U target is measured, not failed on a kernel the device does not use."""
    out = tmp_path / "tiny"
    done = _edgeline(_export(f"{transformer}:model", "imx93", digits, out, "--json", "--all"), out)
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout)["targets"][0]
    assert first["backend"] == "ethos-u" and first["status"] != "failed", first["reason"]
    assert first["fidelity"]["measured_with"].startswith("LiteRT ")


def test_when_every_target_fails_the_table_gives_each_reason(
    tmp_path: Path, transformer: Path, digits: dict[str, Path]
) -> None:
    out = tmp_path / "tiny"
    done = _edgeline(_export(f"{transformer}:model", "ethos-u55-128", digits, out), out)
    assert done.returncode == 1, done.stderr  # as when no target meets the budgets
    rows = [line for line in done.stdout.splitlines() if " failed " in line]
    targets = load_profile("ethos-u55-128").targets
    assert len(rows) == len(targets) == 2
    for row, target in zip(rows, targets, strict=True):
        assert row.startswith(target.backend) and "SIGN" in row, row
    # The first names the model's line; the second, whose int8 model runs on the same kernels, is not converted
    # again (it took 38 s to fail the same way), and both say which targets have the kernel (none here: no LiteRT)
    assert "the model makes SIGN at aten.sign" in rows[0] and "tiny_transformer.py:" in rows[0], rows[0]
    assert "torch.sign(pooled)" in rows[0], rows[0]
    assert "not converted again" in rows[1] and f"as {targets[0].backend} int8-static found" in rows[1], rows[1]
    assert all("no target of ethos-u55-128 runs LiteRT" in row for row in rows), rows
    assert "could be exported" in done.stdout and "nothing was written" in done.stdout  # no budget was judged
    assert not out.exists()


def test_an_explicit_target_that_fails_to_load_is_one_error_line(
    tmp_path: Path, transformer: Path, digits: dict[str, Path]
) -> None:
    out = tmp_path / "tiny"
    args = ["--backend", "tflite-micro", "--precision", "int8-static"]
    done = _edgeline(_export(f"{transformer}:model", "ethos-u55-128", digits, out, *args), out)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("edgeline export: error: ")]
    assert len(errors) == 1 and done.stderr.rstrip("\n").endswith(errors[0]), done.stderr
    message = errors[0].removeprefix("edgeline export: error: ")
    assert message.startswith("tflite-micro int8-static: ") and "SIGN" in message, message
    # named where the model makes it, as the profile's own run of its targets does (issue 53: with --backend the
    # refusal named no module or line)
    assert "the model makes SIGN at aten.sign" in message and "tiny_transformer.py:" in message, message
    assert not out.exists()


@pytest.mark.parametrize("form", sorted(DATA_DEPENDENT))
def test_a_data_dependent_forward_is_one_error_naming_the_models_line(
    form: str, tmp_path: Path, digits: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    body = DATA_DEPENDENT[form]
    source = tmp_path / "decides.py"
    source.write_text(DATA_DEPENDENT_SOURCE.format(body=body), encoding="utf-8")
    lines = source.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if line.endswith("# the model's line"))
    out = tmp_path / "decides"
    code = main(_export(f"{source}:model", "rpi5", digits, out))
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err, captured.err
    errors = [line for line in captured.err.splitlines() if line.startswith("edgeline export: error: ")]
    assert len(errors) == 1 and captured.err.rstrip("\n").endswith(errors[0]), captured.err
    assert f"{source}:{number}" in errors[0] and lines[number - 1].split("#")[0].strip() in errors[0]
    assert "converting" not in captured.err  # no target was tried: each would fail the same way
    assert captured.out == "" and not out.exists()


def test_an_explicit_target_on_a_data_dependent_forward_gets_the_same_one_error(
    tmp_path: Path, digits: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "decides.py"
    source.write_text(DATA_DEPENDENT_SOURCE.format(body=DATA_DEPENDENT["while"]), encoding="utf-8")
    number = next(i for i, line in enumerate(source.read_text().splitlines(), 1) if line.endswith("# the model's line"))
    code = main(
        _export(f"{source}:model", "rpi5", digits, tmp_path / "out", "--backend", "litert", "--precision", "fp32")
    )
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err, captured.err
    assert f"{source}:{number}" in captured.err.splitlines()[-1]
    assert "converting" not in captured.err and "backends that convert it" not in captured.err
