"""``edgeline infer BUNDLE --input IMAGE|DIR|GLOB``: image files through the bundle's own pre-processing (the
function the daemon applies to camera frames), one answer per image, and ``--annotate OUTDIR`` copies with the
answer drawn on them (``edgeline.annotate``).

    --input photo.jpg         one image
    --input shots/            every image under it (``edgeline.imaging.list_images``: the exporter's rules)
    --input 'shots/**/*.png'  a pattern, expanded here (quoted: the shell would otherwise), at most MAX_IMAGES files

Each image is read as the exporter reads it (``edgeline.imaging.read_image``), and a detector's boxes are given in
the image's own coordinates (normalised; the letterbox undone). A file that is not a readable image is one error line
naming it; the others are answered all the same, and the exit code says that one failed.
"""

from __future__ import annotations

import glob
import io
import itertools
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.errors import EdgelineError
from edgeline.imaging import IMAGE_SUFFIXES, MAX_IMAGES

if TYPE_CHECKING:
    import numpy as np

    from edgeline.imaging import FramePrep
    from edgeline.model import Model

__all__ = ["ImageInput", "frame_prep", "infer_images", "resolve_images"]

BOXES_SHOWN = 3
"""The detections a text line names (the best ones)."""
JPEG_QUALITY = 90
_GLOB_MAGIC = frozenset("*?[")
SAMPLE_SUFFIXES = (".npz", ".json", ".jsonl")
"""What ``infer`` reads as samples or payloads, never as images (a pattern ending so is taken as a file name)."""
_WRITTEN_AS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG"}


@dataclass(frozen=True)
class ImageInput:
    """An image to answer, and where it stands below the input's root (its annotated copy's place in OUTDIR)."""

    path: Path
    relative: Path


@dataclass(frozen=True)
class ImageSet:
    """The images an ``--input`` names, and the folder their ``relative`` paths start from."""

    images: tuple[ImageInput, ...]
    root: Path


def _is_pattern(text: str) -> bool:
    return any(char in _GLOB_MAGIC for char in text)


def _expand(pattern: str) -> ImageSet:
    """A glob pattern's files (``**`` spans folders), sorted, bounded; relative to the pattern's fixed folders."""
    matches = list(itertools.islice(glob.iglob(pattern, recursive=True), MAX_IMAGES + 1))
    if len(matches) > MAX_IMAGES:
        raise EdgelineError(f"--input {pattern}: matches more than {MAX_IMAGES:,} files; give a narrower pattern")
    files = sorted(Path(match) for match in matches if not Path(match).is_dir())
    if not files:
        raise EdgelineError(f"--input {pattern}: no file matches it")
    fixed = list(itertools.takewhile(lambda part: not _is_pattern(part), Path(pattern).parts[:-1]))
    root = Path(*fixed) if fixed else Path()
    return ImageSet(tuple(ImageInput(path, path.relative_to(root)) for path in files), root)


def resolve_images(path: Path) -> ImageSet | None:
    """The images ``--input`` names: a folder (its images, recursively, sorted), an image file (by its suffix), or
    a glob pattern that names no existing file; None for anything else (an .npz or payload file, as now)."""
    if path.is_dir():
        from edgeline.imaging import list_images

        found = list_images(path, "input")
        if not found:
            raise EdgelineError(
                f"input folder {path}: no images ({', '.join(IMAGE_SUFFIXES)}) in it or its sub-folders"
            )
        return ImageSet(tuple(ImageInput(image, image.relative_to(path)) for image in found), path)
    if not (path.exists() or path.is_symlink()) and _is_pattern(str(path)) and path.suffix not in SAMPLE_SUFFIXES:
        return _expand(str(path))
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        return None
    if not path.exists():
        raise EdgelineError(f"--input {path}: no such file")
    return ImageSet((ImageInput(path, Path(path.name)),), path.parent)


def frame_prep(model: Model, flag: str) -> FramePrep:
    """The bundle's image pre-processing for its one input (what ``edgeline run --camera`` and ``infer`` on images
    apply), or an error starting with ``flag`` that says why frames cannot be its input."""
    from edgeline.imaging import FramePrep

    image = model.manifest.image
    if image is None or len(model.inputs) != 1:
        what = (
            "takes several inputs"
            if image is not None
            else "does not say how a frame becomes its input (no image pre-processing in its manifest)"
        )
        raise EdgelineError(
            f"{flag}: the bundle {model.name} v{model.version} {what}; export an image model with --preprocess "
            "(e.g. --preprocess resize=letterbox,color=rgb) so that its manifest carries the pre-processing"
        )
    return FramePrep(image, model.inputs[0])


def _copy_name(relative: Path) -> Path:
    """An annotated copy is written as PNG or JPEG, as its image was; another format as PNG, ``.png`` added."""
    return relative if relative.suffix.lower() in _WRITTEN_AS else relative.with_name(relative.name + ".png")


