"""Arm Ethos-U through vela, and TFLite Micro: real vela, real TFLite Micro, real LiteRT; nothing mocked.

Each reference model (untrained, from its ``build``: vela's placement and estimates depend on the architecture, not
the weights) exports for the ethos-u55-128 profile; vela's estimates are checked against its summary CSV re-read
here; fidelity is measured with TFLite Micro on the int8 model, whose outputs equal LiteRT's reference kernels;
a float operator stays on the CPU, counted, and a share budget rejects it by name; without the NPU (or its
delegate) the runtime runs the int8 model on the CPU and says so.
"""

from __future__ import annotations

import configparser
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeline.cli import main
from edgeline.device_profiles import load_profile
from edgeline.export.reference import CATALOGUE
from tests.cache import cached_export

pytestmark = pytest.mark.export

REPO = Path(__file__).resolve().parents[1]
MODELS = ("digits", "resnet8", "ds_cnn", "vww", "autoencoder")

FLOAT_OP_MODEL = '''\
import torch
from torch import nn


class WithExp(nn.Module):
    """A 1x1 convolution, then r / (r + 1) of its ReLU, twice (divisions by values the model computes: vela has no
    NPU form for DIV, so the CPU runs them, in int8), then a linear layer: the divisions are a sixth of the model's
    work, which takes the NPU's share under the 90% budget. (It was exp(-x) until vela's lookup tables took EXP.)"""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 1)
        self.fc = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        r = torch.relu(self.conv(x))
        r = r / (r + 1.0)
        return self.fc(torch.flatten(r / (r + 1.0), 1))


def model():
    return WithExp()
'''


def _samples(root: Path, shape: tuple[int, ...], seed: int = 0) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    np.savez(root / "cal.npz", x=rng.random((32, *shape), dtype=np.float32))
    np.savez(root / "val.npz", x=rng.random((16, *shape), dtype=np.float32))
    return root / "cal.npz", root / "val.npz"


def _export(model: str, profile: str, root: Path, shape: tuple[int, ...], *extra: str) -> tuple[int, Path]:
    calibration, validation = _samples(root, shape)
    out = root / "bundle"
    code = main(["export", model, "--profile", profile, "--calibration", str(calibration),
                 "--validation", str(validation), "--out", str(out), "--json", *extra])  # fmt: skip
    return code, out


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _cached_export(model: str, profile: str, root: Path, shape: tuple[int, ...], *extra: str) -> Path:
    """``_export``'s bundle, made once for this code and these samples (tests/cache.py); never modified here."""
    calibration, validation = _samples(root, shape)
    return cached_export(
        model, "--profile", profile, "--calibration", calibration, "--validation", validation, *extra
    )  # fmt: skip


@pytest.fixture(scope="module")
def u55_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = {}
    for name in MODELS:
        root = tmp_path_factory.mktemp(f"u55-{name}")
        made[name] = _cached_export(
            f"edgeline.export.reference.{name}:build", "ethos-u55-128", root, CATALOGUE[name].input_shape,
            "--backend", "ethos-u", "--precision", "int8-static",
        )  # fmt: skip
    return made


@pytest.fixture(scope="module")
def imx93_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _cached_export(
        "edgeline.export.reference.resnet8:build", "imx93", tmp_path_factory.mktemp("imx93"), (3, 32, 32)
    )


def _vela_summary(bundle: Path, profile_id: str, tmp_path: Path) -> dict[str, str]:
    """vela run again, here, on the bundle's int8 model with the profile's settings: its summary CSV, read plainly."""
    settings = load_profile(profile_id).ethos_u
    assert settings is not None
    out = tmp_path / "vela"
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from ethosu.vela.vela import main; sys.exit(main())",
         str(bundle / "model_int8.tflite"), "--accelerator-config", settings.accelerator_config,
         "--config", str(REPO / "device_profiles" / "vela.ini"), "--system-config", settings.system_config,
         "--memory-mode", settings.memory_mode, "--output-dir", str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with (out / f"model_int8_summary_{settings.system_config}.csv").open(newline="") as file:
        (row,) = csv.DictReader(file)
    return row


