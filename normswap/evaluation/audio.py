"""Transcribed audio for speech models (``--audio``, and Whisper's ``--calibration``).

``PATH`` is a folder of audio files, each with a same-stem ``.txt`` transcript, or a JSONL manifest
whose lines are ``{"audio": FILE, "text": TRANSCRIPT}`` (files named relative to the manifest's
folder), or ``bundled`` for the short English utterances that ship with normswap. Every file read
is a regular file inside that folder once links are resolved; the manifest, the transcripts and
the number of utterances are bounded. Audio is read with ``soundfile`` (WAV, FLAC, OGG, MP3 where
libsndfile supports it) after its header is checked (a sample rate in ``SAMPLING_RATES``), only
as far as the reader uses it (Whisper: the first 30 s), mixed down to mono block by block and
resampled to the rate the checkpoint's feature extractor expects.

Every problem is one ``NormswapError`` line.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path

from normswap.checkpoint.bounded import parse_json, read_text_file
from normswap.checkpoint.files import inside_file
from normswap.checkpoint.side_files import SAMPLING_RATES
from normswap.errors import NormswapError, first_line
from normswap.evaluation.media import BUNDLED, _data_dir, _needs
from normswap.text import count

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".mp3", ".aiff", ".aif")
MAX_SECONDS = 30.0  # of each clip decoded when the reader names no length: Whisper reads 30 s
MAX_UTTERANCES = 4096  # in one folder or manifest (eval holds every utterance's features at once)
MAX_MANIFEST_CHARS = 16 << 20
MAX_TRANSCRIPT_CHARS = 20_000  # thousands of words: far past the tokens a speech decoder reads


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
    """(description, [(audio file, transcript)]) for a folder or manifest; validated, not yet
    decoded. Every file lies inside the folder (the manifest's folder) once links are resolved and
    is a regular file; transcripts and the manifest are read within bounds."""
    path = _data_dir("speech") if spec == BUNDLED else Path(spec).expanduser()
    name = "the bundled speech samples" if spec == BUNDLED else str(path)
    if not os.path.lexists(path):
        raise NormswapError(f"audio path not found: {spec}")
    if path.is_dir():
        candidates = sorted(p for p in path.iterdir() if p.suffix.lower() in AUDIO_SUFFIXES and not p.is_dir())
        if not candidates:
            raise NormswapError(f"no audio files ({', '.join(AUDIO_SUFFIXES)}) in {path}")
        _count_utterances(len(candidates), path)
        pairs = []
        for file in candidates:
            _inside(path, file.name)
            transcript = file.with_suffix(".txt")
            if _inside(path, transcript.name, missing_ok=True) is None:
                raise NormswapError(f"transcript missing for {file} (expected {transcript.name} beside it)")
            pairs.append((file, _read_transcript(transcript)))
        return name, pairs
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise NormswapError(f"audio path {path} is neither a folder nor a regular file (a JSONL manifest)")
    return name, _manifest(path)


def _inside(folder: Path, name: str, *, missing_ok: bool = False) -> Path | None:
    """``folder / name`` as a regular file inside ``folder`` once links are resolved; one line otherwise."""
    real = inside_file(folder, name, [Path(os.path.realpath(folder))], within=f"the audio folder {folder}")
    if real is None and not missing_ok:
        raise NormswapError(f"audio file not found: {folder / name}")
    return real


def _count_utterances(utterances: int, where: Path) -> None:
    if utterances > MAX_UTTERANCES:
        raise NormswapError(f"{where} holds more than {MAX_UTTERANCES} utterances; evaluate or calibrate on at most "
                            f"{MAX_UTTERANCES} at a time")


def _read_transcript(path: Path) -> str:
    return _transcript(read_text_file(path, "transcript", max_chars=MAX_TRANSCRIPT_CHARS + 1), str(path))


def _transcript(text: str, where: str) -> str:
    """``text`` with its white space collapsed; one line when it is empty, too long or not valid Unicode."""
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise NormswapError(f"transcript {where} is longer than {MAX_TRANSCRIPT_CHARS} characters; one utterance's "
                            f"transcript is far shorter (Whisper's decoder reads at most a few hundred tokens)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise NormswapError(f"transcript {where} is not valid Unicode ({error.reason} at character {error.start})") from None
    if not text.strip():
        raise NormswapError(f"transcript {where} is empty")
    return " ".join(text.split())


def _manifest(path: Path) -> list[tuple[Path, str]]:
    text = read_text_file(path, "audio manifest", max_chars=MAX_MANIFEST_CHARS + 1)
    if len(text) > MAX_MANIFEST_CHARS:
        raise NormswapError(f"audio manifest {path} is larger than {MAX_MANIFEST_CHARS >> 20} MiB; an audio manifest "
                            f"lists at most {MAX_UTTERANCES} utterances")
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"audio manifest {path} line {number}"
        try:
            entry = parse_json(line, where, mapping=False)
        except NormswapError as error:
            raise NormswapError(f'{error}; expected {{"audio": FILE, "text": TRANSCRIPT}} per line') from None
        if not isinstance(entry, dict) or not isinstance(entry.get("audio"), str) or not isinstance(entry.get("text"), str):
            raise NormswapError(f'{where} needs string fields "audio" and "text"')
        _count_utterances(len(pairs) + 1, path)
        text_of = _transcript(entry["text"], f"on {where}")
        try:
            _inside(path.parent, entry["audio"])
        except NormswapError as error:
            raise NormswapError(f"{where}: {error}") from None
        pairs.append((path.parent / entry["audio"], text_of))
    if not pairs:
        raise NormswapError(f"audio manifest {path} lists no utterances")
    return pairs


def check_audio(spec: str) -> None:
    """Validate ``--audio`` cheaply (paths and transcripts) before any model is loaded."""
    _audio_pairs(spec)


def transcripts(spec: str) -> list[str]:
    """The transcripts of ``spec``'s utterances, in order, without decoding any audio."""
    return [text for _, text in _audio_pairs(spec)[1]]


def read_audio(spec: str, rate: int, max_seconds: float = MAX_SECONDS, first: int | None = None) -> AudioSet:
    """The ``first`` (default every) utterances of ``spec``, mono float32 resampled to
    ``rate`` Hz, each cut to its first ``max_seconds``: no more is decoded."""
    import numpy as np

    name, pairs = _audio_pairs(spec)
    result = AudioSet(name)
    for file, text in pairs[:first]:
        audio, file_rate = _decode(file, max_seconds)
        audio = resample(audio, file_rate, rate)[: int(max_seconds * rate)]
        result.utterances.append(Utterance(file.stem, np.ascontiguousarray(audio), rate, text))
    return result


def _decode(file: Path, max_seconds: float):
    """(mono float32 samples, rate) of the first ``max_seconds`` of ``file`` (and a tenth of a
    second more for the resampler's filter), read block by block after its header is checked."""
    import numpy as np

    soundfile = _needs("soundfile", "reading audio", "soundfile")
    low, high = SAMPLING_RATES
    blocks = []
    with _captured_stderr() as noise:  # libsndfile's decoders (mpg123) print notes on the C stream
        try:
            with soundfile.SoundFile(str(file)) as handle:
                rate, channels = handle.samplerate, handle.channels
                if not low <= rate <= high:
                    raise NormswapError(f"audio file {file} declares a sample rate of {rate} Hz; normswap reads "
                                        f"{low} to {high} Hz")
                left, step = int(max_seconds * rate + rate // 10), max(1, (1 << 20) // channels)
                while left > 0 and len(block := handle.read(min(step, left), dtype="float32", always_2d=True)):
                    blocks.append(block.mean(axis=1))
                    left -= len(block)
        except NormswapError:
            raise
        except Exception as error:  # libsndfile reports every unreadable format as its own error type
            raise NormswapError(f"cannot read audio file {file}: {_decode_reason(error, noise())}") from None
    audio = np.concatenate(blocks) if blocks else np.zeros(0, dtype="float32")
    if audio.size == 0:
        raise NormswapError(f"audio file {file} holds no samples")
    if not np.isfinite(audio).all():
        raise NormswapError(f"audio file {file} holds non-finite samples (NaN or infinity)")
    return audio, rate


@contextmanager
def _captured_stderr():
    """The process's stderr (file descriptor 2, where C libraries write) sent to a temporary file
    for the block; yields a function that returns the start of what was written there."""

    sys.stderr.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: os.pread(sink.fileno(), 4096, 0).decode("utf-8", "replace")
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _decode_reason(error: Exception, noise: str) -> str:
    reason = first_line(error) if str(error).strip() else type(error).__name__
    if "does not exist" in reason:  # libsndfile's words for every file it cannot open; this one exists
        reason = "not audio that libsndfile can decode"
    detail = next((line.strip() for line in noise.splitlines() if line.strip()), "")
    return f"{reason} ({detail})" if detail else reason


def resample(audio, rate_in: int, rate_out: int):
    """``audio`` resampled from ``rate_in`` to ``rate_out`` Hz (polyphase filter, scipy)."""
    if rate_in == rate_out:
        return audio

    signal = _needs("scipy.signal", "resampling audio", "scipy")
    common = gcd(int(rate_in), int(rate_out))
    return signal.resample_poly(audio, rate_out // common, rate_in // common).astype("float32")
