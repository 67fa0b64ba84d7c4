"""The words the embedded default image model knows: its shapes, colours, sizes and positions.

The model (`omniserve/tiny-shapes-sd`) was trained on a procedural world of these words (`training.scenes`: one
shape in a colour on a background colour, of a size at a position, and the captions that say it). A word left out of
a caption means its default (large, centered, a white background). The LLM stage reads SIZES and POSITIONS: the
embedded rewrite's grammar appends ", <size>, <position>" (`stages.embedded.llm`), words the image model draws.
"""

from __future__ import annotations

#: Named colours, chosen far apart in RGB so a pixel's nearest name is unambiguous.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "purple": (130, 40, 170),
    "orange": (250, 140, 20),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "pink": (250, 140, 200),
    "cyan": (40, 210, 220),
}
SHAPES = ("circle", "square", "triangle", "star", "ring")
SIZES = ("small", "large")
POSITIONS = ("left", "right", "top", "bottom", "centered")
DEFAULT_SIZE, DEFAULT_POSITION, DEFAULT_BACKGROUND = "large", "centered", "white"
