"""The device install stands alone: what `pip install edgeline` (no extras, no torch) runs, and the commands a device
uses: `run` meeting `sim` on their defaults, `bundle show`, `infer` on the daemon's payloads.

The tests marked ``device`` are the device tier: ``scripts/test_device.sh`` runs them in the base install, where
torch is absent for real; here, on the workstation, the subprocesses that must not need torch are started with the
export extra's packages blocked.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import edgeline
from edgeline.backends import BASE_INSTALL_BACKENDS, RUNTIME_BACKENDS
from edgeline.cli import main
from edgeline.daemon.codecs import JsonCodec, example_payload, payload_fields
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.silence import SilenceWatch
from edgeline.daemon.topics import SENSOR_SUBSCRIPTION, SENSOR_TOPIC, TopicFilter
from edgeline.device_profiles import load_profile, profile_ids
from edgeline.manifest import TensorSpec, Window
from edgeline.registry import resolve
from tests.mqtt_broker import Broker, Collector
from tests.test_daemon import mosquitto_pub, then_nothing_more
from tests.tiny_bundle import (
    COMMITTED_BUNDLE,
    COMMITTED_BUNDLES,
    COMMITTED_OV_BUNDLES,
    COMMITTED_PTE_BUNDLES,
    COMMITTED_SQRT_BUNDLE,
    write_samples,
)

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 20.0
EXPORT_EXTRA = ("torch", "sklearn", "executorch", "litert_torch", "ai_edge_quantizer")
WITHOUT_TORCH = (
    f"import sys; sys.modules.update(dict.fromkeys({EXPORT_EXTRA!r}))\n"  # None in sys.modules: the import fails
    "from edgeline.cli import main; sys.exit(main(sys.argv[1:]))"
)


def edgeline_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=120, check=False
    )


# -- the base install -------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "command",
    [
        ["reference", "prepare", "digits", "--out", "{out}"],
        ["export", "model.py:model", "--profile", "rpi5", "--calibration", "cal.npz", "--out", "{out}"],
    ],
    ids=["reference-prepare", "export"],
)
def test_export_side_commands_refuse_in_one_line_naming_the_extra(command: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = edgeline_without_torch(*(part.format(out=out) for part in command))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    program = " ".join(command[:2]) if command[0] == "reference" else command[0]
    assert lines[0].startswith(f"edgeline {program}: error: needs the export extra (torch")
    assert lines[0].endswith("pip install 'edgeline[export]'")
    assert done.stdout == ""  # no "training ..." before the refusal
    assert not out.exists()


ACCELERATOR_EXTRAS = {"qnn-htp": "qnn", "openvino-npu": "openvino"}
"""First targets that need an extra on the device by design: the accelerator is what the profile is for."""


@pytest.mark.quick
@pytest.mark.parametrize("profile_id", profile_ids())
def test_a_profiles_first_target_runs_on_its_own_device_install(profile_id: str) -> None:
    from edgeline.export.backends import EXPORT_BACKENDS
    from edgeline.export.errors import ExportError

    profile = load_profile(profile_id)
    target = profile.targets[0]
    exporter = resolve(EXPORT_BACKENDS, target.backend, "export backend", ExportError)
    assert exporter.runtime_backend in RUNTIME_BACKENDS
    if not profile.daemon:
        return  # a phone or a microcontroller: the bundle goes into an app or firmware, not into edgeline's install
    if target.backend in ACCELERATOR_EXTRAS:
        # The profile is for the accelerator: its device installs the extra the accelerator needs (the profile's
        # comment says which), and the runtime names it when it is missing.
        assert f"edgeline[{ACCELERATOR_EXTRAS[target.backend]}]" in Path(profile.source).read_text(encoding="utf-8")
        return
    assert exporter.runtime_backend in BASE_INSTALL_BACKENDS, (
        f"{profile_id}: its first target, {target.backend} {target.precision.value}, writes bundles for the "
        f"{exporter.runtime_backend} runtime, which the base install cannot run"
    )


BASE_INSTALL_BUNDLES = {"litert": COMMITTED_BUNDLE}
"""A bundle for each runtime backend of the base install."""


@pytest.mark.integration
@pytest.mark.parametrize("backend", sorted(BASE_INSTALL_BACKENDS))
def test_the_base_install_backends_run_a_bundle_without_torch(backend: str, tmp_path: Path) -> None:
    samples = write_samples(tmp_path)
    done = edgeline_without_torch(
        "infer",
        str(BASE_INSTALL_BUNDLES[backend]),
        "--backend",
        backend,
        "--input",
        str(samples["validation"]),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(records) == len(np.load(samples["validation"])["labels"])
    assert all(0 <= record["class_index"] < 10 for record in records)


@pytest.mark.quick
@pytest.mark.parametrize("committed", list(COMMITTED_BUNDLES.values()), ids=list(COMMITTED_BUNDLES))
def test_the_committed_bundle_is_valid_and_small(committed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(committed), "--json"]) == 0
    checks = {check["check"]: check["ok"] for check in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["integrity"] is True and checks["golden"] is True
    assert sum(path.stat().st_size for path in committed.iterdir()) < 32 * 1024


FRESH_AND_COMMITTED = [
    ("built_litert_bundle", COMMITTED_BUNDLE),
    ("sqrt_bundle", COMMITTED_SQRT_BUNDLE),
    *(("fresh_bundles", bundle) for bundle in (*COMMITTED_PTE_BUNDLES.values(), *COMMITTED_OV_BUNDLES.values())),
]


@pytest.fixture(params=FRESH_AND_COMMITTED, ids=lambda pair: f"{pair[0]}-{pair[1].name}")
def fresh_and_committed(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """A fresh export of a committed bundle's model (made, or found in the test cache, while the test is set up:
    a quick test's body converts nothing) and the committed bundle."""
    fixture, committed = request.param
    found = request.getfixturevalue(fixture)
    exported: Path = found(committed.name) if fixture == "fresh_bundles" else found
    return exported, committed


