"""The procedural world the embedded default image model was trained on: scenes, captions, drawings, scores, words.

One scene is a shape (SHAPES) in a colour on a background colour (COLOURS), of a size (SIZES) at a position
(POSITIONS), words of the served vocabulary (`stages.embedded.shapes`), drawn with PIL at 64x64. Captions say it in a few word
orders, e.g. "a large red circle on a blue background, left" or "a red circle, small, top, on a green background"; a
word left out means its default (large, centered, a white background), so "a red circle on a blue background" is a
large red circle in the middle. The word orders include the form the embedded LLM's rewrite appends
(`stages.embedded.llm`: ", <size>, <position>[, on a <colour> background]").

HELD_OUT (shape, colour, background) triples never appear in training: the semantic tests ask for them.
The tokenizer is CLIP's, with one token per word of this vocabulary (its merges spell each word whole),
so the text encoder learns words, not letters; any other text still tokenizes (letter by letter).
Nothing here runs in a replica: training (`training.shapes`, `training.shapes_lora`, `training.rewriter`), the
benchmarks and the tests draw and score with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import product

import numpy as np

from stages.embedded.diffusion import byte_level_vocab
from stages.embedded.shapes import (
    COLOURS,
    DEFAULT_BACKGROUND,
    DEFAULT_POSITION,
    DEFAULT_SIZE,
    POSITIONS,
    SHAPES,
    SIZES,
)

SIDE = 64
#: Shape radius in pixels per size word; the centre per position word.
RADIUS = {"small": 9, "large": 16}
CENTRE = {"left": (16, 32), "right": (48, 32), "top": (32, 16), "bottom": (32, 48), "centered": (32, 32)}
#: A pair (`Scene.pair`): two copies side by side, this radius whatever the size word. The base model never draws
#: two shapes; the trained LoRA adapter "twins" (`training.shapes_lora`) teaches it to.
PAIR_CENTRES, PAIR_RADIUS = ((17, 32), (47, 32)), 10

#: (shape, colour, background) never shown in training: every 10th triple, and the issue's own example.
_TRIPLES = [t for t in product(SHAPES, COLOURS, COLOURS) if t[1] != t[2]]
HELD_OUT = frozenset({("circle", "red", "blue"), *_TRIPLES[7::10]})

WORDS = ("a", "an", "on", "background", ",", *COLOURS, *SHAPES, *SIZES, *POSITIONS)


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str = DEFAULT_BACKGROUND
    size: str = DEFAULT_SIZE
    position: str = DEFAULT_POSITION
    pair: bool = False  # two copies side by side (PAIR_CENTRES) in place of one at its size and position

    def render(self) -> np.ndarray:
        """The scene as uint8 HxWx3."""
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (SIDE, SIDE), COLOURS[self.background])
        _draw(ImageDraw.Draw(image), self, COLOURS[self.colour])
        return np.asarray(image)

    def mask(self) -> np.ndarray:
        """Boolean HxW: where the shape is."""
        from PIL import Image, ImageDraw

        image = Image.new("L", (SIDE, SIDE), 0)
        _draw(ImageDraw.Draw(image), self, 255)
        return np.asarray(image) > 127

    def caption(self, rng: random.Random) -> str:
        """One of the captions that say this scene; defaults (large, centered, white) may be left unsaid."""
        size_at = rng.choice(("front", "tail", "unsaid") if self.size == DEFAULT_SIZE else ("front", "tail"))
        subject = with_article(f"{self.size + ' ' if size_at == 'front' else ''}{self.colour} {self.shape}")
        background_at = rng.choice(
            ("inline", "inline", "tail", "unsaid")
            if self.background == DEFAULT_BACKGROUND
            else ("inline", "inline", "tail")
        )
        phrase = background_phrase(self.background)
        tail = [self.size] if size_at == "tail" else []
        if self.position != DEFAULT_POSITION or rng.random() < 0.5:
            tail.append(self.position)
        if background_at == "tail":
            tail.append(phrase)
        head = f"{subject} {phrase}" if background_at == "inline" else subject
        return ", ".join([head, *tail])


def _draw(draw, scene: Scene, fill) -> None:
    if scene.pair:
        for centre in PAIR_CENTRES:
            _draw_at(draw, scene.shape, centre, PAIR_RADIUS, fill)
    else:
        _draw_at(draw, scene.shape, CENTRE[scene.position], RADIUS[scene.size], fill)


def _draw_at(draw, shape: str, centre: tuple[int, int], r: float, fill) -> None:
    x, y = centre
    box = (x - r, y - r, x + r, y + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle((x - r * 0.85, y - r * 0.85, x + r * 0.85, y + r * 0.85), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x, y - r), (x + r, y + r * 0.8), (x - r, y + r * 0.8)], fill=fill)
    elif shape == "star":
        points = [
            (
                x + (r if k % 2 == 0 else r * 0.45) * np.sin(k * np.pi / 5),
                y - (r if k % 2 == 0 else r * 0.45) * np.cos(k * np.pi / 5),
            )
            for k in range(10)
        ]
        draw.polygon(points, fill=fill)
    else:  # ring: the hole shows the background
        draw.ellipse(box, outline=fill, width=round(r * 0.5))


def training_scenes() -> list[Scene]:
    """Every scene the model is trained on: all sizes and positions of every triple not held out."""
    return [
        Scene(s, c, b, size, pos)
        for (s, c, b) in _TRIPLES
        if (s, c, b) not in HELD_OUT
        for size in SIZES
        for pos in POSITIONS
    ]


def with_article(words: str) -> str:
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}"


def background_phrase(colour: str) -> str:
    return f"on {with_article(colour)} background"


def nearest_colour(pixels: np.ndarray) -> np.ndarray:
    """The index into COLOURS of each pixel's nearest named colour (pixels: ...x3, uint8 or 0..255)."""
    palette = np.array(list(COLOURS.values()), dtype=np.float32)
    distance = ((pixels[..., None, :].astype(np.float32) - palette) ** 2).sum(-1)
    return distance.argmin(-1)


