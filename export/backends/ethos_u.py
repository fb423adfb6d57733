"""Arm Ethos-U through vela: a full-integer int8 LiteRT model, compiled by vela for the profile's NPU.

The bundle's model is vela's output (what the NPU's driver runs); the int8 model it compiled ships beside it as
``model_int8.tflite``: the CPU's fallback on a device without the driver, and what fidelity is measured on here, with
TFLite Micro's reference kernels, since the NPU itself is not here. vela's figures (cycles, SRAM, flash, DRAM) are
its estimates for the profile's system configuration, never measurements.

Placement is read from the compiled model: every operator vela left outside its ``ethos-u`` operators runs on the
CPU. (vela's own operator listing counts its internal operators, e.g. a fused ReLU as one more, not the model's.)
"""

from __future__ import annotations

import configparser
import csv
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

from edgeline.backends.ethos_u import CPU_MODEL, ETHOS_U, operator_names
from edgeline.device_profiles import Precision, Profile
from edgeline.device_profiles.schema import EthosU
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget, Verification
from edgeline.export.backends.litert import tool_versions, write_tflite
from edgeline.export.errors import ExportError, LoweringError
from edgeline.export.layer_probes import LayerProbe, LayerReading, litert_layers
from edgeline.export.placement import TFLITE_CONVERSIONS, ModelSources, placement_of, tflite_records
from edgeline.export.tflite_operators import ETHOS_U_KERNELS, TFLITE_MICRO_KERNELS
from edgeline.manifest import Estimates, Placement, RuntimeRequirement

__all__ = [
    "MODEL_FILE",
    "EthosUExporter",
    "check_full_integer",
    "core_clock_mhz",
    "read_per_layer",
    "read_summary",
    "vela_config",
]

MODEL_FILE = "model_vela.tflite"


def vela_config() -> Path:
    """edgeline's vela configuration: the system configurations and memory modes the profiles name (package data
    of ``edgeline.device_profiles``)."""
    from edgeline import device_profiles

    return Path(device_profiles.__file__).resolve().parent / "vela.ini"


def core_clock_mhz(config: Path, settings: EthosU) -> float:
    """The NPU clock vela estimates at (the system configuration's core_clock); refused unless it is the profile's
    clock_mhz, and unless both named sections exist."""
    parser = configparser.ConfigParser()
    parser.read(config)
    for kind, name in (("System_Config", settings.system_config), ("Memory_Mode", settings.memory_mode)):
        if not parser.has_section(f"{kind}.{name}"):
            valid = sorted(s.split(".", 1)[1] for s in parser.sections() if s.startswith(f"{kind}."))
            raise ExportError(f"ethos-u: {config} has no {kind} {name!r}; valid: {', '.join(valid)}")
    clock = float(parser[f"System_Config.{settings.system_config}"]["core_clock"]) / 1e6
    if clock != settings.clock_mhz:
        raise ExportError(
            f"ethos-u: the profile's clock_mhz ({settings.clock_mhz}) is not the core_clock of system config "
            f"{settings.system_config} in {config} ({clock:g} MHz)"
        )
    return clock


def check_full_integer(path: Path, backend: str) -> None:
    """vela and TFLite Micro take full-integer models: every input and output int8. Otherwise a ``LoweringError``
    naming the operators that stayed float and the model's lines they come from."""
    from edgeline.export import full_integer

    full_integer.check_full_integer(path, backend)


def _run_vela(model: Path, settings: EthosU, config: Path, out_dir: Path) -> None:
    args = [
        str(model),
        f"--accelerator-config={settings.accelerator_config}",
        f"--config={config}",
        f"--system-config={settings.system_config}",
        f"--memory-mode={settings.memory_mode}",
        f"--output-dir={out_dir}",
        "--verbose-performance",  # the per-layer CSV: where each operator runs and its multiply-accumulates
    ]
    code = "import sys; from ethosu.vela.vela import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise ExportError(
            f"ethos-u: vela failed compiling for {settings.accelerator_config} (exit {done.returncode}): "
            + (" | ".join(lines[-3:]) if lines else "no output")
        )


def _covers(placement: Placement) -> str:
    """What vela's cycles and time leave out: the operators it leaves to the CPU, which it does not estimate."""
    left = sorted(placement.fallback.items())
    if not left:
        return "the whole model: vela placed every operator on the NPU"
    named = ", ".join(f"{name} x{count}" if count > 1 else name for name, count in left)
    return (
        f"the NPU's part only: the {sum(count for _, count in left)} operators vela leaves to the CPU ({named}) are "
        "not in cycles or inference_ms, which vela does not estimate; `edgeline verify` on the device measures the "
        "whole"
    )