@pytest.mark.parametrize("name", MODELS)
def test_vela_estimates_are_vela_s_figures_at_the_profile_s_clock(
    name: str, u55_bundles: dict[str, Path], tmp_path: Path
) -> None:
    bundle = u55_bundles[name]
    data = manifest(bundle)
    estimates = data["estimates"]
    csv_row = _vela_summary(bundle, "ethos-u55-128", tmp_path)
    profile = load_profile("ethos-u55-128")
    assert estimates["tool"].startswith("ethos-u-vela 5.2")
    assert estimates["target"] == "ethos-u55-128, system config Ethos_U55_High_End_Embedded, memory mode Shared_Sram"
    assert estimates["clock_mhz"] == profile.ethos_u.clock_mhz  # type: ignore[union-attr]
    assert estimates["cycles"] > 0
    assert estimates["cycles"] == int(float(csv_row["cycles_total"]))
    assert estimates["inference_ms"] == pytest.approx(estimates["cycles"] / (estimates["clock_mhz"] * 1e3))
    assert estimates["inference_ms"] == pytest.approx(float(csv_row["inference_time"]) * 1e3, rel=1e-6)
    assert estimates["sram_bytes"] == round(float(csv_row["sram_memory_used"]) * 1024)
    assert estimates["flash_bytes"] == round(float(csv_row["off_chip_flash_memory_used"]) * 1024)
    assert estimates["macs"] == int(float(csv_row["nn_macs"]))
    assert 0 < estimates["sram_bytes"] <= profile.memory_mb * 2**20
    # vela estimates the NPU's part: what it leaves to the CPU is named as left out (or none is left)
    fallback = data["placement"]["fallback"]
    if fallback:
        assert estimates["covers"].startswith("the NPU's part only"), estimates["covers"]
        assert all(name in estimates["covers"] for name in fallback), (fallback, estimates["covers"])
    else:
        assert estimates["covers"] == "the whole model: vela placed every operator on the NPU"


def test_the_vela_ini_clock_is_each_profile_s_clock() -> None:
    parser = configparser.ConfigParser()
    parser.read(REPO / "device_profiles" / "vela.ini")
    for profile_id in ("ethos-u55-128", "imx93"):
        settings = load_profile(profile_id).ethos_u
        assert settings is not None
        assert parser.has_section(f"Memory_Mode.{settings.memory_mode}")
        assert float(parser[f"System_Config.{settings.system_config}"]["core_clock"]) == settings.clock_mhz * 1e6


@pytest.mark.parametrize("name", MODELS)
def test_the_bundle_keeps_vela_s_model_and_the_int8_model_with_placement(
    name: str, u55_bundles: dict[str, Path]
) -> None:
    from edgeline.backends.ethos_u import operator_names

    bundle = u55_bundles[name]
    data = manifest(bundle)
    assert data["model"] == "model_vela.tflite"
    assert {entry["path"] for entry in data["files"]} >= {"model_vela.tflite", "model_int8.tflite"}
    compiled = operator_names(bundle / "model_vela.tflite")
    int8_ops = [op for op in operator_names(bundle / "model_int8.tflite") if op not in ("QUANTIZE", "DEQUANTIZE")]
    placement = data["placement"]
    assert placement["accelerator"] == "ethos-u"
    assert "ethos-u" in compiled
    assert placement["ops"] == len(int8_ops)
    left = [op for op in compiled if op not in ("ethos-u", "QUANTIZE", "DEQUANTIZE")]
    assert placement["accelerator_ops"] == placement["ops"] - len(left)
    assert sum(placement["fallback"].values()) == len(left)
    assert placement["quantized_ops"] == placement["ops"]  # full-integer


@pytest.mark.parametrize("name", MODELS)
def test_fidelity_says_it_was_measured_with_tflite_micro_on_the_int8_model(
    name: str, u55_bundles: dict[str, Path]
) -> None:
    data = manifest(u55_bundles[name])
    fidelity = data["fidelity"]
    assert fidelity["status"] == "measured"
    assert fidelity["samples"] == 16
    assert fidelity["measured_with"].startswith("TFLite Micro ")
    assert (
        "reference kernels on the int8 model vela compiled (the Ethos-U NPU is not here)" in fidelity["measured_with"]
    )
    assert data["backend"] == "tflite-micro"  # a microcontroller's firmware: TFLite Micro with the Ethos-U driver
    assert data["inputs"][0]["dtype"] == "int8"


