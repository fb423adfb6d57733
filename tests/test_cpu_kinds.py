"""A bundle's figures on other kinds of x86-64 CPU (issue 47): what the manifest names as the instruction set and
the arithmetic its fidelity was computed with, and OpenVINO's precision pinned where its plugin would pick another.

The other CPUs are this one with instruction sets hidden from CPUID (``edgeline.sim.cpu_kind``): AVX2 only,
AVX-512 with VNNI (Cascade Lake), and AVX-512 with VNNI and BF16 (Zen 4, the EPYC that found the issue). A kind needs
a CPU that has its features (a Xeon with AMX has every one) and CPUID faulting; where either is missing the kind is
absent, and its tests say so."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.isa import features_from_cpuinfo, instruction_set, x86_features
from edgeline.sim.cpu_kind import KINDS, available, environment
from tests.cache import cached_reference

X86 = platform.machine() in ("x86_64", "AMD64")

EPYC_GENOA_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
    "mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid extd_apicid aperfmperf pni "
    "pclmulqdq monitor ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand lahf_lm "
    "cmp_legacy svm extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext "
    "perfctr_core bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt "
    "clwb avx512cd "
    "sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc avx512_bf16 clzero irperf xsaveerptr rdpru "
    "wbnoinvd amd_ppin avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq la57 rdpid overflow_recov succor smca fsrm flush_l1d"
)
"""The flags of an AMD EPYC 9654 (Zen 4) in /proc/cpuinfo: AVX-512 with VNNI and BF16, no FP16, no AMX."""
SAPPHIRE_RAPIDS_FLAGS = (
    "avx2 fma avx_vnni avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 "
    "amx_tile amx_int8 amx_bf16"
)
CORTEX_A76_FEATURES = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
)
"""A Raspberry Pi 5's cores (Cortex-A76): NEON, fp16 arithmetic, the int8 dot product."""


def _cpuinfo(flags: str, key: str = "flags") -> str:
    return f"processor\t: 0\nmodel name\t: a CPU\n{key}\t\t: {flags}\n\n"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("arch", "text", "named"),
    [
        ("x86_64", _cpuinfo(EPYC_GENOA_FLAGS), ["FMA", "AVX2", "AVX512", "AVX512-VNNI", "AVX512-BF16"]),
        ("x86_64", _cpuinfo("sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c avx2 bmi2"), ["FMA", "AVX2"]),
        (
            "x86_64",
            _cpuinfo(SAPPHIRE_RAPIDS_FLAGS),
            ["FMA", "AVX2", "AVX-VNNI", "AVX512", "AVX512-VNNI", "AVX512-BF16", "AVX512-FP16", "AMX-INT8", "AMX-BF16"],
        ),
        ("aarch64", _cpuinfo(CORTEX_A76_FEATURES, "Features"), ["NEON", "FP16", "DOTPROD"]),
    ],
)
def test_the_features_named_from_a_cpuinfo_text(arch: str, text: str, named: list[str]) -> None:
    assert features_from_cpuinfo(arch, text) == named


@pytest.mark.quick
@pytest.mark.skipif(not X86, reason="CPUID is x86's: not verified on this architecture (read from /proc/cpuinfo)")
def test_what_cpuid_tells_this_process_is_what_the_kernel_says_of_the_cpu() -> None:
    """Unmasked, the machine code's CPUID and XGETBV agree with /proc/cpuinfo's flags, feature by feature; run as a
    kind (the whole suite under ``edgeline.sim.cpu_kind``), with that kind's features."""
    flags = x86_features()
    assert flags is not None, "no executable page for CPUID here"
    kind = os.environ.get("EDGELINE_CPU_KIND")
    if kind in KINDS and "cpu_kind" in os.environ.get("LD_PRELOAD", ""):
        assert instruction_set() == " ".join(["x86_64", *KINDS[kind].features])
        return
    from_kernel = features_from_cpuinfo("x86_64", Path("/proc/cpuinfo").read_text())
    assert instruction_set() == " ".join(["x86_64", *from_kernel])


@pytest.mark.quick
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_process_run_as_a_kind_of_cpu_is_told_exactly_that_kind_s_features(kind: str) -> None:
    """``available`` runs a probe as the kind and checks what it was told; here also the runtimes themselves:
    OpenVINO's CPU plugin lists the kind's precisions (BF16 only with AVX512-BF16, FP16 never)."""
    problem = available(kind)
    if problem is not None:
        pytest.skip(f"not verified here: {problem}")
    probe = (
        "import openvino as ov, edgeline.isa as i; "
        "print(i.instruction_set()); print(' '.join(ov.Core().get_property('CPU', 'OPTIMIZATION_CAPABILITIES')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environment(kind), capture_output=True, text=True, timeout=120, check=True
    )
    isa, capabilities = done.stdout.splitlines()[-2:]
    assert isa.split()[1:] == list(KINDS[kind].features)
    assert ("BF16" in capabilities.split()) == ("AVX512-BF16" in KINDS[kind].features), capabilities
    assert "FP16" not in capabilities.split(), capabilities


