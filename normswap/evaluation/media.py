"""Image inputs for vision models, which model takes which input, and the checkpoint's processors.

``--images PATH`` is an image file, or a folder of images, or a folder of class subfolders whose
names are the labels, or ``bundled``. Images are read with Pillow and converted to RGB. Audio
(``--audio``) is read by ``normswap.evaluation.audio``.

Every problem is one ``NormswapError`` line, raised before any model is loaded.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import ModuleType

from normswap.architectures import ARCHITECTURES
from normswap.checkpoint.provenance import original_model_type
from normswap.errors import NormswapError
from normswap.text import count

BUNDLED = "bundled"
# the most pixels one image may hold (about 33 M: a 24-megapixel photograph fits); each is decoded whole
MAX_IMAGE_PIXELS = 1 << 25
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")



def modality(config: dict) -> str:
    """``audio``, ``images`` or ``text``: what a checkpoint (original or converted) reads."""
    model_type = str(original_model_type(config))
    architecture = ARCHITECTURES.get(model_type)
    return architecture.modality_of(model_type) if architecture is not None else "text"


def require_modality(config: dict, source: str, given: str | None) -> None:
    """One line when the input option does not suit the model (``given``: audio, images or None)."""
    wanted = modality(config)
    model_type = original_model_type(config)
    if given is None and wanted != "text":
        raise NormswapError(
            f"{source} is a {model_type} model, which reads {wanted}, not text: pass --{wanted} PATH "
            f"(or --{wanted} bundled for the samples that ship with normswap)"
        )
    if given is not None and wanted != given:
        readers = ", ".join(sorted(t for t, each in ARCHITECTURES.items() if each.modality_of(t) == given))
        raise NormswapError(f"--{given} needs a model that reads {given} ({readers}); {source} is a "
                            f"{model_type} model, which reads {wanted}")


def _data_dir(name: str) -> Path:
    return Path(str(resources.files("normswap") / "data" / name))


@dataclass
class LabelledImage:
    name: str
    image: object  # PIL.Image.Image, RGB, or what read_images' prepare made of it
    label: str | None


@dataclass
class ImageSet:
    name: str
    images: list[LabelledImage] = field(default_factory=list)

    @property
    def labels(self) -> list[str] | None:
        """The sorted class names when every image has one, else None."""
        if not self.images or any(i.label is None for i in self.images):
            return None
        return sorted({i.label for i in self.images})  # type: ignore[misc]

    def describe(self) -> str:
        labels = self.labels
        classes = f", {count(len(labels), 'class')}" if labels else ""
        return f"{count(len(self.images), 'image')}{classes} of {self.name}"


def _image_files(spec: str) -> tuple[str, list[tuple[Path, str | None]]]:
    path = _data_dir("images") if spec == BUNDLED else Path(spec).expanduser()
    name = "the bundled images" if spec == BUNDLED else str(path)
    if not path.exists():
        raise NormswapError(f"image path not found: {spec}")
    if path.is_file():
        return name, [(path, None)]

    def images_in(folder: Path) -> list[Path]:
        return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)

    files: list[tuple[Path, str | None]] = [(p, None) for p in images_in(path)]
    for sub in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files += [(p, sub.name) for p in images_in(sub)]
    if not files:
        raise NormswapError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {path} or its class subfolders")
    return name, files


def check_images(spec: str) -> None:
    """Validate ``--images`` cheaply (paths) before any model is loaded."""
    _image_files(spec)


def read_images(spec: str, limit: int | None = None, prepare: Callable[[object], object] | None = None) -> ImageSet:
    """The images of ``spec`` (the first ``limit`` of them), with their class subfolder's name as label
    where they have one: each RGB, or what ``prepare`` makes of it at once (so that only one decoded
    image is held at a time). An image over ``MAX_IMAGE_PIXELS`` is refused from its header, before
    it is decoded; Pillow's decompression-bomb warning is that same one-line refusal."""
    Image = _needs("PIL.Image", "reading images", "Pillow")
    name, files = _image_files(spec)
    result = ImageSet(name)
    for file, label in files[:limit]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = _decoded(Image, file)
        except (OSError, Image.UnidentifiedImageError, ValueError, Image.DecompressionBombError,
                Image.DecompressionBombWarning) as error:
            # a decompression bomb (Pillow's pixel limit) is refused like any unreadable file
            raise NormswapError(f"cannot read image file {file}: {str(error).splitlines()[0]}") from None
        result.images.append(LabelledImage(file.stem, image if prepare is None else prepare(image), label))
    return result


def _needs(module: str, purpose: str, package: str) -> ModuleType:
    """``module``, from the eval extra; without it, one line saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise NormswapError(f"{purpose} needs {package}: pip install 'normswap[eval]'") from None


def _decoded(Image: ModuleType, file: Path) -> object:
    """``file`` as RGB, once its header's size is within ``MAX_IMAGE_PIXELS`` (Image.open is lazy)."""
    with Image.open(file) as handle:
        width, height = handle.size
        if width * height > MAX_IMAGE_PIXELS:
            raise NormswapError(f"image file {file} is {width}x{height} pixels, over the {MAX_IMAGE_PIXELS} "
                                "normswap reads; scale it down")
        return handle.convert("RGB")


def checkpoint_processor(path: Path, auto_class: str, input_kind: str, what: str):
    """The checkpoint's own processor (``preprocessor_config.json``) through transformers'
    ``auto_class``; a missing or malformed file is one line naming ``what`` it would have built."""
    import transformers

    if not (path / "preprocessor_config.json").is_file():
        raise NormswapError(f"{path} has no preprocessor_config.json: {input_kind} input needs the checkpoint's own "
                            f"{what}")
    try:
        return getattr(transformers, auto_class).from_pretrained(str(path))
    except Exception as error:  # a malformed processor file raises whatever its class raises
        raise NormswapError(f"cannot build the {what} of {path}: {str(error).splitlines()[0]}") from None
