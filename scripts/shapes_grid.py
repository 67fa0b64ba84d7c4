"""Draw the picture grid of docs/models.md: what the embedded default image model draws for a few prompts.

    .venv/bin/python scripts/shapes_grid.py             # writes docs/images/embedded-default-grid.png

Each cell is the stage's default render (64x64, 8 steps, guidance 5, seed 0) of the prompt printed under it,
through the same loader as the diffusion stage (`stages.diffusion.load_pipeline`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = (
    "a red circle on a blue background",
    "a yellow star on a purple background",
    "a small green square on a white background, left",
    "a large orange triangle on a black background",
    "a cyan ring on a red background, small, top",
    "a pink circle, small, bottom, on a green background",
    "a white star on a blue background, right",
    "a black square on a yellow background",
    "a blue triangle on an orange background, small, right",
    "a purple ring on a cyan background",
    "a red fox in the snow",
    "a red fox in the snow, small, on a green background",
)
CELL, LABEL, COLUMNS = 128, 40, 4


def main() -> None:
    import numpy as np
    from PIL import Image, ImageDraw

    from stages.diffusion import load_pipeline
    from stages.embedded import DEFAULT_MODELS
    from training.shapes import draw

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "embedded-default-grid.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pipe = load_pipeline(DEFAULT_MODELS["diffusion"], device="cpu", dtype="float32")
    images = draw(pipe, list(PROMPTS), [args.seed] * len(PROMPTS))
    rows = -(-len(PROMPTS) // COLUMNS)
    grid = Image.new("RGB", (COLUMNS * CELL, rows * (CELL + LABEL)), "white")
    pen = ImageDraw.Draw(grid)
    for i, (prompt, image) in enumerate(zip(PROMPTS, images, strict=True)):
        x, y = (i % COLUMNS) * CELL, (i // COLUMNS) * (CELL + LABEL)
        grid.paste(Image.fromarray(np.asarray(image)).resize((CELL, CELL), Image.Resampling.NEAREST), (x, y))
        for line, text in enumerate(textwrap.wrap(prompt, width=22)):
            pen.text((x + 2, y + CELL + 2 + 12 * line), text, fill="black")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(args.out, optimize=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
