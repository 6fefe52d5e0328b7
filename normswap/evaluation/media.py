"""Audio and image inputs for speech and vision models: reading, validation, and which model takes which.

``--audio PATH`` is a folder of audio files, each with a same-stem ``.txt`` transcript, or a JSONL
manifest whose lines are ``{"audio": FILE, "text": TRANSCRIPT}`` (relative files are read from the
manifest's folder), or ``bundled`` for the short English utterances that ship with normswap.
Audio is read with ``soundfile`` (WAV, FLAC, OGG, MP3 where libsndfile supports it), mixed down to
mono and resampled to the rate the checkpoint's feature extractor expects.

``--images PATH`` is an image file, or a folder of images, or a folder of class subfolders whose
names are the labels, or ``bundled``. Images are read with Pillow and converted to RGB.

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

from normswap.checkpoint.bounded import parse_json
from normswap.checkpoint.provenance import original_model_type
from normswap.errors import NormswapError
from normswap.text import count

BUNDLED = "bundled"
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".mp3", ".aiff", ".aif")
# the most pixels one image may hold (about 33 M: a 24-megapixel photograph fits); each is decoded whole
MAX_IMAGE_PIXELS = 1 << 25
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")

# model type -> the input it takes; everything else reads text.
MODALITIES = {"whisper": "audio", "vit": "images", "clip": "images", "deit": "images", "dinov2": "images",
              "beit": "images"}


def modality(config: dict) -> str:
    """``audio``, ``images`` or ``text``: what a checkpoint (original or converted) reads."""
    model_type = original_model_type(config)
    return MODALITIES.get(str(model_type), "text")


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
        readers = ", ".join(sorted(t for t, m in MODALITIES.items() if m == given))
        raise NormswapError(f"--{given} needs a model that reads {given} ({readers}); {source} is a "
                            f"{model_type} model, which reads {wanted}")


def _data_dir(name: str) -> Path:
    return Path(str(resources.files("normswap") / "data" / name))


@dataclass
class Utterance:
    """One audio file, mono float32 at ``rate`` Hz, and its transcript."""

    name: str
    audio: object  # numpy array [samples]
    rate: int
    text: str

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.rate  # type: ignore[arg-type]


@dataclass
class AudioSet:
    name: str
    utterances: list[Utterance] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(u.seconds for u in self.utterances)

    def describe(self) -> str:
        return f"{count(len(self.utterances), 'utterance')} ({self.seconds:.1f} s) of {self.name}"


def _audio_pairs(spec: str) -> tuple[str, list[tuple[Path, str]]]:
    """(description, [(audio file, transcript)]) for a folder or manifest; validated, not yet read."""
    path = _data_dir("speech") if spec == BUNDLED else Path(spec).expanduser()
    name = "the bundled speech samples" if spec == BUNDLED else str(path)
    if not path.exists():
        raise NormswapError(f"audio path not found: {spec}")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)
        if not files:
            raise NormswapError(f"no audio files ({', '.join(AUDIO_SUFFIXES)}) in {path}")
        pairs = []
        for file in files:
            transcript = file.with_suffix(".txt")
            if not transcript.is_file():
                raise NormswapError(f"transcript missing for {file} (expected {transcript.name} beside it)")
            pairs.append((file, _read_transcript(transcript)))
        return name, pairs
    return name, _manifest(path)


def _read_transcript(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise NormswapError(f"cannot read transcript {path}: {error}") from None
    if not text:
        raise NormswapError(f"transcript {path} is empty")
    return " ".join(text.split())


def _manifest(path: Path) -> list[tuple[Path, str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise NormswapError(f"cannot read audio manifest {path}: {error}") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = parse_json(line, f"audio manifest {path} line {number}", mapping=False)
        except NormswapError as error:
            raise NormswapError(f'{error}; expected {{"audio": FILE, "text": TRANSCRIPT}} per line') from None
        if not isinstance(entry, dict) or not isinstance(entry.get("audio"), str) or not isinstance(entry.get("text"), str):
            raise NormswapError(f'audio manifest {path} line {number} needs string fields "audio" and "text"')
        if not entry["text"].strip():
            raise NormswapError(f"audio manifest {path} line {number} has an empty transcript")
        file = Path(entry["audio"]).expanduser()
        file = file if file.is_absolute() else path.parent / file
        if not file.is_file():
            raise NormswapError(f"audio manifest {path} line {number}: audio file not found: {file}")
        pairs.append((file, " ".join(entry["text"].split())))
    if not pairs:
        raise NormswapError(f"audio manifest {path} lists no utterances")
    return pairs


def _needs(module: str, purpose: str, package: str) -> ModuleType:
    """``module``, from the eval extra; without it, one line saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise NormswapError(f"{purpose} needs {package}: pip install 'normswap[eval]'") from None


def check_audio(spec: str) -> None:
    """Validate ``--audio`` cheaply (paths and transcripts) before any model is loaded."""
    _audio_pairs(spec)


def read_audio(spec: str, rate: int) -> AudioSet:
    """Every utterance of ``spec``, mono float32 resampled to ``rate`` Hz."""
    import numpy as np

    soundfile = _needs("soundfile", "reading audio", "soundfile")
    name, pairs = _audio_pairs(spec)
    result = AudioSet(name)
    for file, text in pairs:
        try:
            audio, file_rate = soundfile.read(str(file), dtype="float32", always_2d=True)
        except Exception as error:  # libsndfile reports every unreadable format as its own error type
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise NormswapError(f"cannot read audio file {file}: {reason}") from None
        audio = audio.mean(axis=1)
        if audio.size == 0:
            raise NormswapError(f"audio file {file} holds no samples")
        result.utterances.append(Utterance(file.stem, np.ascontiguousarray(resample(audio, file_rate, rate)), rate, text))
    return result


def resample(audio, rate_in: int, rate_out: int):
    """``audio`` resampled from ``rate_in`` to ``rate_out`` Hz (polyphase filter, scipy)."""
    if rate_in == rate_out:
        return audio
    from math import gcd

    signal = _needs("scipy.signal", "resampling audio", "scipy")
    common = gcd(int(rate_in), int(rate_out))
    return signal.resample_poly(audio, rate_out // common, rate_in // common).astype("float32")


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