def _export_as(kind: str | None, digits: Path, out: Path, backend: str, precision: str) -> dict[str, Any]:
    env = dict(os.environ) if kind is None else environment(kind)
    # torch's part on one thread, as the test processes are the parallelism (tests/torch_threads.py): the same
    # bundle for 8.3 s of CPU instead of 10.8 on a loaded machine. OpenVINO's plugin keeps its own threads.
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "edgeline.cli", "export", str(digits / "model.pt2"), "--profile", "x86-64",
        "--backend", backend, "--precision", precision, "--calibration", str(digits / "calibration.npz"),
        "--validation", str(digits / "validation.npz"), "--labels", str(digits / "labels.txt"), "--out", str(out),
        "-q",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest: dict[str, Any] = json.loads((out / "manifest.json").read_text())
    return manifest


@pytest.mark.export
@pytest.mark.parametrize("kind", [None, *KINDS])
def test_an_openvino_fp16_bundle_is_computed_in_f16_or_f32_and_says_which_on_every_kind_of_cpu(
    kind: str | None, tmp_path: Path
) -> None:
    """fp16 on OpenVINO's CPU plugin: in f16 where the CPU has AVX512-FP16, f32 elsewhere, and never in the bf16 the
    plugin picks by itself for an f16 hint on a CPU with AVX512-BF16 and no FP16 (the EPYC of issue 47): the
    manifest names the instruction set and the arithmetic, the session on that CPU computes what the manifest says,
    and its outputs are the manifest's figures."""
    problem = None if kind is None else available(kind)
    if problem is not None:
        pytest.skip(f"not verified here: {problem}")
    digits = cached_reference("digits").directory
    manifest = _export_as(kind, digits, tmp_path / "bundle", "openvino", "fp16")
    fidelity = manifest["fidelity"]
    features = list(KINDS[kind].features) if kind is not None else instruction_set().split()[1:]
    assert fidelity["instruction_set"] == " ".join(["x86_64", *features])
    expected = "f16" if "AVX512-FP16" in features else "f32"
    assert fidelity["computed_in"] == expected, fidelity
    assert ("the fp16 weights were computed in fp32" in (fidelity.get("measured_with") or "")) == (expected == "f32")
    probe = (
        "import sys, numpy as np, edgeline\n"
        "model = edgeline.load(sys.argv[1])\n"
        "x = np.load(sys.argv[2])['x']\n"
        "found = np.concatenate([model.predict(s[None])[0] for s in x])\n"
        "np.save(sys.argv[3], found)\n"
        "print(model.computes)\n"
    )
    outputs = tmp_path / "outputs.npy"
    env = dict(os.environ) if kind is None else environment(kind)
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "bundle"), str(digits / "validation.npz"), str(outputs)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == expected
    labels = np.load(digits / "validation.npz")["labels"]
    assert float(np.mean(np.load(outputs).argmax(1) == labels)) == pytest.approx(fidelity["accuracy"], abs=1e-12)
    if kind is None and available("avx2") is None:  # this CPU's bundle verified on an AVX2-only one (f32 there)
        done = subprocess.run(
            [sys.executable, "-m", "edgeline.cli", "verify", str(tmp_path / "bundle"), "--json"],
            env=environment("avx2"), capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        report = json.loads(done.stdout)
        checks = {check["check"]: check for check in report["checks"]}
        assert checks["golden"]["ok"] is True, checks["golden"]
        assert checks["load"]["computes"] == "f32" and checks["load"]["instruction_set"] == "x86_64 FMA AVX2"
        assert ("computed_apart" in checks["load"]) == (expected != "f32"), checks["load"]


@pytest.mark.quick
def test_a_real_crash_run_as_a_kind_still_reaches_the_program_s_own_handler() -> None:
    """The library answers CPUID's faults and hands every other SIGSEGV to the handler the program set (Python's
    faulthandler here): a crash is still reported and still kills, as on the real CPU."""
    kind = "avx2"
    problem = available(kind)
    if problem is not None:
        pytest.skip(f"not verified here: {problem}")
    crash = "import ctypes, faulthandler; faulthandler.enable(); ctypes.string_at(0)"
    done = subprocess.run(
        [sys.executable, "-c", crash], env=environment(kind), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == -11, (done.returncode, done.stderr[-2000:])
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr[-2000:]


@pytest.mark.quick
@pytest.mark.parametrize(
    "field", [{"instruction_set": "x86_64 \x1b[31mCRITICAL"}, {"instruction_set": "A" * 257}, {"computed_in": "fp64"}]
)
def test_a_manifest_s_computed_with_fields_hold_only_what_edgeline_writes(field: dict[str, str]) -> None:
    """What ``bundle show`` and ``verify`` print from a bundle someone sent: names of features and arithmetics, never
    escape sequences or a megabyte of text."""
    from pydantic import ValidationError

    from edgeline.manifest import Fidelity

    Fidelity(status="measured", reference="torch", instruction_set="x86_64 FMA AVX2", computed_in="f16")
    with pytest.raises(ValidationError):
        Fidelity(status="measured", reference="torch", **field)
