"""sklearn's digits, and training the tests' small classifiers of them: one loop for every test that trains one
(deterministic for a seed set before the model is built; one thread, which batches this small train many times
faster on a shared machine), and one scaffold for a test's model of its own, trained once and cached."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tests.cache import cached

__all__ = ["digit_features", "digit_images", "train_classifier", "trained_model"]


def trained_model(
    source: str,
    file: str,
    factory: str,
    weights: str,
    x: Any,
    y: Any,
    *,
    key: Sequence[object] = (),
    epochs: int = 25,
    lr: float = 0.01,
    parameters: Callable[[Any], Iterable[Any]] | None = None,
    edit: Callable[[Any], None] | None = None,
) -> Path:
    """A model of a test's own: ``source`` written as ``file``, the module its ``factory`` builds (seed 0 set just
    before) trained on the numpy arrays ``x``, ``y`` by ``train_classifier`` (``epochs``, ``lr``; only
    ``parameters(module)`` when given), ``edit(module)`` run under ``torch.no_grad()`` (an outlier planted), and the
    state dict saved beside it as ``weights``, the name the factory loads, its sha256 written at the end of the source
    (a comment: a bundle cached by the source's contents is made again for other weights). Returns the source file's
    path, made once (tests/cache.py) for the source, the data, the settings, the code of this function, of
    ``train_classifier``, of ``parameters`` and ``edit``, and ``key``: what those read from outside (an outlier's
    scale). Never modify it."""
    import numpy as np

    data = hashlib.sha256()
    for array in map(np.ascontiguousarray, (x, y)):
        data.update(f"{array.dtype.str}\0{array.shape}\0".encode() + array.tobytes())

    def make(directory: Path) -> None:
        import torch

        from edgeline.export.loading import load_model

        path = directory / file
        path.write_text(source, encoding="utf-8")
        torch.manual_seed(0)
        module = load_model(f"{path}:{factory}").module
        chosen = None if parameters is None else parameters(module)
        train_classifier(module, torch.from_numpy(x), torch.from_numpy(y), epochs=epochs, lr=lr, parameters=chosen)
        if edit is not None:
            with torch.no_grad():
                edit(module)
        torch.save(module.state_dict(), directory / weights)
        # an export's cache key holds the source file's contents (tests/cache.py cached_export): so the weights too
        digest = hashlib.sha256((directory / weights).read_bytes()).hexdigest()
        path.write_text(f"{source}\n# weights: {digest}\n", encoding="utf-8")

    code = [inspect.getsource(f) for f in (trained_model, train_classifier, parameters, edit) if f is not None]
    inputs = [source, file, factory, weights, data.hexdigest(), epochs, lr, *code, *key]
    return cached("trained", inputs, make) / file


def train_classifier(
    module: Any,
    x: Any,
    y: Any,
    *,
    epochs: int = 25,
    lr: float = 0.01,
    parameters: Iterable[Any] | None = None,
    loss: Callable[..., Any] | None = None,
) -> None:
    """Adam on batches of 64 of the tensors ``x``, ``y`` for ``epochs`` passes (``parameters``: only these are
    trained; ``loss``: cross-entropy unless given); ``module`` is left in eval mode."""
    import torch

    criterion = loss or torch.nn.functional.cross_entropy
    optimizer = torch.optim.Adam(module.parameters() if parameters is None else parameters, lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module.train()
        for _ in range(epochs):
            for start in range(0, len(x), 64):
                optimizer.zero_grad()
                criterion(module(x[start : start + 64]), y[start : start + 64]).backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    module.eval()


def digit_images() -> tuple[Any, Any]:
    """sklearn's 8x8 digits as (N, 1, 8, 8) float32 images of raw pixel values (0..16), and their int64 labels."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32)[:, None], data.target.astype(np.int64)


def digit_features() -> tuple[Any, Any]:
    """sklearn's 8x8 digits as 64 float32 features (0..16), and their int64 labels."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data.astype(np.float32), data.target.astype(np.int64)
