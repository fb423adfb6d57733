"""What a bundle is checked against on this machine, for whoever asks (``edgeline verify``, the update agent and its
cage, the power-cut check): the golden self-test, and whether a figure measured here may be held against the
device's budgets.

``golden_check`` runs ``golden.npz`` through an open model: the bundle's own outputs within their tolerances, or, for
a bundle nothing at export could run, its fidelity against the float model's outputs judged by the profile's budgets.
Each check is a dict of figures; ``ok`` is True or False only for what was checked, None (with ``reason``) otherwise.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeline.model import Model

__all__ = ["device_budget_refusal", "golden_check"]


def golden_check(model: Model) -> dict[str, Any]:
    import numpy as np

    from edgeline.samples import read_golden

    golden = model.manifest.golden
    if golden is None:
        return {"check": "golden", "ok": None, "samples": 0, "reason": "the bundle has no golden.npz"}
    inputs, expected = read_golden(model.bundle.file(golden.path), golden, model.inputs, model.outputs)
    if golden.reference == "float":
        return _fidelity_check(model, inputs, expected, golden.samples)
    worst = 0.0
    mismatched = 0
    for i in range(golden.samples):
        outputs = model.predict(*(a[i : i + 1] for a in inputs))
        ok = True
        for j, (got, want) in enumerate(zip(outputs, expected, strict=True)):
            want_i = want[i : i + 1].reshape(got.shape)
            worst = max(worst, float(np.abs(got - want_i).max()))
            ok &= bool(np.allclose(got, want_i, rtol=golden.rtol, atol=golden.atol[j]))
        mismatched += not ok
    return {
        "check": "golden",
        "ok": mismatched == 0,
        "samples": golden.samples,
        "mismatched_samples": mismatched,
        "max_abs_error": worst,
        "atol": list(golden.atol),
        "rtol": golden.rtol,
    }


def _fidelity_check(model: Model, inputs: list[Any], expected: list[Any], samples: int) -> dict[str, Any]:
    """The bundle against the float model's outputs in golden.npz (a bundle nothing at export could run), judged as
    export judges a measured bundle: top-1 disagreement against max_accuracy_drop for a classifier, else the
    cosine similarity against min_cosine; with neither, figures only."""
    import numpy as np

    worst, cosines, agree = 0.0, [], 0
    for i in range(samples):
        outputs = model.predict(*(a[i : i + 1] for a in inputs))
        for got, want in zip(outputs, expected, strict=True):
            want_i = np.asarray(want[i : i + 1], np.float64).reshape(got.shape)
            worst = max(worst, float(np.abs(got - want_i).max()))
            norms = float(np.linalg.norm(got) * np.linalg.norm(want_i))
            cosines.append(float(np.dot(got.ravel(), want_i.ravel()) / norms) if norms else 1.0)
        agree += int(np.argmax(outputs[0]) == np.argmax(expected[0][i]))
    budgets = model.manifest.budgets
    check: dict[str, Any] = {
        "check": "fidelity",
        "reference": "float",
        "samples": samples,
        "max_abs_error": worst,
        "cosine_min": min(cosines),
        "top1_agreement": None,
        "ok": None,
        "reason": "no budget applies (raw outputs, no min_cosine)",
    }
    if model.manifest.postprocess.kind == "classify":
        check["top1_agreement"] = agree / samples
        check["budget"] = f"top-1 disagreement <= {budgets.max_accuracy_drop:g}%"
        # on counts, the budget as the decimal the profile wrote: 3 of 300 is exactly 1 point, never 1.0000000000000009
        check["ok"] = (samples - agree) * 100 <= Fraction(str(budgets.max_accuracy_drop)) * samples
        check["reason"] = None
    elif budgets.min_cosine is not None:
        check["budget"] = f"cosine >= {budgets.min_cosine:g}"
        check["ok"] = check["cosine_min"] >= budgets.min_cosine
        check["reason"] = None
    return check


def device_budget_refusal(model: Model, backend: str | None = None) -> str | None:
    """Why a figure measured here cannot be held against the device's budgets, or None when it can: this machine is
    of the bundle's device kind, runs the bundle's runtime (``backend``: a runtime asked for instead) and
    emulates nothing."""
    from edgeline.machine import mismatch, this_machine

    manifest = model.manifest
    if model.emulator is not None:
        return f"measured on {model.emulator}, not on the device"
    if backend is not None and backend != manifest.backend:
        return f"run with {backend}, not with the bundle's runtime {manifest.backend}"
    if manifest.device is None:
        return "the bundle does not name its device (exported before manifests recorded it)"
    return mismatch(manifest.device, this_machine())
