"""Synthesise the bundled speech samples in ``normswap/data/speech/`` with espeak-ng.

Short sentences from Jane Austen's novels (public domain) are spoken by espeak-ng, resampled to
16 kHz mono and written as 16-bit FLAC beside a same-stem ``.txt`` transcript, the layout
``normswap eval --audio`` and ``normswap geometry --audio`` read. Run once; the output is committed.

    apt-get install espeak-ng
    python scripts/make_speech_samples.py [--out normswap/data/speech]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from math import gcd
from pathlib import Path

import numpy as np
import soundfile
from scipy.signal import resample_poly

RATE = 16_000
# (stem, sentence, voice): public-domain text, two voices for some variety.
SENTENCES = [
    ("emma-01", "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty one years in the world.", "en-gb"),
    ("persuasion-01", "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who never took up any book.", "en-us"),
    ("pride-01", "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                 "must be in want of a wife.", "en-gb"),
    ("sense-01", "The family of Dashwood had long been settled in Sussex.", "en-us"),
    ("northanger-01", "No one who had ever seen Catherine Morland in her infancy would have supposed her born "
                      "to be an heroine.", "en-gb"),
    ("mansfield-01", "About thirty years ago, Miss Maria Ward had the good luck to captivate Sir Thomas Bertram.",
     "en-us"),
]


def synthesise(text: str, voice: str, wav: Path) -> np.ndarray:
    subprocess.run(["espeak-ng", "-v", voice, "-s", "165", "-w", str(wav), text], check=True)
    audio, rate = soundfile.read(wav, dtype="float64")
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    common = gcd(rate, RATE)
    audio = resample_poly(audio, RATE // common, rate // common)
    return np.clip(audio, -1.0, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "normswap" / "data" / "speech")
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install espeak-ng)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for stem, text, voice in SENTENCES:
            audio = synthesise(text, voice, Path(tmp) / f"{stem}.wav")
            soundfile.write(args.out / f"{stem}.flac", audio, RATE, subtype="PCM_16")
            (args.out / f"{stem}.txt").write_text(text + "\n", encoding="utf-8")
            print(f"{stem}: {len(audio) / RATE:.2f} s")


if __name__ == "__main__":
    main()
