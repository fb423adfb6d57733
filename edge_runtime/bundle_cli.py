"""``edgeline bundle show``: what a bundle holds and promises, read from its verified manifest (no model is run).

Inputs and outputs, an example payload for ``edgeline run``, postprocessing, fidelity, placement, size, memory and
signature status; ``--json`` prints the same as one JSON document. Torch-free: this is also a device's command, and
registering it imports nothing heavy (``edgeline --help`` stays light).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeline.bundle import Bundle
    from edgeline.manifest import Manifest, Placement, TensorSpec

__all__ = ["describe_bundle", "register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bundle",
        help="inspect a bundle",
        description="Inspect a bundle: its files are verified against the manifest first.",
    )
    actions = parser.add_subparsers(dest="bundle_action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="inputs, outputs, example payload, postprocessing, fidelity, placement, size and signature",
        description="Show what a bundle holds: inputs and outputs, an example payload for `edgeline run`, "
        "postprocessing, fidelity against the float model, placement, size and signature status.",
    )
    show.add_argument("bundle", metavar="BUNDLE", type=Path, help="bundle directory")
    show.add_argument("--json", action="store_true", help="print one JSON document")
    show.add_argument(
        "--layers",
        action="store_true",
        help="also every layer's SQNR and cosine against the float model (a quantized bundle's), worst marked",
    )
    show.set_defaults(func=run_show)


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    quantization = spec.quantization
    return {
        "name": spec.name,
        "dtype": spec.dtype,
        "shape": list(spec.shape),
        "values": spec.size,
        "quantization": None if quantization is None else quantization.model_dump(),
    }


def _placement(placement: Placement | None) -> dict[str, Any] | None:
    if placement is None:
        return None
    return dict(
        placement.model_dump(),
        accelerator_share=placement.accelerator_share,
        quantized_share=placement.quantized_share,
        summary=placement.describe(),
        left_out=placement.describe_sources(),
    )


def _memory(manifest: Manifest) -> dict[str, Any]:
    """What export measured of the model's memory (nothing, for a manifest without figures) and the profile's budget,
    which only ``edgeline verify`` checks, on the device."""
    memory = manifest.memory
    figures: dict[str, Any] = (
        {"resident_mb": None, "arena_bytes": None, "measured_with": None, "unknown": {}}
        if memory is None
        else memory.model_dump()
    )
    return dict(figures, recorded=memory is not None, max_memory_mb=manifest.budgets.max_memory_mb)


def describe_bundle(bundle: Bundle) -> dict[str, Any]:
    """The facts ``bundle show`` prints, as plain data (numbers as numbers)."""
    from edgeline.backends import RUNTIME_BACKENDS, runtime_backend
    from edgeline.bundle import MANIFEST_FILE, SIGNATURE_FILE
    from edgeline.daemon.codecs import example_payload, payload_fields

    manifest = bundle.manifest
    sizes = {entry.path: entry.size for entry in manifest.files}
    manifest_bytes = bundle.file(MANIFEST_FILE).stat().st_size
    signature = bundle.file(SIGNATURE_FILE)
    signature_bytes = signature.stat().st_size if signature.is_file() else 0
    post = manifest.postprocess
    return {
        "bundle": str(bundle.path),
        "name": manifest.name,
        "version": manifest.version,
        "created": manifest.created,
        "profile": manifest.profile,
        "backend": manifest.backend,
        "base_install_runs_it": manifest.backend in RUNTIME_BACKENDS and runtime_backend(manifest.backend).base_install,
        "precision": manifest.precision,
        "threads": manifest.threads,
        "runtime": manifest.runtime.model_dump(),
        "inputs": [_tensor(spec) for spec in manifest.inputs],
        "outputs": [_tensor(spec) for spec in manifest.outputs],
        "window": None if manifest.window is None else manifest.window.model_dump(),
        "payload": {
            "codec": "json",
            "example": example_payload("json", manifest.inputs, manifest.window),
            "values": payload_fields(manifest.inputs, manifest.window),
        },
        "preprocess": None if manifest.preprocess is None else manifest.preprocess.model_dump(),
        "image": None
        if manifest.image is None
        else dict(manifest.image.model_dump(), summary=manifest.image.describe()),
        "postprocess": {
            "kind": post.kind,
            "labels": None if post.labels is None else list(post.labels),
            "score": post.score if post.kind == "classify" else None,
            "anomaly_score": post.anomaly_score if post.kind == "anomaly" else None,
            "threshold": post.threshold,
        },
        "fidelity": manifest.fidelity.model_dump(),
        "quantization": None if manifest.quantization is None else manifest.quantization.model_dump(),
        "placement": _placement(manifest.placement),
        "estimates": None if manifest.estimates is None else manifest.estimates.model_dump(),
        "memory": _memory(manifest),
        "size": {
            "model_bytes": sum(entry.size for entry in manifest.model_entries),
            "bundle_bytes": sum(sizes.values()) + manifest_bytes + signature_bytes,
            "files": len(sizes) + 1 + bool(signature_bytes),
            "max_model_bytes": manifest.budgets.max_model_bytes,
        },
        # Bundles are signed in an update repository (edgeline.updates); a manifest.sig is reported, never verified.
        "signature": {"present": signature.is_file(), "verified": False},
    }


def _shape(tensor: dict[str, Any]) -> str:
    text = f"{tensor['name']}  {tensor['dtype']}{tensor['shape']}"
    quantization = tensor["quantization"]
    if quantization is not None:
        text += f"  quantized: scale {quantization['scale']:.6g}, zero point {quantization['zero_point']}"
    return text


def _fidelity_line(fidelity: dict[str, Any]) -> str:
    if fidelity["status"] != "measured":
        return f"not measured: {fidelity['reason']}"
    parts = [f"against {fidelity['reference']} on {fidelity['samples']} samples"]
    if fidelity["max_abs_error"] is not None:
        parts.append(f"max |error| {fidelity['max_abs_error']:.3g}, mean {fidelity['mean_abs_error']:.3g}")
    if fidelity["cosine_min"] is not None:
        parts.append(f"min cosine {fidelity['cosine_min']:.4f}")
    if fidelity["top1_agreement"] is not None:
        parts.append(f"top-1 agreement {fidelity['top1_agreement'] * 100:.2f}%")
    if fidelity["accuracy"] is not None:
        float_accuracy = fidelity["accuracy_float"]
        versus = "" if float_accuracy is None else f" (float model {float_accuracy * 100:.2f}%)"
        parts.append(f"accuracy {fidelity['accuracy'] * 100:.2f}%{versus}")
    if fidelity["anomaly_agreement"] is not None:
        parts.append(f"anomaly agreement {fidelity['anomaly_agreement'] * 100:.2f}%")
    text = "; ".join(parts) + (f" (measured with {fidelity['measured_with']})" if fidelity["measured_with"] else "")
    if fidelity.get("instruction_set") or fidelity.get("computed_in"):
        computed = [f"float operators in {fidelity['computed_in']}"] if fidelity.get("computed_in") else []
        if fidelity.get("instruction_set"):
            computed.append(f"on {fidelity['instruction_set']}")
        text += f"; computed with {' '.join(computed)}"
    return text


def _placement_line(placement: dict[str, Any] | None) -> str:
    return "not recorded by the exporter" if placement is None else str(placement["summary"])


def _estimates_line(estimates: dict[str, Any]) -> str:
    clock = f" at {estimates['clock_mhz']:g} MHz" if estimates["clock_mhz"] else ""
    figures = [
        f"{estimates['cycles']:,} cycles" if estimates["cycles"] is not None else None,
        f"{estimates['inference_ms']:.3g} ms{clock}" if estimates["inference_ms"] is not None else None,
        f"SRAM {estimates['sram_bytes']:,} B" if estimates["sram_bytes"] is not None else None,
        f"flash {estimates['flash_bytes']:,} B" if estimates["flash_bytes"] is not None else None,
        f"DRAM {estimates['dram_bytes']:,} B" if estimates["dram_bytes"] is not None else None,
    ]
    shown = ", ".join(f for f in figures if f)
    covers = f"; {estimates['covers']}" if estimates.get("covers") else ""
    return f"{shown} (estimated by {estimates['tool']} for {estimates['target']}; not measured{covers})"


_MEMORY_FIGURES = {"resident_mb": "resident", "arena_bytes": "TFLite Micro arena"}


def _memory_line(memory: dict[str, Any]) -> str:
    """The figures export measured, or why not; the budget is never shown as if it were checked."""
    if not memory["recorded"]:
        parts = ["not measured at export (the manifest has no memory figures)"]
    else:
        measured = ", ".join(
            figure
            for figure in (
                f"{memory['resident_mb']:.1f} MB resident" if memory["resident_mb"] is not None else "",
                f"TFLite Micro arena {memory['arena_bytes']:,} bytes" if memory["arena_bytes"] is not None else "",
            )
            if figure
        )
        tool = f" with {memory['measured_with']}" if memory["measured_with"] else ""
        parts = [f"{measured} (measured at export{tool})"] if measured else []
        parts += [
            f"{_MEMORY_FIGURES.get(key, key)} not measured at export: {why}" for key, why in memory["unknown"].items()
        ]
    budget = memory["max_memory_mb"]
    judged = (
        "the profile sets no memory budget"
        if budget is None
        else f"profile budget {budget:,} MB, not checked: `edgeline verify` checks it on the device"
    )
    return "; ".join([*(parts or ["not measured at export"]), judged])


def _postprocess_line(post: dict[str, Any]) -> str:
    line = post["kind"]
    if post["kind"] == "classify":
        labels = post["labels"]
        line += f" ({post['score']}); labels: " + ("none (class indexes)" if labels is None else ", ".join(labels))
    elif post["kind"] == "anomaly":
        line += f" (score: {post['anomaly_score']}); anomaly when score > {post['threshold']:g}"
    return line


def format_description(info: dict[str, Any]) -> str:
    package = info["runtime"]["package"]
    runs = "in the base install" if info["base_install_runs_it"] else f"{package} is not part of the base install"
    size = info["size"]
    budget = "" if size["max_model_bytes"] is None else f" (profile budget {size['max_model_bytes']:,})"
    signature = info["signature"]
    lines = [
        f"{info['name']} v{info['version']}  {info['bundle']}  (created {info['created']})",
        f"target:       {info['profile']}, {info['backend']} {info['precision']}, {info['threads']} thread(s); "
        f"runtime {package} >= {info['runtime']['min_version']} ({runs})",
        *(f"input:        {_shape(tensor)}" for tensor in info["inputs"]),
        *(f"output:       {_shape(tensor)}" for tensor in info["outputs"]),
        f"payload:      {info['payload']['example']}  (edgeline run, codec json)",
        *([f"image:        {info['image']['summary']} (how a camera frame becomes input 0)"] if info["image"] else []),
        f"postprocess:  {_postprocess_line(info['postprocess'])}",
        f"fidelity:     {_fidelity_line(info['fidelity'])}",
        f"placement:    {_placement_line(info['placement'])}",
        f"size:         model {size['model_bytes']:,} bytes{budget}; bundle {size['bundle_bytes']:,} bytes "
        f"in {size['files']} files (sizes and sha256 verified)",
        f"memory:       {_memory_line(info['memory'])}",
        "signature:    "
        + ("manifest.sig present, not verified (bundles are verified by an update repository's signed metadata)"
           if signature["present"] else "none in the bundle (`edgeline publish` signs it in an update repository)"),
    ]  # fmt: skip
    if info["quantization"] is not None:
        lines.insert(lines.index(f"fidelity:     {_fidelity_line(info['fidelity'])}") + 1,
                     f"quantization: {_quantization_line(info['quantization'])}")  # fmt: skip
    if info["estimates"] is not None:
        lines.insert(lines.index(f"placement:    {_placement_line(info['placement'])}") + 1,
                     f"estimates:    {_estimates_line(info['estimates'])}")  # fmt: skip
    left_out = (info["placement"] or {}).get("left_out")
    if left_out:
        lines.insert(lines.index(f"placement:    {_placement_line(info['placement'])}") + 1,
                     f"left out:     {left_out}")  # fmt: skip
    if info["window"] is not None:
        window = info["window"]
        lines.insert(4, f"window:       {window['size']} steps of {window['channels']} channels, hop {window['hop']}")
    return "\n".join(lines)


def _quantization_line(quantization: dict[str, Any]) -> str:
    from edgeline.manifest import LayerFidelity, worst_layers

    parts = []
    if quantization["kept_float"]:
        kept = ", ".join(entry["module"] for entry in quantization["kept_float"])
        precisions = "/".join(sorted({entry.get("precision", "float32") for entry in quantization["kept_float"]}))
        parts.append(f"mixed precision: {kept} kept {precisions} ({quantization['int8_missed']} with every layer int8)")
    layers = tuple(LayerFidelity.model_validate(layer) for layer in quantization["layers"])
    worst = worst_layers(layers, 1)
    if worst:
        parts.append(
            f"{len(layers)} layers measured, the most noise added at {worst[0].module} ({worst[0].operator}, "
            f"{worst[0].added_sqnr_db:.1f} dB): --layers for each"
        )
    elif not layers:
        parts.append(f"layers not measured: {quantization['layers_unknown'] or 'none recorded'}")
    for rewrite in quantization["rewrites"]:
        parts.append(f"{rewrite['operator']} ({rewrite['count']}) computes {rewrite['replacement']}")
    if quantization.get("activation_ranges"):
        parts.append(f"activation ranges by {quantization['activation_ranges']}")
    return "; ".join(parts) or "nothing beyond the precision"


def format_layers(info: dict[str, Any]) -> str:
    """``--layers``: one row per torch layer in execution order, the five that lost the most marked."""
    from edgeline.manifest import LayerFidelity, worst_layers

    quantization = info["quantization"]
    if quantization is None:
        return f"layers:       none recorded ({info['precision']}: nothing was quantized)"
    layers = tuple(LayerFidelity.model_validate(layer) for layer in quantization["layers"])
    if not layers:
        return f"layers:       not measured: {quantization['layers_unknown'] or 'this bundle records none'}"
    worst = {layer.module: rank for rank, layer in enumerate(worst_layers(layers), 1)}
    kept = {entry["module"]: entry.get("precision", "float32") for entry in quantization["kept_float"]}

    def note(module: str) -> str:
        marks = [f"kept {kept[module]} (mixed precision)"] if module in kept else []
        marks += [f"worst {worst[module]}"] if module in worst else []
        return f"<- {', '.join(marks)}" if marks else ""

    isolated = any(layer.isolated_sqnr_db is not None for layer in layers)
    header = ("layer", "operator", "shape", "added SQNR", *(("isolated",) if isolated else ()), "worst channel",
              "SQNR", "cosine", "")  # fmt: skip
    rows = [header] + [
        (
            layer.module,
            layer.operator,
            "x".join(map(str, layer.shape)),
            _db(layer.added_sqnr_db, "adds none"),
            *((_db(layer.isolated_sqnr_db, "-"),) if isolated else ()),
            _db(layer.channel_sqnr_db, "exact"),
            _db(layer.sqnr_db, "exact"),
            f"{layer.cosine:.6f}",
            note(layer.module),
        )
        for layer in layers
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"layers:       {len(layers)} layers against the float model on {quantization['layers_samples']} validation "
        f"samples ({quantization['layers_measured_with']})",
        "              added SQNR: of the noise the layer adds itself (the lowest lost the most); "
        + ("isolated: its worst channel's, computed from the float model's values at its inputs; " if isolated else "")
        + "worst channel: the SQNR of its worst channel; SQNR and cosine: of its whole output, accumulated",
        *(
            "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ),
    ]
    return "\n".join(lines)


def _db(value: float | None, none: str) -> str:
    return none if value is None else f"{value:.1f} dB"


def run_show(args: argparse.Namespace) -> int:
    from edgeline.bundle import read_bundle

    info = describe_bundle(read_bundle(args.bundle))
    if args.json:
        print(json.dumps(info, indent=2))
    elif args.layers:
        print(format_description(info) + "\n" + format_layers(info))
    else:
        print(format_description(info))
    return 0