def read_summary(path: Path) -> dict[str, str]:
    """vela's network summary CSV (one row: the network)."""
    with path.open(newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    if len(rows) != 1:
        raise ExportError(f"ethos-u: vela's summary {path.name} has {len(rows)} rows, expected 1")
    return rows[0]


def _estimates(summary: dict[str, str], settings: EthosU, clock_mhz: float) -> Estimates:
    def kib(key: str) -> int:  # vela reports memory in KiB
        return round(float(summary[key]) * 1024)

    cycles = int(float(summary["cycles_total"]))
    return Estimates(
        tool=f"ethos-u-vela {version('ethos-u-vela')}",
        target=f"{settings.accelerator_config}, system config {settings.system_config}, "
        f"memory mode {settings.memory_mode}",
        clock_mhz=clock_mhz,
        cycles=cycles,
        inference_ms=cycles / (clock_mhz * 1e3),
        sram_bytes=kib("sram_memory_used"),
        flash_bytes=kib("off_chip_flash_memory_used") + kib("on_chip_flash_memory_used"),
        dram_bytes=kib("dram_memory_used"),
        macs=int(float(summary["nn_macs"])),
    )


def _kind(operator: str) -> str:
    """ "DepthwiseConv2D" (vela's name) and "DEPTHWISE_CONV_2D" (LiteRT's) -> "depthwiseconv2d"."""
    return operator.replace("_", "").lower()


def read_per_layer(path: Path) -> dict[tuple[str, str], tuple[str, int]]:
    """vela's per-layer CSV (``--verbose-performance``): per original operator, keyed by its output tensor's name and
    its kind (a fused activation's row carries the convolution's name), where it runs ("NPU" or "CPU") and vela's
    count of its multiply-accumulates. Empty when vela wrote none."""
    if not path.is_file():
        return {}
    layers: dict[tuple[str, str], tuple[str, int]] = {}
    with path.open(newline="", encoding="utf-8") as file:
        for row in csv.DictReader(file):
            name, target = row.get("Name") or "", row.get("Target") or ""
            try:
                macs = int(float(row.get("MAC Count") or 0))
            except ValueError:
                macs = 0
            if name and target in ("NPU", "CPU"):
                key = (name, _kind(row.get("Original Operator") or ""))
                before = layers.get(key, ("NPU", 0))
                layers[key] = ("CPU" if "CPU" in (target, before[0]) else "NPU", before[1] + macs)
    return layers


NO_MICRO_INT8 = TFLITE_MICRO_KERNELS.float_only  # GELU, EXP, LOG
"""The int8 operators vela maps to the Ethos-U that TFLite Micro, which runs the rest, has no kernel for."""


def _check_micro_kernels(int8_model: Path) -> None:
    """That TFLite Micro has a kernel for every operator of ``int8_model`` but the lookup tables vela maps to the NPU
    (``NO_MICRO_INT8``), which a microcontroller's CPU never runs: TFLite Micro loads a copy with those in float (a
    ``BundleError`` naming the first kernel it lacks otherwise, as verifying on it would have)."""
    from edgeline.backends import open_session
    from edgeline.export.tflite_operators import micro_kernel_probe

    probe = int8_model.with_name("micro-kernels.tflite")
    shutil.copyfile(int8_model, probe)
    try:
        micro_kernel_probe(probe, NO_MICRO_INT8)
        open_session("tflite-micro", probe)
    finally:
        probe.unlink(missing_ok=True)


def _placement(
    int8_model: Path,
    compiled: Path,
    layers: dict[tuple[str, str], tuple[str, int]],
    sources: ModelSources | None = None,
) -> Placement:
    """The int8 model's operators, those vela left to the CPU counted off the NPU.

    vela's per-layer report names each original operator by its output tensor, with where it runs and its
    multiply-accumulates: those are used when they account for every operator the compiled model keeps for the CPU.
    Otherwise: the compiled model keeps the CPU's operators as they were; a float one among same-named operators is
    taken as the one left (the NPU computes in integers only). ``sources``: to name the model's code behind those
    left to the CPU."""
    from ai_edge_litert.interpreter import Interpreter

    records = tflite_records(Interpreter(model_path=str(int8_model)), Precision.INT8_STATIC)
    left = Counter(op for op in operator_names(compiled) if op not in TFLITE_CONVERSIONS and op != ETHOS_U)
    keys = [(r.output, _kind(r.name)) for r in records]
    reported = {i for i, key in enumerate(keys) if layers.get(key, ("", 0))[0] == "CPU"}
    if layers and Counter(records[i].name for i in reported) == +left:
        on_cpu = reported
        records = [
            replace(r, macs=layers[key][1] or r.macs) if key in layers and r.macs is not None else r
            for r, key in zip(records, keys, strict=True)
        ]
    else:
        on_cpu = set()
        for index in sorted(range(len(records)), key=lambda i: records[i].quantized):
            if left[records[index].name] > 0:
                left[records[index].name] -= 1
                on_cpu.add(index)
    records = [replace(record, on_accelerator=index not in on_cpu) for index, record in enumerate(records)]
    records = sources.name(records) if sources else records
    return placement_of(records, Precision.INT8_STATIC, accelerator=ETHOS_U)


class EthosUExporter(ExportTarget):
    name = "ethos-u"
    runtime_backend = "litert"
    accelerator = ETHOS_U
    """On a Linux device (an i.MX 93, running edgeline's daemon): LiteRT with the Ethos-U external delegate. A
    microcontroller profile (``daemon = false``) gets ``tflite-micro``: its firmware runs TFLite Micro with the
    Ethos-U driver."""
    precisions = (Precision.INT8_STATIC,)
    keeps_float = True  # the LiteRT quantizer's annotation: the CPU runs the kept layers
    full_integer = True

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        """Its int8 model (the one vela compiled) on LiteRT's interpreter."""
        return litert_layers(reading)

    def on_micro_kernels(self, profile: Profile | None) -> bool:
        """On a microcontroller (a profile without a daemon) its CPU part and int8 copy are TFLite Micro's; on
        Linux, LiteRT's."""
        return not getattr(profile, "daemon", None)

    def has_every_tflite_kernel(self, profile: Profile | None) -> bool:
        return not self.on_micro_kernels(profile)

    def export(self, request: ExportRequest) -> ExportedModel:
        if request.precision not in self.precisions:
            raise ExportError(f"ethos-u exports int8-static only, not {request.precision.value}")
        settings: EthosU = request.profile_section("ethos_u", "ethos-u", "accelerator_config, system_config, ...")
        config = vela_config()
        clock = core_clock_mhz(config, settings)
        int8_model = request.out_dir / CPU_MODEL
        on_linux = request.profile is not None and request.profile.daemon
        # GELU, EXP and LOG in int8: vela maps them to the NPU's lookup tables (TFLite Micro has no int8 kernel for
        # them, so none may be left to a microcontroller's CPU: checked below)
        written = write_tflite(request, int8_model, full_integer_for=self.name, kernels=ETHOS_U_KERNELS)
        with tempfile.TemporaryDirectory(prefix="vela-") as scratch:
            _run_vela(int8_model, settings, config, Path(scratch))
            stem = int8_model.stem
            summary = read_summary(Path(scratch) / f"{stem}_summary_{settings.system_config}.csv")
            layers = read_per_layer(Path(scratch) / f"{stem}_per-layer.csv")
            shutil.move(Path(scratch) / f"{stem}_vela.tflite", request.out_dir / MODEL_FILE)
        tflm = version("tflite-micro")
        placement = _placement(int8_model, request.out_dir / MODEL_FILE, layers, written.sources)
        beyond_micro = sorted(NO_MICRO_INT8 & set(operator_names(int8_model)))
        if not on_linux and beyond_micro:  # TFLite Micro cannot check the rest of the CPU's operators as it is
            _check_micro_kernels(int8_model)
        if not on_linux:
            stranded = sorted(NO_MICRO_INT8 & set(placement.fallback))
            if stranded:
                raise LoweringError(
                    f"ethos-u: vela left {', '.join(stranded)} to the CPU, where TFLite Micro has no int8 kernel for "
                    f"{'it' if len(stranded) == 1 else 'them'}; choose the tflite-micro target (which writes them in "
                    "other operators)",
                    operators=tuple(stranded),
                )
        # What runs the operators vela leaves to the CPU on the device runs the int8 model here: LiteRT on a Linux
        # device (the delegate hands the rest to LiteRT's kernels), TFLite Micro on a microcontroller, unless the
        # model has operators only the NPU runs in int8 there (then LiteRT's kernels, which TFLite Micro's match)
        verification = (
            Verification(
                backend="litert",
                model_file=CPU_MODEL,
                measured_with=f"LiteRT {version('ai-edge-litert')} CPU kernels on the int8 model vela compiled, as "
                "the device's CPU runs the operators vela leaves to it (the Ethos-U NPU is not here)",
            )
            if on_linux
            else Verification(
                backend="litert",
                model_file=CPU_MODEL,
                measured_with=f"LiteRT {version('ai-edge-litert')} CPU kernels on the int8 model vela compiled: its "
                f"{', '.join(beyond_micro)} run on the Ethos-U NPU, and TFLite Micro has no int8 kernel to run them "
                "here (the NPU is not here)",
            )
            if beyond_micro
            else Verification(
                backend="tflite-micro",
                model_file=CPU_MODEL,
                measured_with=f"TFLite Micro {tflm} reference kernels on the int8 model vela compiled "
                "(the Ethos-U NPU is not here)",
            )
        )
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend="litert" if on_linux else "tflite-micro",
            runtime=RuntimeRequirement(package="ai-edge-litert", min_version="2.0")
            if on_linux
            else RuntimeRequirement(package="tflite-micro", min_version=tflm),
            input_names=written.input_names,
            rewrites=written.rewrites,
            extra_files=(CPU_MODEL,),
            placement=placement,
            tool_versions={**tool_versions(), "ethos-u-vela": version("ethos-u-vela"), "tflite-micro": tflm},
            verification=verification,
            flash_files=(MODEL_FILE,),
            estimates=_estimates(summary, settings, clock).model_copy(update={"covers": _covers(placement)}),
        )
