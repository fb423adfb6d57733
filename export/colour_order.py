"""Whether the images reach the model in the colour order it was trained on.

A model trained on RGB and fed BGR (OpenCV's order) still runs, and where its classes differ by colour it is
quietly wrong; the fidelity check compares the bundle with the float model fed the same wrong images, so it cannot
see it. With labelled validation images, the float model is scored on them as declared and with red and blue
swapped (the normalisation undone, the channels swapped, redone: exactly the inputs the other order makes); when the
other order scores clearly better, the declared one is refused before anything is converted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgeline.export.errors import CalibrationError
from edgeline.export.fidelity import FloatReference, compare_outputs, run_float
from edgeline.manifest import ImagePreprocess, Postprocess
from edgeline.samples import SampleSet

__all__ = ["COLOUR_MARGIN", "check_colour_order", "swapped_channels"]

COLOUR_MARGIN = 10.0
"""Points (of accuracy or mAP@0.5, out of 100) by which the other colour order must score better to be refused:
far above what noise on a few hundred samples moves, far below what a swapped order costs a model whose classes
differ by colour."""


def swapped_channels(inputs: np.ndarray, image: ImagePreprocess) -> np.ndarray:
    """``inputs`` (made by ``image``) as the same pictures in the other colour order make them."""
    axis = 1 if image.layout == "nchw" else 3
    shape = [1, 1, 1, 1]
    shape[axis] = 3
    mean = np.broadcast_to(np.asarray(image.mean, dtype=np.float64), (3,)).reshape(shape)
    std = np.broadcast_to(np.asarray(image.std, dtype=np.float64), (3,)).reshape(shape)
    scaled = inputs.astype(np.float64) * std + mean  # x * scale, per channel
    return ((np.flip(scaled, axis=axis) - mean) / std).astype(np.float32)


def _score(fidelity: Any) -> tuple[float, float] | None:
    """(declared order's score, other order's score) in points, from a comparison whose "bundle" was the other."""
    if fidelity.map50 is not None and fidelity.map50_float is not None:
        return fidelity.map50_float * 100, fidelity.map50 * 100
    if fidelity.accuracy is not None and fidelity.accuracy_float is not None:
        return fidelity.accuracy_float * 100, fidelity.accuracy * 100
    return None


def check_colour_order(
    module: Any, samples: SampleSet, reference: FloatReference, post: Postprocess, image: ImagePreprocess | None
) -> None:
    """Refuse (``CalibrationError``) a colour order the float model scores ``COLOUR_MARGIN`` points worse on
    ``samples`` than the other one; nothing to check without labels, a colour image or a classifier or detector."""
    labelled = (post.kind == "classify" and samples.labels is not None) or (
        post.kind == "detect" and samples.truths is not None
    )
    if image is None or image.color == "gray" or not labelled or len(samples) == 0:
        return
    swapped = SampleSet([swapped_channels(samples.inputs[0], image)], samples.labels, samples.source,
                        geometries=samples.geometries, truths=samples.truths)  # fmt: skip
    other = run_float(module, swapped)
    scores = _score(compare_outputs(reference.outputs, other.outputs, samples, post, "colour order"))
    if scores is None:
        return
    declared, swapped_score = scores
    if swapped_score - declared > COLOUR_MARGIN:
        measure = "mAP@0.5" if post.kind == "detect" else "accuracy"
        flipped = "bgr" if image.color == "rgb" else "rgb"
        raise CalibrationError(
            f"{samples.source}: the float model scores {measure} {declared:.1f} with the images in {image.color} "
            f"order and {swapped_score:.1f} in {flipped}: it was trained on {flipped}; give --preprocess "
            f"color={flipped} (the device feeds it what the bundle says)"
        )
