"""The openvino export backend on the digits reference model: fp32, fp16 and int8 (NNCF) bundles for x86-64, and an
NPU bundle for intel-core-ultra, which this machine cannot run on its NPU.

Each claim is checked apart from the exporter: the IR read as XML (its weights' precision, its quantizers), the model
run through OpenVINO's own API and the float model through torch, on the validation samples the export measured (the
manifest's figures recomputed) and on held-out digits the export never saw (the accuracy an int8 bundle loses)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeline
from edgeline.cli import main
from tests.cache import cached_export, cached_reference

pytestmark = pytest.mark.export

VALIDATION = 150
"""The first 150 held-out digits are the export's validation samples; the 300 after it never sees."""


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    prepared = cached_reference("digits")
    held_out = np.load(prepared.directory / "validation.npz")
    folder = tmp_path_factory.mktemp("digits")
    np.savez(folder / "validation.npz", x=held_out["x"][:VALIDATION], labels=held_out["labels"][:VALIDATION])
    return {
        "model": prepared.directory / "model.pt2",
        "calibration": prepared.directory / "calibration.npz",
        "validation": folder / "validation.npz",
        "x": held_out["x"],
        "labels": held_out["labels"],
    }


def _export(digits: dict[str, Any], profile: str, *target: str) -> Path:
    return cached_export(
        digits["model"], "--profile", profile, *target,
        "--calibration", digits["calibration"], "--validation", digits["validation"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def bundles(digits: dict[str, Any]) -> dict[str, Path]:
    made = {
        precision: _export(digits, "x86-64", "--backend", "openvino", "--precision", precision)
        for precision in ("fp32", "fp16", "int8-static")
    }
    made["npu"] = _export(digits, "intel-core-ultra")
    return made


def manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_text())


def float_outputs(digits: dict[str, Any]) -> np.ndarray:
    import torch

    module = torch.export.load(str(digits["model"])).module()
    with torch.no_grad():
        return np.concatenate([module(torch.from_numpy(x[None])).numpy() for x in digits["x"]])


@pytest.fixture(scope="module")
def reference(digits: dict[str, Any]) -> np.ndarray:
    """The float model's outputs on every held-out digit, one per call: computed once, read by each test."""
    outputs = float_outputs(digits)
    outputs.setflags(write=False)
    return outputs


def openvino_outputs(bundle: Path, images: np.ndarray, threads: int | None = 1) -> np.ndarray:
    """The IR through OpenVINO's own API, the CPU plugin in the precision the IR names (f32, or f16: a CPU with
    AVX512-FP16 computes it; one with AVX512-BF16 and no FP16 would compute bf16, and is asked for f32 as the session
    asks; others compute f32 whatever the hint), one image per call, on ``threads`` (None: the plugin's choice)."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(bundle / "model.xml"))
    precision = str(model.get_rt_info(["edgeline", "inference_precision"]).astype(str))
    # as a session compiles it (one thread, latency first): fp16 sums land apart with other thread counts
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    compiled = core.compile_model(model, "CPU", config)
    computes = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # f32, f16, bf16
    if computes not in ("f32", precision):
        # a CPU with AVX512-BF16 and no FP16 computes an f16 hint in bf16: the bundle is computed in f32 there
        compiled = core.compile_model(model, "CPU", {**config, "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return np.concatenate([np.array(request.infer([x[None]])[compiled.output(0)]) for x in images])


def constants(bundle: Path) -> list[str]:
    """The element types of the IR's weights (its Const layers)."""
    root = ET.parse(bundle / "model.xml").getroot()
    found = []
    for layer in root.iter("layer"):
        data = layer.find("data")
        if layer.get("type") == "Const" and data is not None and int(data.get("size", "0")) > 64:
            found.append(str(data.get("element_type")))
    return found


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8-static"])
def test_the_manifest_s_fidelity_is_what_openvino_and_torch_give_apart(
    precision: str, bundles: dict[str, Path], digits: dict[str, Any], reference: np.ndarray
) -> None:
    bundle = bundles[precision]
    fidelity = manifest(bundle)["fidelity"]
    assert fidelity["status"] == "measured" and fidelity["samples"] == VALIDATION
    reference = reference[:VALIDATION]
    found = openvino_outputs(bundle, digits["x"][:VALIDATION])
    labels = digits["labels"][:VALIDATION]
    # (the export measures in batches: computed in fp16, a batch's sums round apart from one sample's)
    close = {"rel": 1e-3, "abs": 1e-4} if precision == "fp16" else {"rel": 1e-5, "abs": 1e-6}
    assert fidelity["max_abs_error"] == pytest.approx(float(np.abs(found - reference).max()), **close)
    assert fidelity["accuracy"] == float(np.mean(found.argmax(1) == labels))
    assert fidelity["accuracy_float"] == float(np.mean(reference.argmax(1) == labels))
    assert fidelity["top1_agreement"] == float(np.mean(found.argmax(1) == reference.argmax(1)))


@pytest.mark.parametrize(("precision", "most_lost"), [("fp32", 0.0), ("fp16", 0.0), ("int8-static", 0.5)])
def test_on_digits_the_export_never_saw_the_bundle_keeps_the_float_model_s_accuracy(
    precision: str, most_lost: float, bundles: dict[str, Path], digits: dict[str, Any], reference: np.ndarray
) -> None:
    hidden, labels = digits["x"][VALIDATION:], digits["labels"][VALIDATION:]
    reference = reference[VALIDATION:]
    deployed = edgeline.load(bundles[precision])
    found = np.concatenate([deployed.predict(x)[0] for x in hidden])
    assert np.array_equal(found, openvino_outputs(bundles[precision], hidden))  # edgeline adds nothing of its own
    lost = 100.0 * (np.mean(reference.argmax(1) == labels) - np.mean(found.argmax(1) == labels))
    assert lost <= most_lost, f"{precision}: {lost:.2f} points lost on {len(hidden)} held-out digits"
    if precision == "fp32":
        assert np.abs(found - reference).max() < 1e-4


def test_fp32_weights_stay_fp32_and_fp16_ones_are_fp16(bundles: dict[str, Path]) -> None:
    """save_model compresses to fp16 by default: an fp32 bundle must not be fp16 in disguise."""
    fp32, fp16 = constants(bundles["fp32"]), constants(bundles["fp16"])
    assert fp32 and set(fp32) == {"f32"}, fp32
    assert "f16" in fp16 and "f32" not in fp16, fp16
    assert (bundles["fp16"] / "model.bin").stat().st_size < 0.6 * (bundles["fp32"] / "model.bin").stat().st_size


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8-static"])
def test_the_ir_names_the_precision_its_fidelity_was_measured_in(precision: str, bundles: dict[str, Path]) -> None:
    from edgeline.backends.openvino import OpenVINOSession
    from edgeline.isa import instruction_set

    wanted = "f16" if precision == "fp16" else "f32"
    assert f'<inference_precision value="{wanted}"' in (bundles[precision] / "model.xml").read_text()
    session = OpenVINOSession(bundles[precision] / "model.xml")
    assert session.precision == wanted
    if precision != "fp16":
        assert session.computes == "f32" and manifest(bundles[precision])["fidelity"]["computed_in"] == "f32"
        return
    fidelity = manifest(bundles["fp16"])["fidelity"]
    measured_with = fidelity.get("measured_with") or ""
    assert fidelity["computed_in"] == session.computes and fidelity["instruction_set"] == instruction_set()
    if "FP16" in cpu_capabilities():  # AVX512-FP16 (a Xeon of the 4th generation on): computed in fp16
        assert session.computes == "f16" and "computed in fp32" not in measured_with
    else:  # a CPU that computes no fp16 (with AVX512-BF16 the plugin would pick bf16: pinned to f32): said so
        assert session.computes == "f32" and "the fp16 weights were computed in fp32" in measured_with


def cpu_capabilities() -> list[str]:
    import openvino as ov

    return list(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def test_the_int8_bundle_is_int8_by_its_quantizers_and_its_placement(bundles: dict[str, Path]) -> None:
    bundle = bundles["int8-static"]
    root = ET.parse(bundle / "model.xml").getroot()
    kinds = [layer.get("type") for layer in root.iter("layer")]
    assert kinds.count("FakeQuantize") >= 3
    assert "i8" in constants(bundle)
    data = manifest(bundle)
    placement = data["placement"]
    assert placement["quantized_macs"] / placement["macs"] >= 0.9
    assert placement["quantized_ops"] >= 3 and placement["accelerator"] is None
    assert data["export"]["nncf"] and data["runtime"]["package"] == "openvino"
    assert sorted(entry["path"] for entry in data["files"]) == ["golden.npz", "model.bin", "model.xml"]


def test_the_npu_bundle_names_the_npu_and_why_its_share_is_unknown(bundles: dict[str, Path]) -> None:
    data = manifest(bundles["npu"])
    assert data["export"]["backend"] == "openvino-npu" and data["backend"] == "openvino"
    assert data["precision"] == "int8-static"
    placement = data["placement"]
    assert placement["accelerator"] == "NPU" and placement["accelerator_ops"] is None
    assert "there is no NPU here" in placement["unknown"]["accelerator_ops"]
    assert "NPU plugin, which was not measured" in data["fidelity"]["measured_with"]


def test_the_npu_bundle_runs_on_the_cpu_here_and_says_so_once(
    bundles: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = edgeline.load(bundles["npu"])
    assert model.accelerator is None
    assert model.accelerator_fallback is not None
    assert model.accelerator_fallback.startswith("built for NPU but running on the CPU")
    assert model.enable_batching(4) == 4  # the CPU plugin batches; an NPU session would not
    capsys.readouterr()
    assert main(["verify", str(bundles["npu"])]) == 0
    captured = capsys.readouterr()
    assert len([line for line in captured.err.splitlines() if "built for NPU" in line]) == 1, captured.err


def test_the_daemon_says_the_npu_bundle_falls_back(
    bundles: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from edgeline.daemon.config import DaemonConfig
    from edgeline.daemon.service import Daemon

    payloads = tmp_path / "payloads.jsonl"
    payloads.write_text("")
    config = DaemonConfig.model_validate(
        {"source": {"kind": "replay", "path": str(payloads)}, "daemon": {"state_dir": str(tmp_path / "state")}}
    )
    daemon = Daemon(bundles["npu"], config)
    with caplog.at_level(logging.WARNING):
        daemon.start()
    try:
        assert any("NPU" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
        status = daemon.status()
        assert status["accelerator"]["wanted"] == "NPU" and status["accelerator"]["in_use"] is None
    finally:
        daemon.stop()


def test_exporting_sends_no_telemetry(tmp_path: Path) -> None:
    """convert_model and NNCF send usage data to Google Analytics when openvino-telemetry imports and no opt-out
    file exists: an export imports neither's sender."""
    code = """
import sys, torch
from pathlib import Path
from edgeline.device_profiles import Precision
from edgeline.export.backends import ExportRequest, get_exporter
module = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 3))
samples = [(torch.rand(1, 1, 8, 8),) for _ in range(8)]
request = ExportRequest(module.eval(), samples[0], samples, Precision.INT8_STATIC, Path(sys.argv[1]), ("x",))
get_exporter("openvino").export(request)
import nncf.telemetry.wrapper as wrapper
import openvino.tools.ovc.telemetry_utils as ovc
print(sys.modules.get("openvino_telemetry", "absent"), isinstance(wrapper.telemetry, wrapper.NNCFTelemetry),
      ovc.tm.__name__)
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sender, nncf_sends, ovc_telemetry = done.stdout.split()[-3:]
    assert sender == "None"  # blocked: `import openvino_telemetry` fails, each library uses its no-op stub
    assert nncf_sends == "False"
    assert ovc_telemetry == "openvino.tools.ovc.telemetry_stub"


def test_an_unknown_device_profile_target_precision_is_refused_in_one_line(
    digits: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["export", str(digits["model"]), "--profile", "intel-core-ultra", "--backend", "openvino-npu",
                 "--precision", "fp32", "--calibration", str(digits["calibration"]),
                 "--out", str(tmp_path / "b")])  # fmt: skip
    assert code != 0
    err = capsys.readouterr().err
    assert "openvino-npu does not export fp32; valid: fp16, int8-static" in err and "Traceback" not in err


def test_a_device_present_at_export_is_asked_which_operators_it_supports(bundles: dict[str, Path]) -> None:
    """No GPU or NPU here: the CPU plugin stands in for a device the export machine has. query_model says it supports
    every operator, so the whole model is on it; the counts are those of the CPU's own placement."""
    import openvino as ov

    from edgeline.device_profiles import Precision
    from edgeline.export.backends.openvino import openvino_placement, unsupported_operators

    core = ov.Core()
    model = core.read_model(str(bundles["int8-static"] / "model.xml"))
    assert unsupported_operators(core, model, "CPU") == {}
    on_device = openvino_placement(core, model, Precision.INT8_STATIC, "CPU", True, "f32")
    plain = manifest(bundles["int8-static"])["placement"]
    assert on_device.accelerator_ops == on_device.ops == plain["ops"]
    assert on_device.quantized_macs == plain["quantized_macs"] and on_device.unknown == {}


def reference_int8(name: str) -> Path:
    """Reference model ``name`` exported to OpenVINO int8 for x86-64 (cached)."""
    prepared = cached_reference(name)
    directory = prepared.directory
    labels_file = directory / "labels.txt"
    return cached_export(
        directory / "model.pt2", "--profile", "x86-64", "--backend", "openvino", "--precision", "int8-static",
        "--calibration", directory / "calibration.npz", "--validation", directory / "validation.npz",
        *(("--labels", labels_file) if labels_file.exists() else ()),
        *(("--task", prepared.task, "--threshold", repr(prepared.threshold)) if prepared.threshold is not None else ()),
    )  # fmt: skip


def test_an_int8_model_of_fully_connected_layers_answers_alike_on_one_thread_and_on_two(tmp_path: Path) -> None:
    """The int8 autoencoder (ten fully connected layers) through edgeline's session on one thread and on two: the
    same answers. On one thread OpenVINO 2026 fuses the layers into one kernel that computes wrong results on a Xeon
    with AMX (the anomaly decisions 50% right): a session that finds that fusion runs on two threads instead."""
    import openvino as ov

    from edgeline.backends.openvino import OpenVINOSession, fused_int8_matmuls, set_cache_dir

    bundle = reference_int8("autoencoder")
    x = np.load(cached_reference("autoencoder").directory / "validation.npz")["x"]
    one, two = (OpenVINOSession(bundle / "model.xml", threads=n) for n in (1, 2))
    core = ov.Core()
    model = core.read_model(str(bundle / "model.xml"))
    one_thread = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"}
    fused = fused_int8_matmuls(model, core.compile_model(model, "CPU", one_thread))
    assert one.threads == (2 if fused else 1) and two.threads == 2
    first = np.concatenate([one.run([sample[None]])[0] for sample in x])
    second = np.concatenate([two.run([sample[None]])[0] for sample in x])
    np.testing.assert_allclose(first, second, rtol=1e-4, atol=1e-4 * float(np.abs(second).max()))
    # and with the compiled-model cache (a daemon's): a compilation cached on one thread would keep the fusion
    set_cache_dir(tmp_path / "cache")
    again = [OpenVINOSession(bundle / "model.xml", threads=1) for _ in range(2)]
    assert [session.from_cache for session in again] == [False, False] and not list((tmp_path / "cache").iterdir())
    found = np.concatenate([again[1].run([sample[None]])[0] for sample in x])
    np.testing.assert_allclose(found, second, rtol=1e-4, atol=1e-4 * float(np.abs(second).max()))


@pytest.mark.parametrize("name", ["digits", "resnet8", "ds_cnn", "vww", "autoencoder"])
def test_int8_loses_what_the_manifest_says_and_within_the_budget_on_each_reference_model(name: str) -> None:
    """Each reference model exported to OpenVINO int8 (NNCF) for x86-64, run through OpenVINO's own API on its
    validation samples, against the float model run through torch: accuracy for the classifiers, the anomaly
    decision at the model's threshold for the autoencoder. The points lost are what the manifest says (to one sample:
    the export ran one thread, this the plugin's choice), and within the profile's budget.

    Not a fixed bar below the budget: the model is trained on the machine the suite runs on, and torch's kernels
    differ by CPU, so are its weights. On this suite's Xeon with AMX ResNet-8 loses 0.22 point; trained on an EPYC (Zen
    4) it lost 0.67 (3 of 450 samples), and trained here as AVX2-only or as Zen 4 (``edgeline.sim.cpu_kind``), other
    weights again. The same trained model exported on each kind of CPU loses the same, to the sample
    (benchmarks/results/cpu_kinds.md)."""
    import torch

    prepared = cached_reference(name)
    directory = prepared.directory
    validation = np.load(directory / "validation.npz")
    bundle = reference_int8(name)
    data = manifest(bundle)
    assert data["precision"] == "int8-static" and data["placement"]["quantized_macs"] / data["placement"]["macs"] > 0.8
    x, truth = validation["x"], validation["labels"]
    module = torch.export.load(str(directory / "model.pt2")).module()
    with torch.no_grad():
        reference = np.concatenate([module(torch.from_numpy(x[i : i + 1])).numpy() for i in range(len(x))])
    found = openvino_outputs(bundle, x, threads=None)  # (one thread fuses the autoencoder's int8 layers: see above)
    if prepared.threshold is None:
        lost = 100.0 * (np.mean(reference.argmax(1) == truth) - np.mean(found.argmax(1) == truth))
    else:  # the anomaly score: the reconstruction error of the input, above the threshold
        flat = x.reshape(len(x), -1)

        def flags(outputs: np.ndarray) -> np.ndarray:
            return np.mean((outputs.reshape(len(x), -1) - flat) ** 2, axis=1) > prepared.threshold

        lost = 100.0 * (np.mean(flags(reference) == truth.astype(bool)) - np.mean(flags(found) == truth.astype(bool)))
    fidelity = data["fidelity"]
    said_lost = 100.0 * (fidelity["accuracy_float"] - fidelity["accuracy"])
    assert abs(lost - said_lost) <= 100.0 / len(x) + 1e-9, (name, lost, said_lost)
    budget = data["budgets"]["max_accuracy_drop"]
    assert lost <= budget, f"{name}: {lost:.2f} points lost by int8 on {len(x)} samples (budget {budget})"


@pytest.mark.parametrize("name", ["digits", "resnet8", "ds_cnn", "vww", "autoencoder"])
def test_every_weighted_ir_operator_is_named_by_its_own_module(name: str) -> None:
    """What NNCF reverts is listed by module: each convolution and matrix product of the IR, a depthwise one or one
    the frontend rebuilt before its batch norm (named ``Multiply_<n>``) included, is tied to a distinct torch module
    whose weight holds as many values as the operator's weights."""
    import openvino as ov
    import torch

    from edgeline.export.backends.openvino import WEIGHTED, operator_modules
    from edgeline.export.loading import load_model

    directory = cached_reference(name).directory
    module = load_model(str(directory / "model.pt2")).module
    x = np.load(directory / "calibration.npz")["x"][:1]
    program = torch.export.export(module, (torch.from_numpy(x),)).run_decompositions()
    model = ov.convert_model(program, input=[(list(x.shape), ov.Type.f32)])
    owners = operator_modules(model, program, module)
    weighted = [op for op in model.get_ordered_ops() if op.get_type_name() in WEIGHTED]
    named = dict(module.named_modules())
    found = [owners.get(op.get_friendly_name()) for op in weighted]
    unknown = [op.get_friendly_name() for op, owner in zip(weighted, found, strict=True) if owner is None]
    assert not unknown, unknown
    assert len(set(found)) == len(found)
    for op, owner in zip(weighted, found, strict=True):
        size = int(np.prod([int(d) for d in op.input(1).get_partial_shape().to_shape()]))
        assert named[owner].weight.numel() == size, (op.get_friendly_name(), owner)


@pytest.mark.parametrize("precision", ["fp32", "int8-static"])
def test_a_model_of_two_inputs_takes_them_by_name_in_forward_s_order(precision: str, tmp_path: Path) -> None:
    from tests.tiny_bundle import PAIR_MODEL_SOURCE, write_pair_samples

    source = tmp_path / "pair.py"
    source.write_text(PAIR_MODEL_SOURCE, encoding="utf-8")
    samples = write_pair_samples(tmp_path)
    bundle = cached_export(
        f"{source}:model", "--profile", "x86-64", "--backend", "openvino", "--precision", precision,
        "--calibration", samples["calibration"], "--validation", samples["validation"],
    )  # fmt: skip
    data = manifest(bundle)
    assert [spec["name"] for spec in data["inputs"]] == ["image", "mask"]
    validation = np.load(samples["validation"])
    model = edgeline.load(bundle)
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(
        core.read_model(str(bundle / "model.xml")), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    for image, mask in zip(validation["image"], validation["mask"], strict=True):
        (got,) = model.predict(image[None], mask[None])
        # by name, in the order opposite to forward()'s: OpenVINO's own answer
        expected = compiled({"mask": mask[None], "image": image[None]})[compiled.output(0)]
        assert np.array_equal(got, expected)


def test_the_layer_report_of_an_openvino_model_traces_the_float_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer report traces the float model with torch.export once and hands the program to the OpenVINO probe,
    which ties the IR's operators to modules by its node names: a second trace of the same model on the same sample
    is the same graph, made again for nothing. Each layer is still read (torch.export itself runs, only counted)."""
    import torch

    from edgeline.device_profiles import Precision
    from edgeline.export.backends import ExportRequest, get_exporter
    from edgeline.export.layers import measure_layers
    from edgeline.samples import SampleSet

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 3)
    ).eval()
    images = np.random.default_rng(0).random((4, 1, 1, 8, 8), dtype=np.float32)
    request = ExportRequest(module, (torch.from_numpy(images[0]),), [], Precision.FP32, tmp_path, ("x",))
    exported = get_exporter("openvino").export(request)
    traced = []
    export = torch.export.export

    def counted(*args: Any, **kwargs: Any) -> Any:
        traced.append(args[0])
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    samples = SampleSet([images[:, 0]], None, "random images")
    report = measure_layers(module, samples, "openvino", "openvino", tmp_path / exported.model_file, ("x",))
    assert report.unknown is None and [layer.module for layer in report.layers] == ["0", "1", "3"], report
    assert len(traced) == 1 and traced[0] is module, f"the float model traced {len(traced)} times"
