"""The instruction sets this process's CPU offers its runtimes: what decides which kernels they pick, and so what a
bundle's fidelity figures were computed with (``Fidelity.instruction_set``) and what a device computes with.

On x86-64 the runtimes ask the CPUID instruction (oneDNN and OpenVINO's CPU plugin, ONNX Runtime's MLAS, XNNPACK
through cpuinfo), so this asks it too, from a few bytes of machine code in an executable page: what the process is
told, which is what the runtimes were told (a hypervisor's or an emulator's CPU model included). Where the page
cannot be made executable (a kernel that forbids writable code), the kernel's ``/proc/cpuinfo`` flags say the same
for an unmasked process. On Arm, ``/proc/cpuinfo``'s ``Features``.

Only the features that change a kernel's arithmetic or its choice of kernels are named: fused multiply-add and the
vector widths, the integer dot products (VNNI, DOTPROD, I8MM: exact 32-bit sums where AVX2 without them has
saturating 16-bit pair sums), the half-precision and bfloat16 arithmetic (a plugin computes an fp32 model in bf16 by
itself where the CPU has it) and the matrix engines (AMX, SME).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform
from collections.abc import Set
from pathlib import Path
from typing import Any

__all__ = ["features_from_cpuinfo", "instruction_set", "x86_features"]

_X86_FLAGS = (
    ("FMA", ("fma",)),
    ("AVX2", ("avx2",)),
    ("AVX-VNNI", ("avx_vnni",)),
    ("AVX512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    ("AVX512-VNNI", ("avx512_vnni",)),
    ("AVX512-BF16", ("avx512_bf16",)),
    ("AVX512-FP16", ("avx512_fp16",)),
    ("AMX-INT8", ("amx_tile", "amx_int8")),
    ("AMX-BF16", ("amx_tile", "amx_bf16")),
    ("AMX-FP16", ("amx_tile", "amx_fp16")),
)
"""Each feature named here, and the ``/proc/cpuinfo`` flags (Linux's names) that make it."""
_ARM_FEATURES = (
    ("NEON", "asimd"),
    ("FP16", "asimdhp"),
    ("DOTPROD", "asimddp"),
    ("I8MM", "i8mm"),
    ("BF16", "bf16"),
    ("SVE", "sve"),
    ("SVE2", "sve2"),
    ("SME", "sme"),
)

# push rbx; mov r8, rdx; mov eax, edi; mov ecx, esi; cpuid; mov [r8], eax; mov [r8+4], ebx; mov [r8+8], ecx;
# mov [r8+12], edx; pop rbx; ret   -- cpuid(leaf, subleaf, out[4]) in the System V calling convention
_CPUID_CODE = bytes.fromhex("53 4989d0 89f8 89f1 0fa2 418900 41895804 41894808 4189500c 5b c3".replace(" ", ""))
# xor ecx, ecx; xgetbv; shl rdx, 32; or rax, rdx; ret   -- XCR0, the state components the kernel enabled
_XGETBV_CODE = bytes.fromhex("31c9 0f01d0 48c1e220 4809d0 c3".replace(" ", ""))
_pages: list[mmap.mmap] = []
"""The pages the machine code is in: kept for the process's life (a page with a function over it cannot close)."""


def _machine_code(code: bytes, restype: type | None, argtypes: list[type]) -> Any:
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    _pages.append(page)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


@functools.lru_cache(maxsize=1)
def x86_features() -> frozenset[str] | None:
    """The ``/proc/cpuinfo`` names of the features in ``_X86_FLAGS`` the CPUID instruction reports to this process
    and whose state the kernel enabled (XCR0), or None where the instruction cannot be run from here."""
    try:
        cpuid = _machine_code(_CPUID_CODE, None, [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p])
        xgetbv = _machine_code(_XGETBV_CODE, ctypes.c_uint64, [])
    except (OSError, ValueError, TypeError, AttributeError):  # no writable and executable page here (or no mmap)
        return None
    out = (ctypes.c_uint32 * 4)()

    def ask(leaf: int, sub: int = 0) -> tuple[int, int, int, int]:
        cpuid(leaf, sub, ctypes.addressof(out))
        return out[0], out[1], out[2], out[3]

    highest = ask(0)[0]
    _, _, ecx1, _ = ask(1)
    if not ecx1 & (1 << 27):  # no OSXSAVE: no AVX state
        return frozenset()
    xcr0 = int(xgetbv())
    leaf7 = ask(7) if highest >= 7 else (0, 0, 0, 0)
    leaf71 = ask(7, 1) if highest >= 7 and leaf7[0] >= 1 else (0, 0, 0, 0)
    avx_state = xcr0 & 0b110 == 0b110
    avx512_state = avx_state and xcr0 & 0b11100000 == 0b11100000
    amx_state = xcr0 & (0b11 << 17) == 0b11 << 17
    _, ebx7, ecx7, edx7 = leaf7
    eax71 = leaf71[0]
    bits = {
        "fma": avx_state and ecx1 >> 12 & 1,
        "avx2": avx_state and ebx7 >> 5 & 1,
        "avx_vnni": avx_state and eax71 >> 4 & 1,
        "avx512f": avx512_state and ebx7 >> 16 & 1,
        "avx512dq": avx512_state and ebx7 >> 17 & 1,
        "avx512bw": avx512_state and ebx7 >> 30 & 1,
        "avx512vl": avx512_state and ebx7 >> 31 & 1,
        "avx512_vnni": avx512_state and ecx7 >> 11 & 1,
        "avx512_bf16": avx512_state and eax71 >> 5 & 1,
        "avx512_fp16": avx512_state and edx7 >> 23 & 1,
        "amx_tile": amx_state and edx7 >> 24 & 1,
        "amx_int8": amx_state and edx7 >> 25 & 1,
        "amx_bf16": amx_state and edx7 >> 22 & 1,
        "amx_fp16": amx_state and eax71 >> 21 & 1,
    }
    return frozenset(name for name, present in bits.items() if present)


def features_from_cpuinfo(arch: str, cpuinfo: str) -> list[str]:
    """The features named here, from the text of ``/proc/cpuinfo`` (x86's ``flags``, Arm's ``Features``)."""
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            found.update(value.split())
    return _named(arch, found)


def _named(arch: str, flags: Set[str]) -> list[str]:
    if arch == "x86_64":
        return [name for name, needs in _X86_FLAGS if all(flag in flags for flag in needs)]
    return [name for name, flag in _ARM_FEATURES if flag in flags]


@functools.lru_cache(maxsize=1)
def instruction_set() -> str:
    """This machine's architecture and the features named here that its CPU offers this process: ``x86_64 FMA AVX2
    AVX512 AVX512-VNNI AVX512-BF16``, ``aarch64 NEON FP16 DOTPROD``."""
    from edgeline.machine import normalise_arch

    arch = normalise_arch(platform.machine())
    flags = x86_features() if arch == "x86_64" else None
    if flags is not None:
        named = _named(arch, flags)
    else:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            text = ""
        named = features_from_cpuinfo(arch, text)
    return " ".join([arch, *named])
