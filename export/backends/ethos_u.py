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

import numpy as np

from edgeline.backends.ethos_u import CPU_MODEL, ETHOS_U, operator_names
from edgeline.device_profiles import Precision
from edgeline.device_profiles.schema import EthosU
from edgeline.export.backends import ExportedModel, ExportRequest, Verification
from edgeline.export.backends.litert import tool_versions, write_tflite
from edgeline.export.errors import ExportError
from edgeline.export.placement import TFLITE_CONVERSIONS, placement_of, tflite_records
from edgeline.manifest import Estimates, Placement, RuntimeRequirement

__all__ = ["MODEL_FILE", "EthosUExporter", "check_full_integer", "core_clock_mhz", "read_summary", "vela_config"]

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
    """vela and TFLite Micro take full-integer models: every input and output int8."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    for kind, details in (("input", interpreter.get_input_details()), ("output", interpreter.get_output_details())):
        for detail in details:
            if np.dtype(detail["dtype"]) != np.int8:
                raise ExportError(
                    f"{backend}: the int8 model's {kind} {detail['name']!r} is {np.dtype(detail['dtype']).name}, "
                    "not int8: the converter did not produce a full-integer model"
                )


def _run_vela(model: Path, settings: EthosU, config: Path, out_dir: Path) -> None:
    args = [
        str(model),
        f"--accelerator-config={settings.accelerator_config}",
        f"--config={config}",
        f"--system-config={settings.system_config}",
        f"--memory-mode={settings.memory_mode}",
        f"--output-dir={out_dir}",
    ]
    code = "import sys; from ethosu.vela.vela import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise ExportError(
            f"ethos-u: vela failed compiling for {settings.accelerator_config} (exit {done.returncode}): "
            + (" | ".join(lines[-3:]) if lines else "no output")
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


def _placement(int8_model: Path, compiled: Path) -> Placement:
    """The int8 model's operators, those vela left to the CPU counted off the NPU. The compiled model keeps the CPU's
    operators as they were; a float one among same-named operators is taken as the one left (the NPU computes in
    integers only)."""
    from ai_edge_litert.interpreter import Interpreter

    records = tflite_records(Interpreter(model_path=str(int8_model)), Precision.INT8_STATIC)
    left = Counter(op for op in operator_names(compiled) if op not in TFLITE_CONVERSIONS and op != ETHOS_U)
    on_cpu = set()
    for index in sorted(range(len(records)), key=lambda i: records[i].quantized):
        if left[records[index].name] > 0:
            left[records[index].name] -= 1
            on_cpu.add(index)
    records = [replace(record, on_accelerator=index not in on_cpu) for index, record in enumerate(records)]
    return placement_of(records, Precision.INT8_STATIC, accelerator=ETHOS_U)


class EthosUExporter:
    name = "ethos-u"
    runtime_backend = "litert"
    """On a Linux device (an i.MX 93, running edgeline's daemon): LiteRT with the Ethos-U external delegate. A
    microcontroller profile (``daemon = false``) gets ``tflite-micro``: its firmware runs TFLite Micro with the
    Ethos-U driver."""
    precisions = (Precision.INT8_STATIC,)

    def export(self, request: ExportRequest) -> ExportedModel:
        if request.precision not in self.precisions:
            raise ExportError(f"ethos-u exports int8-static only, not {request.precision.value}")
        settings: EthosU = request.profile_section("ethos_u", "ethos-u", "accelerator_config, system_config, ...")
        config = vela_config()
        clock = core_clock_mhz(config, settings)
        int8_model = request.out_dir / CPU_MODEL
        input_names = write_tflite(request, int8_model)
        check_full_integer(int8_model, self.name)
        with tempfile.TemporaryDirectory(prefix="vela-") as scratch:
            _run_vela(int8_model, settings, config, Path(scratch))
            stem = int8_model.stem
            summary = read_summary(Path(scratch) / f"{stem}_summary_{settings.system_config}.csv")
            shutil.move(Path(scratch) / f"{stem}_vela.tflite", request.out_dir / MODEL_FILE)
        on_linux = request.profile is not None and request.profile.daemon
        tflm = version("tflite-micro")
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend="litert" if on_linux else "tflite-micro",
            runtime=RuntimeRequirement(package="ai-edge-litert", min_version="2.0")
            if on_linux
            else RuntimeRequirement(package="tflite-micro", min_version=tflm),
            input_names=input_names,
            extra_files=(CPU_MODEL,),
            placement=_placement(int8_model, request.out_dir / MODEL_FILE),
            tool_versions={**tool_versions(), "ethos-u-vela": version("ethos-u-vela"), "tflite-micro": tflm},
            verification=Verification(
                backend="tflite-micro",
                model_file=CPU_MODEL,
                measured_with=f"TFLite Micro {tflm} reference kernels on the int8 model vela compiled "
                "(the Ethos-U NPU is not here)",
            ),
            estimates=_estimates(summary, settings, clock),
        )