@pytest.mark.parametrize("name", MODELS)
def test_tflite_micro_agrees_with_litert_reference_kernels_on_the_int8_model(
    name: str, u55_bundles: dict[str, Path]
) -> None:
    """Within one quantization step: bit-exact on the convolutional models; TFLite Micro's FULLY_CONNECTED rounds
    a few outputs of the autoencoder one step apart from LiteRT's reference kernel."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    from edgeline.backends.tflite_micro import TFLiteMicroSession

    path = u55_bundles[name] / "model_int8.tflite"
    micro = TFLiteMicroSession(path)
    reference = Interpreter(model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    reference.allocate_tensors()
    (spec,) = micro.input_specs()
    rng = np.random.default_rng(3)
    for _ in range(4):
        x = rng.integers(-128, 128, size=spec.shape, dtype=np.int8)
        reference.set_tensor(reference.get_input_details()[0]["index"], x)
        reference.invoke()
        expected = reference.get_tensor(reference.get_output_details()[0]["index"])
        (found,) = micro.run([x])
        assert found.dtype == expected.dtype == np.int8
        difference = np.abs(found.astype(np.int16) - expected.astype(np.int16))
        assert difference.max() <= 1
        assert np.mean(difference == 0) >= 0.95
    assert micro.arena_bytes >= 16 * 1024


def _profile_with(tmp_path: Path, **budgets: float) -> Path:
    """The bundled ethos-u55-128 profile with other share budgets."""
    text = (REPO / "device_profiles" / "profiles" / "ethos-u55-128.toml").read_text()
    for key, value in budgets.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.MULTILINE)
    path = tmp_path / "profile.toml"
    path.write_text(text)
    return path


def test_a_float_operator_stays_on_the_cpu_and_the_choice_moves_on_to_tflite_micro(tmp_path: Path) -> None:
    source = tmp_path / "with_exp.py"
    source.write_text(FLOAT_OP_MODEL, encoding="utf-8")
    (tmp_path / "kept").mkdir()
    loose = _profile_with(tmp_path / "kept", min_accelerator_share=0.0, min_quantized_share=0.0)
    code, kept = _export(f"{source}:model", str(loose), tmp_path / "kept", (3, 8, 8),
                         "--backend", "ethos-u", "--precision", "int8-static")  # fmt: skip
    assert code == 0
    placement = manifest(kept)["placement"]
    assert placement["accelerator_ops"] < placement["ops"]
    assert placement["fallback"] == {"DIV": 2}
    assert placement["quantized_ops"] == placement["ops"]  # TFLite Micro's int8 DIV

    (tmp_path / "auto").mkdir()
    npu_budget = _profile_with(tmp_path / "auto", min_quantized_share=0.0)  # min_accelerator_share stays 0.9
    code, chosen = _export(f"{source}:model", str(npu_budget), tmp_path / "auto", (3, 8, 8))
    assert code == 0
    data = manifest(chosen)
    assert data["backend"] == "tflite-micro"
    assert data["placement"]["accelerator"] is None
    assert data["fidelity"]["measured_with"].startswith("TFLite Micro ")


def test_the_share_budget_names_the_operators_left_to_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "with_exp.py"
    source.write_text(FLOAT_OP_MODEL, encoding="utf-8")
    capsys.readouterr()
    code, _ = _export(f"{source}:model", "ethos-u55-128", tmp_path, (3, 8, 8), "--backend", "ethos-u",
                      "--precision", "int8-static")  # fmt: skip
    assert code != 0
    report = capsys.readouterr()
    text = report.out + report.err
    assert "on ethos-u" in text
    assert "< budget 90%" in text
    assert "DIV x2" in text


def test_imx93_bundle_runs_with_litert_and_falls_back_loudly_without_the_delegate(
    imx93_bundle: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import edgeline

    data = manifest(imx93_bundle)
    assert data["backend"] == "litert"
    assert (
        data["estimates"]["target"]
        == "ethos-u65-256, system config Ethos_U65_High_End, memory mode Dedicated_Sram_384KB"
    )
    assert data["estimates"]["clock_mhz"] == 1000
    assert data["placement"]["accelerator"] == "ethos-u"
    # a Linux device: LiteRT runs what vela leaves to the CPU, so LiteRT measured fidelity (not TFLite Micro)
    assert data["fidelity"]["measured_with"].startswith("LiteRT ")
    absent = tmp_path / "libethosu_delegate.so"
    monkeypatch.setenv("EDGELINE_ETHOSU_DELEGATE", str(absent))
    with caplog.at_level("WARNING"):
        model = edgeline.load(imx93_bundle)
    assert model.accelerator is None
    assert model.accelerator_fallback is not None
    assert "built for ethos-u but running on the CPU" in model.accelerator_fallback
    assert str(absent) in model.accelerator_fallback
    assert "model_int8.tflite" in caplog.text
    (logits,) = model.predict(np.full((1, 3, 32, 32), 0.5, dtype=np.float32))
    assert logits.shape == (1, 10)
    # a file that is not a delegate library: the load fails, and that is the reason given
    absent.write_bytes(b"not a shared library")
    model = edgeline.load(imx93_bundle)
    assert model.accelerator is None
    assert "did not load" in (model.accelerator_fallback or "")


def test_verify_warns_when_the_npu_bundle_runs_on_the_cpu(
    imx93_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(imx93_bundle)]) == 0
    out = capsys.readouterr().out
    assert "WARNING: accelerator fallback: built for ethos-u but running on the CPU" in out


def test_a_vela_model_without_the_int8_model_is_refused_naming_the_file(
    u55_bundles: dict[str, Path], tmp_path: Path
) -> None:
    from edgeline.backends import open_session
    from edgeline.errors import BundleError

    alone = tmp_path / "model_vela.tflite"
    alone.write_bytes((u55_bundles["resnet8"] / "model_vela.tflite").read_bytes())
    for backend, accelerator in (("tflite-micro", None), ("litert", "ethos-u")):
        with pytest.raises(BundleError, match=r"model_vela\.tflite: compiled by vela .* no model_int8\.tflite"):
            open_session(backend, alone, accelerator=accelerator)


def test_ethos_u_refuses_other_precisions_and_profiles_without_an_npu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calibration, validation = _samples(tmp_path, (3, 32, 32))
    for profile, precision, message in (
        ("ethos-u55-128", "fp32", "ethos-u does not export fp32; valid: int8-static"),
        ("rpi5", "int8-static", "ethos-u: profile rpi5 has no [ethos_u] section"),
    ):
        code = main(["export", "edgeline.export.reference.resnet8:build", "--profile", profile, "--calibration",
                     str(calibration), "--validation", str(validation), "--out", str(tmp_path / profile),
                     "--backend", "ethos-u", "--precision", precision])  # fmt: skip
        assert code != 0
        captured = capsys.readouterr()
        assert message in captured.out + captured.err
        assert "Traceback" not in captured.err


def test_the_flash_budget_counts_the_vela_model_not_the_cpu_copy(u55_bundles: dict[str, Path], tmp_path: Path) -> None:
    """max_model_bytes is the device's flash for the model: what goes there is vela's output; the int8 copy beside it
    serves a device without the NPU."""
    sizes = {entry["path"]: entry["size"] for entry in manifest(u55_bundles["digits"])["files"]}
    flash = sizes["model_vela.tflite"]
    assert flash + sizes["model_int8.tflite"] > flash + 1
    budget = _profile_with(tmp_path, max_model_bytes=flash + 1)  # below the two models together
    shape = CATALOGUE["digits"].input_shape
    code, out = _export("edgeline.export.reference.digits:build", str(budget), tmp_path, shape,
                        "--backend", "ethos-u", "--precision", "int8-static")  # fmt: skip
    assert code == 0
    assert manifest(out)["export"]["backend"] == "ethos-u"
