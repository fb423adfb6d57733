"""The project's reference models: small networks after the MLPerf Tiny references, with data, in plain torch.

    name         task      input       data
    digits       classify  1x8x8       real: scikit-learn's handwritten digits
    resnet8      classify  3x32x32     real digits upscaled and tinted: a stand-in for CIFAR-10
    ds_cnn       classify  1x49x10     synthetic MFCC-like keyword features (12 Speech Commands labels)
    vww          classify  3x96x96     real scikit-learn photos with pasted digit glyphs: a stand-in for VWW
    autoencoder  anomaly   640         synthetic log-mel frames of a machine, normal and anomalous
    shapes       detect    3x96x96     synthetic shapes on textured backgrounds, with their boxes (YOLOv8-style head)

Each module has ``NAME``, ``TASK``, ``LABELS``, ``INPUT_SHAPE``, ``build(seed)``, ``make_data(seed)``,
``train(model, data, seed=)`` and ``model()`` (see :class:`ReferenceModule`; a detector's data are images with
boxes, :class:`DetectorReferenceModule`). :func:`prepare` trains one and writes the files an export run needs.
Importing this package imports neither torch nor the models.
"""

from edgeline.export.reference.preparation import Prepared, find_prepared, prepare
from edgeline.export.reference.registry import (
    CATALOGUE,
    REFERENCE_MODELS,
    DetectorReferenceModule,
    ReferenceInfo,
    ReferenceModule,
    load_reference,
    resolve_names,
)

__all__ = [
    "CATALOGUE",
    "REFERENCE_MODELS",
    "DetectorReferenceModule",
    "Prepared",
    "ReferenceInfo",
    "ReferenceModule",
    "find_prepared",
    "load_reference",
    "prepare",
    "resolve_names",
]