def colour_share(image: np.ndarray, region: np.ndarray, colour: str) -> float:
    """The fraction of `region`'s pixels whose nearest named colour is `colour`."""
    index = list(COLOURS).index(colour)
    return float((nearest_colour(image[region]) == index).mean())


#: The border ring `drawn_as_said` reads the background from, and the fewest pixels that make a drawn shape.
BORDER, MIN_DRAWN = 6, 20
#: Prompt length in tokens: captions take 8-16; a known word is one token, an unknown one a token per letter.
MAX_PROMPT_TOKENS = 32


def inner(region: np.ndarray, margin: int = 2) -> np.ndarray:
    """`region` without its `margin`-pixel rim (edges blur in any drawing): a plain binary erosion."""
    kept = region.copy()
    for axis in (0, 1):
        for shift in range(1, margin + 1):
            for sign in (1, -1):
                kept &= np.roll(region, sign * shift, axis=axis)
    return kept


def background_as_said(image: np.ndarray, background: str, share: float = 0.5) -> bool:
    """Whether most of `image`'s border ring (BORDER pixels wide) is nearest to `background`."""
    border = np.ones(image.shape[:2], bool)
    border[BORDER:-BORDER, BORDER:-BORDER] = False
    return colour_share(image, border, background) >= share


def drawn_as_said(image: np.ndarray, scene: Scene, share: float = 0.5) -> bool:
    """Whether `image` has `scene`'s background (`background_as_said`) and most of what is drawn on it (the pixels
    not nearest to the background) is its shape's colour. Where the shape is does not count (`drawn_area`,
    `centroid` read size and place)."""
    drawn = nearest_colour(image) != list(COLOURS).index(scene.background)
    return (
        background_as_said(image, scene.background, share)
        and drawn.sum() >= MIN_DRAWN
        and colour_share(image, drawn, scene.colour) >= share
    )


def drawn_area(image: np.ndarray, background: str) -> int:
    """How many pixels are not nearest to `background`."""
    return int((nearest_colour(image) != list(COLOURS).index(background)).sum())


def components(region: np.ndarray, min_size: int = MIN_DRAWN) -> list[int]:
    """The sizes of `region`'s 4-connected parts of at least `min_size` pixels, largest first (how many shapes are
    drawn: `drawn_as_said` reads colours only)."""
    seen = np.zeros_like(region, dtype=bool)
    sizes = []
    for start in zip(*np.nonzero(region), strict=True):
        if seen[start]:
            continue
        seen[start], stack, size = True, [start], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for v, u in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= v < region.shape[0] and 0 <= u < region.shape[1] and region[v, u] and not seen[v, u]:
                    seen[v, u] = True
                    stack.append((v, u))
        sizes.append(size)
    return sorted((s for s in sizes if s >= min_size), reverse=True)


def drawn_twice(image: np.ndarray, scene: Scene) -> bool:
    """Whether `image` has `scene`'s background and two or more separate parts (`components`) in its shape's colour."""
    region = nearest_colour(image) == list(COLOURS).index(scene.colour)
    return background_as_said(image, scene.background) and len(components(region)) >= 2


def centroid(image: np.ndarray, background: str) -> tuple[float, float]:
    """(x, y) of what is drawn on `background`: the pixels not nearest to it; the image centre when there are none."""
    ys, xs = np.nonzero(nearest_colour(image) != list(COLOURS).index(background))
    return (float(xs.mean()), float(ys.mean())) if len(xs) else (SIDE / 2, SIDE / 2)


def word_tokenizer(max_length: int = MAX_PROMPT_TOKENS):
    """CLIP's tokenizer with a vocabulary of single characters plus WORDS, each word one token."""
    from transformers import CLIPTokenizer

    vocab = dict(byte_level_vocab())
    ranks: dict[tuple[str, str], int] = {}
    for word in sorted(set(WORDS) - {",", "a"}):
        pieces = _bpe([*word[:-1], word[-1] + "</w>"], ranks)
        while len(pieces) > 1:  # spell what the earlier merges left of the word, left to right
            ranks.setdefault((pieces[0], pieces[1]), len(ranks))  # appended last: earlier words stay whole
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
            vocab.setdefault(pieces[0], len(vocab))
    # tokenizers' BPE takes the merges as (a, b) pairs; transformers annotates them as strings.
    return CLIPTokenizer(vocab=vocab, merges=list(ranks), model_max_length=max_length)


def _bpe(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair encoding as CLIP's tokenizer applies it: the best-ranked adjacent pair first, until none."""
    while len(pieces) > 1:
        pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:], strict=False))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        pieces = [*pieces[:i], pieces[i] + pieces[i + 1], *pieces[i + 2 :]]
    return pieces