@pytest.mark.quick
@pytest.mark.workstation  # compares with a fresh export
def test_the_committed_bundle_describes_what_the_exporter_writes_today(fresh_and_committed: tuple[Path, Path]) -> None:
    """Workstation tier: a fresh export of the same model; regenerate with `python -m tests.tiny_bundle NAME`."""
    exported, committed = fresh_and_committed
    if exported == committed:
        pytest.fail("this test needs the workstation tier (a fresh export); it has no `device` marker")

    def shape(manifest: edgeline.Manifest) -> dict[str, object]:
        return {
            "keys": sorted(manifest.model_dump(exclude_none=True)),
            "target": (manifest.profile, manifest.backend, manifest.precision, manifest.threads, manifest.runtime),
            "tensors": [(s.name, s.dtype, s.shape, s.quantization is None) for s in manifest.inputs + manifest.outputs],
            "files": sorted(entry.path for entry in manifest.files),
            "postprocess": manifest.postprocess,
            "golden": None if manifest.golden is None else manifest.golden.samples,
            "fidelity": sorted(manifest.fidelity.model_dump(exclude_none=True)),
        }

    fresh = edgeline.read_bundle(exported).manifest
    stale = f"tests/data/{committed.name} is stale: python -m tests.tiny_bundle {committed.name}"
    assert shape(edgeline.read_bundle(committed).manifest) == shape(fresh), stale


# -- run and sim meet on their defaults -------------------------------------------------------------------------------


@pytest.mark.quick
def test_the_defaults_of_run_and_sim_agree() -> None:
    from edgeline.cli import build_parser

    sim = build_parser().parse_args(["sim", "digits"])
    config = DaemonConfig()
    assert sim.qos == config.input.qos == config.output.qos
    topic = sim.topic.format(device="pump-7", sensor="digits")
    assert [TopicFilter(pattern).device(topic) for pattern in config.input.subscribe] == ["pump-7"]
    assert (sim.topic, config.input.subscribe) == (SENSOR_TOPIC, (SENSOR_SUBSCRIPTION,))


