"""Draw the bundled images in ``normswap/data/images/`` with Pillow.

Three classes in class subfolders (the layout ``--images`` reads labels from): a red circle, a
blue square and a green triangle, two 64×64 PNGs each with different positions, sizes and
backgrounds. They are generated here, so they carry no third-party rights; run once, the output is
committed.

    python scripts/make_image_samples.py [--out normswap/data/images]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 64
SHAPES = {"circle": (200, 40, 40), "square": (40, 70, 200), "triangle": (40, 160, 60)}


def draw(shape: str, colour: tuple[int, int, int], rng: random.Random) -> Image.Image:
    background = tuple(rng.randint(200, 250) for _ in range(3))
    image = Image.new("RGB", (SIZE, SIZE), background)
    pen = ImageDraw.Draw(image)
    half = rng.randint(14, 22)
    cx, cy = rng.randint(half + 2, SIZE - half - 2), rng.randint(half + 2, SIZE - half - 2)
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    elif shape == "square":
        pen.rectangle(box, fill=colour)
    else:
        pen.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=colour)
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "normswap" / "data" / "images")
    args = parser.parse_args()
    rng = random.Random(0)
    for shape, colour in SHAPES.items():
        folder = args.out / shape
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(2):
            path = folder / f"{shape}-{index + 1}.png"
            draw(shape, colour, rng).save(path, optimize=True)
            print(path)


if __name__ == "__main__":
    main()