def _encoded(image: np.ndarray, name: Path) -> bytes:
    from PIL import Image

    fmt = _WRITTEN_AS.get(name.suffix.lower(), "PNG")
    buffer = io.BytesIO()
    options = {"quality": JPEG_QUALITY} if fmt == "JPEG" else {}
    Image.fromarray(image, mode="RGB").save(buffer, format=fmt, **options)
    return buffer.getvalue()


class _Annotator:
    """Annotated copies under ``directory`` (made if missing), sub-folders mirrored, written with
    ``edgeline.durable``: nothing planted there (a link, a FIFO) is written through."""

    def __init__(self, directory: Path, images: ImageSet):
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)  # the folder the user named, taken as it resolves
        except OSError as exc:
            raise EdgelineError(f"--annotate {directory}: cannot make it: {exc.strerror or exc}") from exc
        if directory.resolve() == images.root.resolve():
            raise EdgelineError(
                f"--annotate {directory} is the input's own folder: its images would be overwritten; give another"
            )

    def write(self, image: ImageInput, frame: np.ndarray, answer: Mapping[str, Any]) -> None:
        from edgeline.annotate import annotate, answer_caption
        from edgeline.durable import ensure_directory, write_atomically

        caption = None if "detections" in answer else answer_caption(answer)
        name = self.directory / _copy_name(image.relative)
        data = _encoded(annotate(frame, answer, caption=caption), name)
        try:
            ensure_directory(name.parent, within=self.directory)
            write_atomically(name, data, within=self.directory)
        except OSError as exc:
            raise EdgelineError(f"annotated copy {name}: {exc.strerror or exc}") from exc


def _detections_line(answer: Mapping[str, Any], width: int, height: int) -> str:
    """ "N detections: label score [x1 y1 x2 y2], ..." (the best few; boxes in the image's pixels)."""
    found = answer["detections"]
    shown = []
    for detection in found[:BOXES_SHOWN]:
        x1, y1, x2, y2 = detection["box"]
        pixels = f"{x1 * width:.0f} {y1 * height:.0f} {x2 * width:.0f} {y2 * height:.0f}"
        shown.append(f"{detection['label']} {detection['score']:.2f} [{pixels}]")
    more = f", ... {len(found) - BOXES_SHOWN} more" if len(found) > BOXES_SHOWN else ""
    return f"{len(found)} detection{'' if len(found) == 1 else 's'}" + (": " + ", ".join(shown) + more if shown else "")


def _failure(image: ImageInput, exc: EdgelineError) -> str:
    text = str(exc)
    return text if str(image.path) in text else f"image {image.path}: {text}"


def infer_images(
    model: Model,
    images: ImageSet,
    *,
    top_k: int = 1,
    as_json: bool = False,
    show: int = 5,
    annotate: Path | None = None,
    overrides: Mapping[str, float] | None = None,
    summary: Callable[[dict[str, Any], list[list[int]]], str],
) -> tuple[int, list[float]]:
    """Answer each image (printing a line or a JSON object), annotated copies in ``annotate``: (images that failed,
    the model's time per image). ``summary`` makes a text line of an answer that is not a detector's."""
    from edgeline.imaging import read_image

    prep = frame_prep(model, "--input")
    annotator = _Annotator(annotate, images) if annotate is not None else None
    detector = model.manifest.postprocess.kind == "detect"
    failed = 0
    printed = 0
    latencies: list[float] = []
    for image in images.images:
        try:
            if not image.path.is_file():  # a FIFO would block the read
                raise EdgelineError(
                    f"image {image.path}: " + ("not a regular file" if image.path.exists() else "no such file")
                )
            frame = read_image(image.path)
            height, width = frame.shape[:2]
            inputs = [prep(frame)]
            start = time.perf_counter()
            outputs = model.predict(*inputs)
            latencies.append(time.perf_counter() - start)
            answer = model.interpret(
                inputs, outputs, top_k=top_k, frame_size=(height, width), overrides=overrides
            ).as_dict()
            if annotator is not None:
                annotator.write(image, frame, answer)
        except EdgelineError as exc:
            failed += 1
            message = _failure(image, exc)
            print(f"error: {message}", file=sys.stderr)
            if as_json:
                print(json.dumps({"image": str(image.path), "error": message}))
            continue
        if as_json:
            record: dict[str, Any] = {"image": str(image.path), "width": width, "height": height}
            if not detector:  # a detector's raw outputs are megabytes a line
                record["outputs"] = [output.tolist() for output in outputs]
            print(json.dumps({**record, **answer}))
            continue
        printed += 1
        if printed <= show:
            line = (
                _detections_line(answer, width, height)
                if detector
                else summary(answer, [list(output.shape) for output in outputs])
            )
            print(f"{image.path} ({width}x{height}): {line}")
    if not as_json and printed > show:
        print(f"... {printed - show} more images")
    return failed, latencies