@pytest.mark.integration
@pytest.mark.parametrize(
    "bundle",
    [COMMITTED_BUNDLE, COMMITTED_PTE_BUNDLES["tiny-pte-int8"], COMMITTED_OV_BUNDLES["tiny-ov-int8"]],
    ids=["litert", "executorch", "openvino"],
)
def test_default_run_and_default_sim_talk(broker: Broker, tmp_path: Path, bundle: Path) -> None:
    """`edgeline run BUNDLE --broker H:P` and `edgeline sim digits --broker H:P`, no topic or QoS flags: every message
    the simulator sends is answered (a LiteRT bundle, an ExecuTorch one on the torch-free runtime, an OpenVINO one)."""
    samples = write_samples(tmp_path)
    since = broker.log_size()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--broker", broker.address,
         "--instance", "t"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        if not broker.wait_for_subscription("edgeline-tiny-t", SENSOR_SUBSCRIPTION, timeout=TIMEOUT_S, since=since):
            daemon.kill()
            pytest.fail(f"the daemon did not subscribe: {daemon.communicate(timeout=10)[1][-3000:]}")
        sent = Collector(broker, "sensors/#")
        answers = Collector(broker, "edgeline/tiny/+/result")
        sim = subprocess.run(
            [sys.executable, "-m", "edgeline.cli", "sim", "digits", "--broker", broker.address,
             "--data", str(samples["validation"]), "--count", "6", "--rate", "0", "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert sim.returncode == 0, sim.stderr
        report = json.loads(sim.stdout)
        assert report["acknowledged"] == report["published"] == 6
        messages = sent.wait_for(6)
        answers.wait_for(6)
        topic, payload, _ = messages[0]
        sentinel = json.dumps({**json.loads(payload), "id": "sentinel"}).encode()
        records = [  # one answer each: an extra one would have come before the sentinel's
            json.loads(body)
            for _, body, _ in then_nothing_more(answers, 6, lambda: mosquitto_pub(broker, topic, sentinel))
        ]
        assert [record.get("error") for record in records] == [None] * 6
        assert sorted(r["id"] for r in records) == sorted(json.loads(payload)["id"] for _, payload, _ in messages)
        sent.close()
        answers.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, stderr = daemon.communicate(timeout=TIMEOUT_S)
    assert daemon.returncode == 0, stderr
    inputs = edgeline.read_bundle(bundle).manifest.inputs
    expecting = f"expecting json messages on {SENSOR_SUBSCRIPTION} (the device is the first + level), e.g. "
    assert expecting + example_payload("json", inputs) in stderr
    assert f"[...{inputs[0].size} floats...]" in stderr
    assert "nothing received" not in stderr


@pytest.mark.integration
def test_the_daemon_warns_once_when_its_subscription_stays_silent(broker: Broker, tmp_path: Path) -> None:
    """Waits for the warning, then for several more status messages (one per 0.2 s of the daemon's own clock, each
    several silence checks later), instead of sleeping and hoping the first warning came in time."""
    config = tmp_path / "daemon.toml"
    config.write_text("[input]\nsilence_warning_s = 0.2\n[health]\nstatus_interval_s = 0.2\n", encoding="utf-8")
    warning = f"nothing received on {SENSOR_SUBSCRIPTION} for 0.2 s"
    since = broker.log_size()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "edgeline.cli", "run", str(COMMITTED_BUNDLE), "--broker", broker.address,
         "--instance", "t", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    said = threading.Condition()

    def read() -> None:
        assert daemon.stderr is not None
        for line in daemon.stderr:
            with said:
                lines.append(line)
                said.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        subscribed = broker.wait_for_subscription(
            "edgeline-tiny-t", SENSOR_SUBSCRIPTION, timeout=TIMEOUT_S, since=since
        )
        assert subscribed, "".join(lines)
        with said:
            assert said.wait_for(lambda: any(warning in line for line in lines), TIMEOUT_S), "".join(lines)
        statuses = Collector(broker, "edgeline/tiny/t/status")
        try:
            assert len(statuses.wait_for(6, timeout=TIMEOUT_S)) >= 6, "fewer than 6 status messages"
        finally:
            statuses.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=TIMEOUT_S)
        reader.join(TIMEOUT_S)
    stderr = "".join(lines)
    assert stderr.count(warning) == 1, stderr


@pytest.mark.quick
def test_silence_is_reported_once_per_silent_spell_and_per_subscription() -> None:
    now = [0.0]
    watch = SilenceWatch([TopicFilter("a/+/x"), TopicFilter("b/#")], 60.0, clock=lambda: now[0])
    now[0] = 59.9
    assert watch.newly_silent() == []
    now[0] = 60.0
    assert watch.newly_silent() == ["a/+/x", "b/#"]
    now[0] = 500.0
    assert watch.newly_silent() == []  # once
    watch.heard("b/pump/1")
    now[0] = 559.9
    assert watch.newly_silent() == []
    now[0] = 560.0
    assert watch.newly_silent() == ["b/#"]  # a new spell, of that subscription only


@pytest.mark.quick
@pytest.mark.parametrize(
    ("specs", "window"),
    [
        ((TensorSpec(name="image", dtype="int8", shape=(1, 1, 8, 8)),), None),
        (
            (TensorSpec(name="a", dtype="float32", shape=(1, 3)), TensorSpec(name="b", dtype="float32", shape=(2,))),
            None,
        ),
        ((TensorSpec(name="x", dtype="float32", shape=(1, 5, 3)),), Window(size=5, hop=2, channels=3)),
    ],
    ids=["one-input", "two-inputs", "window"],
)
def test_the_example_payload_names_fields_the_codec_accepts(
    specs: tuple[TensorSpec, ...], window: Window | None
) -> None:
    fields = payload_fields(specs, window)
    example = example_payload("json", specs, window)
    for field, count in fields.items():
        assert f'"{field}": [' in example and f"{count} floats" in example
    message = {"id": "1", **{field: [0.5] * count for field, count in fields.items()}}
    decoded = JsonCodec().decode(json.dumps(message).encode(), specs, window=window)
    assert decoded.id == "1"
    expected = [(1, window.channels)] if window else [spec.shape for spec in specs]
    assert [array.shape for array in decoded.arrays] == expected


# -- bundle show ------------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_bundle_show_json_carries_the_manifests_numbers(tmp_path: Path) -> None:
    done = edgeline_without_torch("bundle", "show", str(COMMITTED_BUNDLE), "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    manifest = json.loads((COMMITTED_BUNDLE / "manifest.json").read_text(encoding="utf-8"))
    assert [t["shape"] for t in info["inputs"]] == [s["shape"] for s in manifest["inputs"]]
    assert [t["quantization"] for t in info["outputs"]] == [s["quantization"] for s in manifest["outputs"]]
    size = int(np.prod(manifest["inputs"][0]["shape"]))
    assert info["payload"]["values"] == {"data": size}
    assert info["postprocess"]["kind"] == manifest["postprocess"]["kind"]
    assert info["fidelity"]["samples"] == manifest["fidelity"]["samples"]
    assert info["fidelity"]["max_abs_error"] == manifest["fidelity"]["max_abs_error"]
    assert info["size"]["model_bytes"] == (COMMITTED_BUNDLE / manifest["model"]).stat().st_size
    assert info["size"]["bundle_bytes"] == sum(path.stat().st_size for path in COMMITTED_BUNDLE.iterdir())
    assert info["base_install_runs_it"] is True
    assert info["signature"] == {"present": False, "verified": False}


@pytest.mark.quick
def test_bundle_show_text_and_a_signature_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    bundle = Path(shutil.copytree(COMMITTED_BUNDLE, tmp_path / "bundle"))
    (bundle / "manifest.sig").write_bytes(b"not checked yet")
    assert main(["bundle", "show", str(bundle)]) == 0
    text = capsys.readouterr().out
    manifest = edgeline.read_bundle(bundle).manifest
    spec = manifest.inputs[0]
    assert f"input:        {spec.name}  {spec.dtype}{list(spec.shape)}" in text
    assert f'payload:      {{"id": "1", "data": [...{spec.size} floats...]}}' in text
    assert f"on {manifest.fidelity.samples} samples" in text
    assert "manifest.sig present, not verified" in text
    assert main(["bundle", "show", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"edgeline bundle show: error: {tmp_path / 'nope'}: no such bundle\n"


# -- infer on the daemon's payloads -----------------------------------------------------------------------------------


def _without_timing(record: dict[str, object]) -> dict[str, object]:
    return {key: value for key, value in record.items() if key not in ("timestamp", "latency_ms", "line")}


@pytest.mark.integration
def test_infer_answers_json_lines_as_the_daemon_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(3)
    images = rng.random((4, 64), dtype=np.float32)
    lines = [json.dumps({"id": f"m{i}", "data": row.tolist()}) for i, row in enumerate(images)]
    lines[1:1] = ['{"id": "short", "data": [1.0]}', "{oops", "", '{"id": "nan", "data": [NaN]}', '{"data": ["x"]}']
    payloads = tmp_path / "payloads.jsonl"
    payloads.write_text("\n".join(lines) + "\n", encoding="utf-8")

    assert main(["infer", str(COMMITTED_BUNDLE), "--input", str(payloads), "--json"]) == 1  # some inputs failed
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["line"] for r in records] == [n for n, line in enumerate(lines, 1) if line]
    errors = [r["error"]["code"] for r in records if "error" in r]
    assert errors == ["wrong-shape", "malformed", "non-finite", "wrong-dtype"]
    model = edgeline.load(COMMITTED_BUNDLE)
    results = {r["id"]: r for r in records if "error" not in r}
    for index, row in enumerate(images):
        outputs = model.predict(row.reshape(1, 1, 8, 8))
        np.testing.assert_allclose(np.array(results[f"m{index}"]["outputs"][0]), outputs[0], rtol=1e-6)

    replay = subprocess.run(
        [sys.executable, "-m", "edgeline.cli", "run", str(COMMITTED_BUNDLE), "--replay", str(payloads),
         "--device", "infer"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    daemon = [_without_timing(json.loads(line)) for line in replay.stdout.splitlines()]
    mine = [{k: v for k, v in _without_timing(r).items() if k != "instance"} for r in records]
    assert [{k: v for k, v in r.items() if k != "instance"} for r in daemon] == mine


@pytest.mark.quick
def test_infer_takes_one_json_message_and_refuses_an_empty_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = tmp_path / "one.json"
    message.write_text(json.dumps({"id": 7, "data": np.zeros((1, 8, 8)).tolist()}, indent=2), encoding="utf-8")
    assert main(["infer", str(COMMITTED_BUNDLE), "--input", str(message), "--top-k", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("line 1 (7): label=")
    assert text.count("; top ") == 1 and len(text.split("; top ")[1].split("\n")[0].split(", ")) == 3  # as for .npz
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    assert main(["infer", str(COMMITTED_BUNDLE), "--input", str(empty)]) == 2
    assert capsys.readouterr().err == f"edgeline infer: error: input file {empty}: no messages\n"
