"""``edgeline profiles``: list, show and describe device profiles."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeline.device_profiles.schema import Profile

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``profiles`` (with ``list``, ``show`` and ``schema``) to the main command's subparsers."""
    parser = subparsers.add_parser(
        "profiles",
        help="list and show device profiles",
        description="Device profiles: the devices edgeline exports for, their ordered targets and budgets.",
    )
    actions = parser.add_subparsers(dest="profiles_command", metavar="ACTION", required=True)

    list_parser = actions.add_parser("list", help="list the bundled profiles")
    list_parser.add_argument("--json", action="store_true", help="print the profiles as one JSON document (a list)")
    list_parser.set_defaults(func=_list)

    show_parser = actions.add_parser("show", help="show one profile")
    show_parser.add_argument("profile", metavar="ID_OR_PATH", help="a bundled id such as rpi5, or a .toml file")
    show_parser.add_argument("--json", action="store_true", help="print the profile as one JSON document")
    show_parser.set_defaults(func=_show)

    schema_parser = actions.add_parser("schema", help="print the JSON Schema of a profile file")
    schema_parser.set_defaults(func=_schema)


def _list(args: argparse.Namespace) -> int:
    from edgeline.device_profiles.loader import list_profiles

    profiles = list_profiles()
    if args.json:
        print(json.dumps([_as_json(profile) for profile in profiles], indent=2))
        return 0
    header = ("ID", "NAME", "CPU", "CORES", "MEMORY", "FIRST TARGET")
    rows = [header] + [
        (
            profile.id,
            profile.name,
            profile.cpu.name,
            str(profile.cpu.cores),
            _memory(profile),
            f"{profile.targets[0].backend} {profile.targets[0].precision.value}",
        )
        for profile in profiles
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _show(args: argparse.Namespace) -> int:
    from edgeline.device_profiles.loader import load_profile

    profile = load_profile(args.profile)
    if args.json:
        print(json.dumps(_as_json(profile), indent=2))
    else:
        print("\n".join(_describe(profile)))
    return 0


def _schema(args: argparse.Namespace) -> int:
    from edgeline.device_profiles.loader import profile_json_schema

    print(json.dumps(profile_json_schema(), indent=2))
    return 0


def _as_json(profile: Profile) -> dict[str, Any]:
    return profile.model_dump(mode="json")


def _describe(profile: Profile) -> list[str]:
    cpu = profile.cpu
    clock = f", up to {cpu.max_freq_mhz} MHz" if cpu.max_freq_mhz is not None else ""
    budgets = profile.budgets
    lines = [
        f"{profile.id}: {profile.name}",
        f"  {profile.description}",
        f"  file:    {profile.source}",
        f"cpu:       {cpu.name} ({cpu.arch}), {cpu.cores} cores{clock}",
        f"           features: {', '.join(cpu.isa_features) or 'none listed'}",
        f"memory:    {_memory(profile)}",
        f"os:        {profile.os}",
        f"daemon:    {'runs edgeline run' if profile.daemon else 'no (the bundle goes into an app or firmware)'}",
        *_accelerators(profile),
        "targets (tried in this order):",
    ]
    backend_width = max(len(target.backend) for target in profile.targets)
    precision_width = max(len(target.precision.value) for target in profile.targets)
    for number, target in enumerate(profile.targets, start=1):
        lines.append(
            f"  {number}. {target.backend.ljust(backend_width)}  "
            f"{target.precision.value.ljust(precision_width)}  {target.threads} threads"
        )
    lines += [
        "budgets:",
        f"  max model size:     {_bytes(budgets.max_model_bytes)}",
        f"  max accuracy drop:  {budgets.max_accuracy_drop} percentage points",
        f"  min cosine:         {_or_none(budgets.min_cosine)} (used when there are no labels)",
        f"  max mAP drop:       {budgets.max_map_drop} points of mAP@0.5 (detectors)",
        f"  max latency:        {_or_none(budgets.max_latency_ms, ' ms')} "
        "on the device (checked by on-device verification, not host timing)",
        f"  max memory:         {_or_none(budgets.max_memory_mb, ' MB')}",
        f"  max tensor arena:   {_bytes(budgets.max_arena_bytes)}"
        + (" (TFLite Micro's, margin included)" if budgets.max_arena_bytes is not None else ""),
        f"  min on accelerator: {_share(budgets.min_accelerator_share, 'of operators on the accelerator')}",
        f"  min quantized:      {_share(budgets.min_quantized_share, 'of operators in int8 (int8 targets)')}",
    ]
    return lines


def _share(value: float | None, what: str) -> str:
    return "none" if value is None else f"{value:.0%} {what}"


def _accelerators(profile: Profile) -> list[str]:
    """One line per hardware section: what the exporters are told about the device's NPU, GPU or Core ML, or a
    microcontroller's memories."""
    lines = []
    for key in ("coreml", "qnn", "ethos_u", "onnxruntime", "microcontroller"):
        section = getattr(profile, key)
        if section is not None:
            fields = ", ".join(
                f"{name}={'/'.join(value) if isinstance(value, tuple) else value}"
                for name, value in section.model_dump().items()
            )
            lines.append(f"{key + ':':<10} {fields}")
    return lines


def _memory(profile: Profile) -> str:
    """memory_mb, or a microcontroller's SRAM and flash (a few hundred KiB: no whole number of MB)."""
    mcu = profile.microcontroller
    if profile.memory_mb is not None:
        return _megabytes(profile.memory_mb)
    assert mcu is not None  # the schema requires one of the two
    return f"{mcu.sram_bytes // 1024} KiB SRAM, {mcu.flash_bytes // 1024} KiB flash"


def _megabytes(value: int) -> str:
    return f"{value // 1024} GB" if value >= 1024 and value % 1024 == 0 else f"{value} MB"


def _bytes(value: int | None) -> str:
    if value is None:
        return "none"
    if value % (1024 * 1024) == 0:
        return f"{value // (1024 * 1024)} MiB ({value} bytes)"
    return f"{value} bytes"


def _or_none(value: float | None, unit: str = "") -> str:
    return "none" if value is None else f"{value}{unit}"
