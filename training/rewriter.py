"""Training the embedded rewriter: a tiny Llama that rewrites free image prompts into the shapes model's captions.

The image model (`stages.embedded.shapes`, `tiny-shapes-sd`) draws one shape (SHAPES) of one colour (COLOURS) on a
background colour, small or large, at a position. This model learns to say any free prompt in exactly those words,
in one canonical form: "a <size> <colour> <shape> on a/an <background> background, <position>" (`rewrite_rule`):

  * the shape: a shape word of the prompt is kept; a subject noun maps to a shape (SUBJECT_SHAPES: ball, sun, apple
    -> circle; box, house, book -> square; mountain, tent, roof -> triangle; starfish, sparkle -> star; donut, tire,
    bagel -> ring); any other subject (a fox, a cat, a word never seen) -> circle. The subject is the first noun the
    rules know in the prompt's first phrase, else that phrase's last word (the corpus has made-up words there, so
    the model learns that too);
  * the colour: a colour word the prompt gives its subject is kept; else the subject's usual colour (USUAL_COLOURS:
    fox -> orange, apple -> red, sun -> yellow, leaf -> green, ...), else DEFAULT_COLOUR;
  * the background: a colour word on a background noun after the subject ("on a pink background", "against a cyan
    wall", "under a purple sky") is kept; else the first scene word maps to one (SCENES: snow, fog, paper -> white;
    night, dark, space -> black; sky, sea, underwater -> blue; grass, forest, meadow -> green; desert, sunset, autumn
    -> orange; ...); none, or a place of no colour ("in the city") -> white. The image model cannot draw a shape on its own colour: then white, or black for a
    white shape;
  * the size: tiny, small, little -> small; big, huge, large, giant -> large; none -> large;
  * the position: left, right, top, bottom; middle, center, centered -> centered; none -> centered.

It answers chat too, in plain English of its training corpus (`chat_examples`): greetings, what it can draw, who it
is, help, thanks, its colours and shapes; anything else gets a polite "I can only help with pictures".

The architecture is the embedded default's (`stages.embedded.llm.TINY`: LlamaForCausalLM, hidden 512, 2 layers), its
special tokens and chat template too; the byte-level BPE tokenizer is trained on this corpus, so every word the model
writes is one token and any text still encodes. A rewrite is sent as the LLM stage sends it, with no system message:
"<|begin_of_text|><|user|>{prompt}<|end|><|assistant|>" and the model answers "{caption}<|end|>" (generation stops on
<|end|>: generation_config's eos_token_id lists it with <|end_of_text|>, the tokenizer's and config's EOS as in
`stages.embedded.llm`). The loss is on the answers only.

HELD_OUT_PROMPTS (prompt, expected caption) are never in training, nor is any prompt with the same subject, colour
and scene as one of them. Training is seeded and runs on two threads (RewriterPlan.threads) with deterministic
algorithms: the same plan, library versions and CPU kind give the same weights, in about 500 s on this project's
2-core machine. Weights are saved in bfloat16 (14 MB; greedy answers measured the same loaded in float32 and in
bfloat16, by transformers and by vLLM). The trained directory is committed with its record (training.json: plan,
corpus size and sha256, loss curve, wall time, versions, CPU, weights sha256, the held-out evaluation):

    .venv/bin/python -m training.rewriter            # train, evaluate, write REWRITER_PATH
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from stages.embedded.llm import (
    BOS,
    REWRITER_PATH,
    TINY,
    byte_level_tokenizer,
    weights_fingerprint,
)
from stages.embedded.shapes import COLOURS, POSITIONS, SHAPES, SIZES
from training.scenes import Scene, with_article

#: Where the committed, trained model lives.
RECORD = "training.json"
END = "<|end|>"  # ends every message (CHAT_TEMPLATE); the model's answer too, and generation stops on it
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")

# --- the rules: free prompt -> caption ---------------------------------------------------------

SUBJECT_SHAPES: dict[str, str] = {
    **dict.fromkeys(("circle", "ball", "sun", "moon", "apple", "coin", "wheel", "planet", "plate"), "circle"),
    **dict.fromkeys(("button", "bubble", "clock", "cookie", "dot", "pearl"), "circle"),
    **dict.fromkeys(("square", "box", "window", "house", "tile", "book", "crate", "gift", "cube"), "square"),
    **dict.fromkeys(("envelope", "door"), "square"),
    **dict.fromkeys(("triangle", "mountain", "pyramid", "tent", "roof", "slice", "sail", "cone"), "triangle"),
    **dict.fromkeys(("star", "starfish", "sparkle", "snowflake", "firework"), "star"),
    **dict.fromkeys(("ring", "donut", "hoop", "tire", "wreath", "bagel", "halo", "bracelet"), "ring"),
}
#: A subject's colour when the prompt gives it none.
USUAL_COLOURS: dict[str, str] = {
    **dict.fromkeys(("fox", "starfish", "pumpkin", "carrot", "tiger"), "orange"),
    **dict.fromkeys(("apple", "cherry", "tomato", "strawberry", "rose", "roof", "gift", "ladybug"), "red"),
    **dict.fromkeys(("sun", "banana", "lemon", "coin", "duck", "pyramid", "star", "sparkle", "bee"), "yellow"),
    **dict.fromkeys(("frog", "leaf", "tree", "wreath", "cactus", "turtle"), "green"),
    **dict.fromkeys(("whale", "planet", "dolphin"), "blue"),
    **dict.fromkeys(("moon", "snowflake", "swan", "pearl", "cloud", "ghost", "egg"), "white"),
    **dict.fromkeys(("crow", "tire", "wheel", "cat", "bat"), "black"),
    **dict.fromkeys(("pig", "flamingo", "donut"), "pink"),
    **dict.fromkeys(("grape", "plum", "eggplant"), "purple"),
}
#: Subjects the rules know no shape for (-> circle); the corpus uses them so the model learns that rule.
OTHER_SUBJECTS = (
    *("fox", "cat", "dog", "bird", "fish", "frog", "owl", "bear", "whale", "duck", "pig", "flamingo", "crow", "swan"),
    *("bee", "lemon", "banana", "cherry", "tomato", "strawberry", "grape", "plum", "leaf", "tree", "rose", "flower"),
    *("balloon", "car", "boat", "robot", "dragon", "kite", "umbrella", "lamp", "cup", "hat", "pumpkin", "carrot"),
    *("tiger", "ladybug", "cactus", "turtle", "dolphin", "cloud", "ghost", "egg", "bat", "eggplant", "horse"),
)
DEFAULT_COLOUR = "red"
#: Scene words -> the background colour they mean.
SCENES: dict[str, str] = {
    **dict.fromkeys(("snow", "fog", "mist", "paper", "winter"), "white"),
    **dict.fromkeys(("night", "dark", "space", "darkness", "cave"), "black"),
    **dict.fromkeys(("sky", "ocean", "sea", "underwater", "water", "lake", "river", "rain"), "blue"),
    **dict.fromkeys(("grass", "forest", "meadow", "field", "jungle", "garden", "park"), "green"),
    **dict.fromkeys(("desert", "sunset", "autumn", "dusk"), "orange"),
    **dict.fromkeys(("beach", "sand"), "yellow"),
    **dict.fromkeys(("lava", "fire"), "red"),
    **dict.fromkeys(("ice", "lagoon"), "cyan"),
    "lavender": "purple",
}
#: Nouns that take a colour word as the background without a colour of their own.
BACKDROPS = ("background", "backdrop", "wall")
SIZE_WORDS = {
    **dict.fromkeys(("tiny", "small", "little"), "small"),
    **dict.fromkeys(("big", "huge", "large", "giant", "enormous"), "large"),
}
POSITION_WORDS = {
    **{p: p for p in POSITIONS},
    **dict.fromkeys(("middle", "center", "centre"), "centered"),
}
#: Words that end the subject's noun phrase (to find a subject the rules do not know).
_PHRASE_ENDS = frozenset(
    (
        "in",
        "on",
        "at",
        "to",
        "under",
        "by",
        "against",
        "with",
        "near",
        "floating",
        "flying",
        ",",
        *POSITION_WORDS,
        *SCENES,
    )
)


@dataclass(frozen=True)
class Parsed:
    """What a prompt says, word for word (None: unsaid); `rewrite_rule` turns it into a caption."""

    subject: str
    colour: str | None
    scene: str | None  # the first background noun after the subject
    background: str | None  # the colour word on that noun, or None
    size: str | None
    position: str | None


def words_of(text: str) -> list[str]:
    return re.findall(r"[a-z]+|,", text.lower())


def parse(prompt: str) -> Parsed:
    """The prompt's subject (the first known noun of its first phrase, else that phrase's last word), the colour word
    before it (size words may come between), the first background word after it, and any size and position words."""
    words = words_of(prompt)
    end = next((i for i, w in enumerate(words) if w in _PHRASE_ENDS and i > 0), len(words))
    known = [i for i, w in enumerate(words[:end]) if w in SUBJECT_SHAPES or w in USUAL_COLOURS or w in OTHER_SUBJECTS]
    at = known[0] if known else end - 1
    before = [w for w in reversed(words[max(at - 3, 0) : at]) if w not in SIZE_WORDS]
    colour = before[0] if before and before[0] in COLOURS else None
    scene = background = None
    for i in range(at + 1, len(words)):
        if words[i] in SCENES or (words[i] in BACKDROPS and words[i - 1] in COLOURS):
            scene, background = words[i], words[i - 1] if words[i - 1] in COLOURS else None
            break
    return Parsed(
        subject=words[at] if words else "",
        colour=colour,
        scene=scene,
        background=background,
        size=next((SIZE_WORDS[w] for w in words if w in SIZE_WORDS), None),
        position=next((POSITION_WORDS[w] for w in words if w in POSITION_WORDS), None),
    )


def rewrite_rule(prompt: str) -> str:
    """The caption a free prompt rewrites to: the rules of the module docstring, all of them here."""
    said = parse(prompt)
    shape = SUBJECT_SHAPES.get(said.subject, "circle")
    colour = said.colour or USUAL_COLOURS.get(said.subject, DEFAULT_COLOUR)
    background = said.background or (SCENES[said.scene] if said.scene in SCENES else "white")
    if background == colour:  # the image model draws no shape on its own colour
        background = "black" if colour == "white" else "white"
    size, position = said.size or "large", said.position or "centered"
    return f"a {size} {colour} {shape} on {with_article(background)} background, {position}"


def keeps_words(prompt: str, caption: str) -> bool:
    """Whether `caption` keeps what `prompt` names in the image model's vocabulary: each of its colour and shape
    words, and the shape each of its subject nouns maps to (SUBJECT_SHAPES)."""
    said, kept = words_of(prompt), set(words_of(caption))
    wanted = {w for w in said if w in COLOURS or w in SHAPES} | {SUBJECT_SHAPES[w] for w in said if w in SUBJECT_SHAPES}
    return wanted <= kept


#: Evaluation prompts: each (subject, colour word, scene) combination is never in training, nor the prompt itself.
HELD_OUT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("a red fox in the snow", "a large red circle on a white background, centered"),
    ("tiny blue ball on the left", "a small blue circle on a white background, left"),
    ("a green mountain under a night sky", "a large green triangle on a black background, centered"),
    ("a purple star floating in space", "a large purple star on a black background, centered"),
    ("an orange sun at sunset", "a large orange circle on a white background, centered"),
    ("a yellow box on the grass, top", "a large yellow square on a green background, top"),
    ("a huge pink donut on a cyan background", "a large pink ring on a cyan background, centered"),
    ("a little white moon in the dark, at the top", "a small white circle on a black background, top"),
    ("a photo of a black tire in the desert", "a large black ring on an orange background, centered"),
    ("draw a cyan pyramid by the sea, on the right", "a large cyan triangle on a blue background, right"),
    ("a starfish underwater", "a large orange star on a blue background, centered"),
    ("an apple on a purple background, bottom", "a large red circle on a purple background, bottom"),
    ("a big green wreath in the snow", "a large green ring on a white background, centered"),
    ("a small red house in the forest, left", "a small red square on a green background, left"),
    ("a blue triangle against a yellow wall", "a large blue triangle on a yellow background, centered"),
    ("a giant yellow coin in the middle, under a pink sky", "a large yellow circle on a pink background, centered"),
    ("a tiny white ring in the fog", "a small white ring on a black background, centered"),
    ("a picture of a purple window at night, bottom", "a large purple square on a black background, bottom"),
    ("a red dragon in the sky, on the left", "a large red circle on a blue background, left"),
    ("a little orange tent in a meadow, at the bottom", "a small orange triangle on a green background, bottom"),
    ("a green square, small, right, on a red background", "a small green square on a red background, right"),
    ("a pink bagel on the beach", "a large pink ring on a yellow background, centered"),
    ("a blue unicorn in the desert", "a large blue circle on an orange background, centered"),
)
#: Chat prompts the evaluation asks (some never in training).
CHAT_PROMPTS = (
    "hello",
    "Hi there, who are you?",
    "what can you draw?",
    "help",
    "thank you so much!",
    "which colours do you know?",
    "can you draw a heart?",
    "what is the meaning of life?",
)


def held_out_key(prompt: str) -> tuple[str, str | None, str | None, str | None]:
    said = parse(prompt)
    return said.subject, said.colour, said.scene, said.background


# --- the corpus ----------------------------------------------------------------------------------

#: Nouns no rule knows: the corpus teaches that an unknown subject is a circle (of its colour word, else the default).
_UNKNOWN_NOUNS = (
    *("castle", "chair", "shoe", "guitar", "train", "bicycle", "piano", "sofa", "bottle", "rocket", "penguin"),
    *("lion", "rabbit", "mouse", "candle", "shell", "feather", "key", "spoon", "teapot", "butterfly", "snail"),
)
_SHAPED, _UNSHAPED = tuple(SUBJECT_SHAPES), tuple(dict.fromkeys((*OTHER_SUBJECTS, *_UNKNOWN_NOUNS)))
_FILLERS = ("cute", "shiny", "happy", "lonely", "old", "fluffy", "sleepy", "funny", "simple", "lovely")
_WRAPPERS = (
    *("a photo of ", "a picture of ", "a drawing of ", "an image of ", "a painting of ", "draw ", "paint "),
    *("show me ", "please draw ", "make "),
)
_SCENE_PHRASES = (
    *("in the snow", "in the fog", "in the mist", "on paper", "in winter", "at night", "in the dark", "in space"),
    *("floating in space", "under a night sky", "in a cave", "in the darkness", "in the sky", "in the ocean"),
    *("in the sea", "by the sea", "underwater", "in the water", "on a lake", "by the river", "in the rain"),
    *("flying in the sky", "on the grass", "in the forest", "in a meadow", "in a field", "in the jungle"),
    *("in the garden", "in the park", "in the desert", "at sunset", "in autumn", "at dusk", "on the beach"),
    *("in the sand", "in the lava", "near a fire", "on the ice", "in a lagoon", "in a lavender field"),
    # Places with no colour of their own: the background stays white.
    *("in the city", "in a room", "on the table", "in the kitchen", "on the street", "at home", "on a shelf"),
)
_KNOWN_WORDS = frozenset((*SUBJECT_SHAPES, *OTHER_SUBJECTS, *_UNKNOWN_NOUNS, *COLOURS, *SCENES, *SIZE_WORDS))


def _pseudo_word(rng: random.Random) -> str:
    """A made-up noun: its pieces are not whole tokens, as a word never seen in training (a "unicorn") will not be;
    the model learns that such a subject is a circle too, and keeps its colour word."""
    while True:
        syllables = [rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3))]
        word = "".join(syllables) + rng.choice(("", "n", "r", "t", "s"))
        if word not in _KNOWN_WORDS and word not in _PHRASE_ENDS:
            return word


#: A colour word on a scene or backdrop noun: "{}" is the colour with its article where the phrase has none.
_COLOURED_SCENES = ("under {} sky", "in {} forest", "in the {} sea", "on {} grass", "in {} desert")
_BACKDROP_PHRASES = (
    *("on {} background", "against {} background", "against {} wall", "on {} backdrop"),
    *("in front of {} wall", "with {} background"),
)
_POSITION_PHRASES = {
    "left": ("on the left", "to the left", "on the left side", "at the left"),
    "right": ("on the right", "to the right", "on the right side", "at the right"),
    "top": ("at the top", "near the top", "on top"),
    "bottom": ("at the bottom", "near the bottom"),
    "centered": ("in the middle", "in the center", "in the centre", "centered", "in the middle of the picture"),
}


def _scene_phrase(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.3:
        return ""
    if kind < 0.7:
        return rng.choice(_SCENE_PHRASES)
    form = rng.choice(_COLOURED_SCENES if kind < 0.8 else _BACKDROP_PHRASES)
    colour = rng.choice(list(COLOURS))
    return form.format(colour if "the {}" in form or "on {} grass" in form else with_article(colour))


def free_prompt(rng: random.Random) -> str:
    """One free image prompt: a subject with or without colour and size words, a scene, a position, phrased
    variously; one in eight is already a caption of the image model's own (`shapes.caption`)."""
    if rng.random() < 0.125:
        fill, background = rng.sample(list(COLOURS), 2)
        return Scene(rng.choice(SHAPES), fill, background, rng.choice(SIZES), rng.choice(POSITIONS)).caption(rng)
    filler = rng.choice(_FILLERS) if rng.random() < 0.12 else None
    size = rng.choice(list(SIZE_WORDS)) if rng.random() < 0.4 else None
    colour = rng.choice(list(COLOURS)) if rng.random() < 0.7 else None
    kind = rng.random()  # shaped subjects half the time: else circles would be most answers
    subject = rng.choice(_SHAPED) if kind < 0.5 else rng.choice(_UNSHAPED) if kind < 0.9 else _pseudo_word(rng)
    phrase = " ".join(w for w in (filler, size, colour, subject) if w)
    article = rng.random()
    phrase = phrase if article < 0.1 else f"the {phrase}" if article < 0.25 else with_article(phrase)
    scene = _scene_phrase(rng)
    place = rng.choice(POSITIONS)
    position = rng.choice(_POSITION_PHRASES[place]) if rng.random() < 0.5 else ""
    bare = bool(position) and rng.random() < 0.15
    if bare:  # the bare word at the end, as the image model's captions say it
        position = place
    pieces: list[tuple[str, str]] = (
        [(" ", scene), (", ", position)]
        if bare
        else [[(" ", position), (" ", scene)], [(" ", scene), (" ", position)], [(" ", position), (", ", scene)]][
            rng.randrange(3)
        ]
    )
    text = phrase + "".join(sep + piece for sep, piece in pieces if piece)
    if rng.random() < 0.2:
        text = rng.choice(_WRAPPERS) + text
    if rng.random() < 0.1:
        text = text[0].upper() + text[1:]
    return text + "." if rng.random() < 0.05 else text


def rewrite_examples(count: int = 12000, seed: int = 0) -> list[tuple[str, str]]:
    """`count` distinct (free prompt, caption) pairs from `seed`, none held out (HELD_OUT_PROMPTS: not the prompt,
    nor its subject, colour and scene together)."""
    rng = random.Random(seed)
    held = {prompt.lower() for prompt, _ in HELD_OUT_PROMPTS}
    held_keys = {held_out_key(prompt) for prompt, _ in HELD_OUT_PROMPTS}
    pairs: dict[str, str] = {}
    while len(pairs) < count:
        prompt = free_prompt(rng)
        if prompt.lower().rstrip(".") in held or held_out_key(prompt) in held_keys:
            continue
        pairs.setdefault(prompt, rewrite_rule(prompt))
    return list(pairs.items())


_COLOUR_LIST = ", ".join(list(COLOURS)[:-1]) + " and " + list(COLOURS)[-1]
_SHAPE_LIST = ", ".join(with_article(s) for s in SHAPES[:-1]) + " or " + with_article(SHAPES[-1])
_KNOWN_C, _KNOWN_S = f"I know {_COLOUR_LIST}.", f"I can draw {_SHAPE_LIST}."
_ELSE = "I am sorry, I can only help with pictures. Describe one in a few words, and I will draw it with shapes."
#: Chat: (questions, the answer). Questions are varied further by `_variants`.
_CHATS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("hello", "hi", "hey", "hello there", "hi there", "hey there", "good morning", "good evening", "greetings"),
        "Hello! Tell me what you would like to see, and I will write it as a picture of shapes.",
    ),
    (
        ("what can you draw", "what can you do", "what do you draw", "what pictures can you make", "what can you make"),
        f"I can draw {_SHAPE_LIST}, in ten colours, on a background of another colour.",
    ),
    (
        ("who are you", "what are you", "what is your name", "tell me about yourself", "introduce yourself"),
        "I am a small rewriter. I turn your picture ideas into simple shapes that the image model can draw.",
    ),
    (
        (
            *("help", "help me", "help please", "please help", "can you help me", "how does this work"),
            *("how do i use you", "what should i say", "i need help"),
        ),
        "Describe a picture in a few words, like a red fox in the snow, and I will rewrite it as a shape, a colour, "
        "a background and a place.",
    ),
    (
        (
            *("thanks", "thank you", "thank you very much", "great, thanks", "thanks a lot", "nice, thank you"),
            *("thanks so much", "many thanks"),
        ),
        "You are welcome! Tell me what to draw next.",
    ),
    (("bye", "goodbye", "see you", "see you later", "good night"), "Goodbye! Come back when you want another picture."),
    (
        ("how are you", "how are you doing", "how is it going", "are you well"),
        "I am well, thank you. What would you like me to draw?",
    ),
    (
        ("what colours do you know", "which colors can you use", "list your colours", "what colors do you have"),
        f"I know ten colours: {_COLOUR_LIST}.",
    ),
    (
        ("what shapes do you know", "which shapes can you draw", "list your shapes", "what shapes do you have"),
        f"I know five shapes: {_SHAPE_LIST.replace(' or ', ' and ')}.",
    ),
    (("what sizes can you draw", "how big can a shape be"), "A shape can be small or large."),
    (
        ("where can you put a shape", "what places do you know", "where can a shape go"),
        "A shape can be on the left, on the right, at the top, at the bottom or in the middle.",
    ),
    (
        (
            *("tell me a joke", "what is the weather like", "what time is it", "who won the game", "write a poem"),
            *("what is two plus two", "explain physics to me", "can you speak french", "tell me a story"),
            *("what is the capital of france", "do you like music", "what should i cook tonight", "sing a song"),
            *("how old are you", "where do you live", "what is the news today", "translate this for me"),
            *("can you write code", "recommend a good book", "what is love", "why is the sky blue"),
        ),
        _ELSE,
    ),
)
_UNKNOWN_COLOURS = ("brown", "gray", "grey", "gold", "silver", "beige", "maroon", "teal", "navy", "magenta")
_UNKNOWN_SHAPES = ("hexagon", "heart", "oval", "diamond", "rectangle", "cross", "arrow", "spiral", "crescent")
_SYSTEMS = ("You are a helpful assistant.", "You are a friendly assistant.", "Answer briefly.")


def _colour_and_shape_chats() -> list[tuple[tuple[str, ...], str]]:
    """Questions about one colour or shape, known or not, with their answers."""
    chats: list[tuple[tuple[str, ...], str]] = []
    for colour in (*COLOURS, *_UNKNOWN_COLOURS):
        asks = (f"do you know {colour}", f"can you draw something {colour}", f"is {colour} one of your colours")
        known = colour in COLOURS
        chats.append(
            (asks, f"Yes, {colour} is one of my ten colours." if known else f"No, I do not know {colour}. {_KNOWN_C}")
        )
    for shape in (*SHAPES, *_UNKNOWN_SHAPES):
        named = with_article(shape)
        asks = (f"can you draw {named}", f"do you know {named}", f"is {named} one of your shapes")
        known = shape in SHAPES
        chats.append((asks, f"Yes, I can draw {named}." if known else f"No, I cannot draw {named}. {_KNOWN_S}"))
    return chats


def _variants(question: str, rng: random.Random) -> str:
    """`question` as someone might type it: a lead word, a capital, a question mark or not."""
    lead = (
        rng.choice(("", "", "", "", "ok, ", "so, ", "hey, ", "please, ", "hi, ", "hello, ", "hi there, "))
        if len(question.split()) > 1
        else ""
    )
    text = lead + question
    text = text[0].upper() + text[1:] if rng.random() < 0.5 else text
    return text + rng.choice(
        ("", "?", "!", ".") if not question.startswith(("wh", "how", "can", "do", "is")) else ("", "?", "?")
    )


def chat_examples(seed: int = 0, per_question: int = 4) -> list[list[dict[str, str]]]:
    """Chat conversations (lists of messages) from `seed`: each question as written and in `per_question` more
    typings, some after a system message, some as a second turn after a greeting."""
    rng = random.Random(seed)
    conversations: list[list[dict[str, str]]] = []
    greeting = _CHATS[0]
    for questions, answer in (*_CHATS, *_colour_and_shape_chats()):
        for question in questions:
            # As written, then typed variously: a plain "help" must read as chat, not as a one-word picture.
            for typed in dict.fromkeys([question, *(_variants(question, rng) for _ in range(per_question))]):
                messages = [{"role": "user", "content": typed}, {"role": "assistant", "content": answer}]
                kind = rng.random()
                if kind < 0.2:
                    messages.insert(0, {"role": "system", "content": rng.choice(_SYSTEMS)})
                elif kind < 0.3:
                    hello = _variants(rng.choice(greeting[0]), rng)
                    messages[:0] = [{"role": "user", "content": hello}, {"role": "assistant", "content": greeting[1]}]
                conversations.append(messages)
    return conversations


def conversations(plan: RewriterPlan) -> list[list[dict[str, str]]]:
    """The whole training corpus as chat conversations: every rewrite as the LLM stage sends it (no system
    message), then the chats."""
    rewrites = [
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": caption}]
        for prompt, caption in rewrite_examples(plan.rewrites, plan.seed)
    ]
    return rewrites + chat_examples(plan.seed)


def corpus_sha256(corpus: list[list[dict[str, str]]]) -> str:
    return hashlib.sha256(json.dumps(corpus, sort_keys=True).encode()).hexdigest()


# --- the tokenizer and the model -----------------------------------------------------------------


def build_tokenizer(corpus: list[list[dict[str, str]]], vocab_size: int):
    """The rewriter's tokenizer: byte-level BPE trained on the corpus's messages (its words are whole tokens), with
    the embedded models' special tokens, BOS post-processor and chat template (`stages.embedded.llm`)."""
    texts = (m["content"] for messages in corpus for m in messages)
    return byte_level_tokenizer(texts, vocab_size, TINY.max_position_embeddings)


def encode(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversation as CHAT_TEMPLATE writes it; labels are -100 but on the assistant's answers
    and their END (what the model must write: the role token before an answer is the prompt's)."""
    ids, labels = [tokenizer.convert_tokens_to_ids(BOS)], [-100]
    end = tokenizer.convert_tokens_to_ids(END)
    for message in messages:
        content = tokenizer.encode(message["content"], add_special_tokens=False)
        ids += [tokenizer.convert_tokens_to_ids(f"<|{message['role']}|>"), *content, end]
        trained = message["role"] == "assistant"
        labels += [-100, *(content if trained else [-100] * len(content)), end if trained else -100]
    return ids, labels


def llama(tokenizer, seed: int):
    """TINY's LlamaForCausalLM over this tokenizer, its weights drawn from `seed`."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(TINY.llama_config(tokenizer))


# --- training ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewriterPlan:
    """Everything that decides the trained weights (with the library versions and the CPU kind)."""

    seed: int = 0
    #: Threads for every step: a thread count splits work differently, so it is part of what decides the bits.
    threads: int = 2
    rewrites: int = 12000
    #: Each chat conversation is this many times in an epoch's pool: chats are few next to the rewrites.
    chat_repeats: int = 5
    vocab_size: int = 1024  # an upper bound, as TINY's
    steps: int = 1200
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 60
    weight_decay: float = 0.01
    #: The weights' dtype on disk.
    dtype: str = "bfloat16"


def _batch(examples: list[tuple[list[int], list[int]]], pad: int):
    """Right-padded ids, attention mask and labels of `examples`, as tensors."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (tokens, targets) in enumerate(examples):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, : len(targets)] = torch.tensor(targets)
        mask[row, : len(tokens)] = 1
    return ids, mask, labels


def _schedule(plan: RewriterPlan) -> Callable[[int], float]:
    """The learning rate's factor at a step: linear warmup, then cosine down to a tenth."""
    import math

    def factor(step: int) -> float:
        if step < plan.warmup:
            return (step + 1) / plan.warmup
        progress = (step - plan.warmup) / max(plan.steps - plan.warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _epoch(lengths: list[int], batch: int, order) -> list[list[int]]:
    """One epoch's batches in a seeded order: a random permutation, sorted by length within runs of 16 batches so
    a batch pads little (a two-turn chat is three times a rewrite's length)."""
    import torch

    shuffled = torch.randperm(len(lengths), generator=order).tolist()
    run = batch * 16
    batches = []
    for start in range(0, len(shuffled), run):
        part = sorted(shuffled[start : start + run], key=lengths.__getitem__)
        batches += [part[k : k + batch] for k in range(0, len(part), batch)]
    return [batches[i] for i in torch.randperm(len(batches), generator=order).tolist()]


def _fit(model, examples: list[tuple[list[int], list[int]]], pad: int, plan: RewriterPlan, log) -> list[list[float]]:
    """Train `model` on `examples` (`_epoch` after `_epoch`); returns [step, loss] samples."""
    import torch

    optimiser = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=plan.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, _schedule(plan))
    order = torch.Generator().manual_seed(plan.seed)
    lengths = [len(ids) for ids, _ in examples]
    queue: list[list[int]] = []
    curve, running = [], 0.0
    model.train()
    for step in range(plan.steps):
        if not queue:
            queue = _epoch(lengths, plan.batch, order)
        ids, mask, labels = _batch([examples[i] for i in queue.pop()], pad)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        running = 0.95 * running + 0.05 * loss.item() if step else loss.item()
        if step % 50 == 0 or step == plan.steps - 1:
            curve.append([step, round(running, 5)])
            log(f"step {step}: loss {running:.4f} (batch {loss.item():.4f})")
    model.eval()
    return curve


def train(plan: RewriterPlan, out: Path, log=print) -> dict[str, Any]:
    """Build the corpus and tokenizer, train the model after `plan` and save the directory into `out`; returns what
    it measured."""
    import torch
    from transformers import GenerationConfig

    started = time.perf_counter()
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(plan.threads)
    torch.use_deterministic_algorithms(True)
    corpus = conversations(plan)
    _check_held_out(corpus)
    tokenizer = build_tokenizer(corpus, plan.vocab_size)
    examples = [encode(tokenizer, messages) for messages in corpus]
    _check_encoding(tokenizer, corpus, examples)
    rewrites = plan.rewrites
    pool = examples[:rewrites] + examples[rewrites:] * plan.chat_repeats
    with torch.random.fork_rng(devices=[]):  # training never disturbs the caller's random state
        model = llama(tokenizer, plan.seed)
        curve = _fit(model, pool, tokenizer.pad_token_id, plan, log)
    train_s = time.perf_counter() - started
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    model.to(getattr(torch, plan.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        # The answer ends with END (the template's end of a message): generation stops on it, or on EOS.
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    captions = [tokenizer.encode(m[-1]["content"], add_special_tokens=False) for m in corpus[:rewrites]]
    return {
        "plan": asdict(plan),
        "corpus": {
            "rewrites": rewrites,
            "chats": len(corpus) - rewrites,
            "sha256": corpus_sha256(corpus),
            "tokens": sum(len(ids) for ids, _ in examples),
            "vocab_size": len(tokenizer),
            "caption_tokens_mean": round(sum(map(len, captions)) / len(captions), 2),
        },
        "loss_curve": curve,
        "final_loss": curve[-1][1],
        "train_wall_s": round(train_s, 1),
    }


def _check_held_out(corpus: list[list[dict[str, str]]]) -> None:
    """No held-out prompt, nor its subject, colour and scene together, is a training prompt; each expected caption
    is the rules' own."""
    held = {p.lower() for p, _ in HELD_OUT_PROMPTS}
    keys = {held_out_key(p) for p, _ in HELD_OUT_PROMPTS}
    for messages in corpus:
        for m in messages:
            if m["role"] == "user":
                assert m["content"].lower().rstrip(".") not in held, m
    prompts = [messages[0]["content"] for messages in corpus if messages[0]["role"] == "user"]
    assert not keys & {held_out_key(p) for p in prompts}, "a held-out combination is in training"
    for prompt, expected in HELD_OUT_PROMPTS:
        assert rewrite_rule(prompt) == expected and keeps_words(prompt, expected), (prompt, expected)


def _check_encoding(tokenizer, corpus: list[list[dict[str, str]]], examples: list[tuple[list[int], list[int]]]) -> None:
    """The training ids are the chat template's, encoded as the LLM stage encodes them."""
    for messages, (ids, _) in zip(corpus, examples, strict=True):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert tokenizer.encode(text, add_special_tokens=False) == ids, messages


# --- evaluation ----------------------------------------------------------------------------------


def answer(model, tokenizer, prompt: str, *, sample_seed: int | None = None) -> tuple[str, float]:
    """The model's answer to one user message (greedy, or sampled at temperature 1 from `sample_seed`), and the
    least probability it gave a token it chose."""
    import torch

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    sampling: dict[str, Any] = {"do_sample": False}
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=48,
            return_dict_in_generate=True,
            output_scores=True,
            **sampling,
        )
    chosen = out.sequences[0, ids.shape[1] :]
    least = min(float(torch.softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, chosen, strict=True))
    return tokenizer.decode(chosen, skip_special_tokens=True).strip(), least


def _readable(text: str, known: set[str]) -> bool:
    words = re.findall(r"[a-z]+", text.lower())
    return bool(words) and all(w in known for w in words)


def evaluate(directory: Path, plan: RewriterPlan, samples: int = 5) -> dict[str, Any]:
    """Greedy rewrites of HELD_OUT_PROMPTS and answers to CHAT_PROMPTS with the saved model, loaded in float32 (the
    record) and bfloat16 (whether it agrees); and `samples` rewrites of each held-out prompt at temperature 1."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(directory)
    known = {w for m in chat_examples(plan.seed) for x in m if x["role"] == "assistant" for w in words_of(x["content"])}
    outputs: dict[str, list[tuple[str, float]]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    with torch.random.fork_rng(devices=[]):
        for dtype in ("float32", "bfloat16"):
            model = LlamaForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
            prompts = [p for p, _ in HELD_OUT_PROMPTS] + list(CHAT_PROMPTS)
            outputs[dtype] = [answer(model, tokenizer, p) for p in prompts]
        sampled = [
            answer(model, tokenizer, p, sample_seed=seed)[0] == expected
            for p, expected in HELD_OUT_PROMPTS
            for seed in range(samples)
        ]
    torch.set_num_threads(threads)
    rewrites, chats = outputs["float32"][: len(HELD_OUT_PROMPTS)], outputs["float32"][len(HELD_OUT_PROMPTS) :]
    held_out = [
        {
            "prompt": p,
            "expected": e,
            "rewrite": r,
            "exact": r == e,
            "keeps_words": keeps_words(p, r),
            "least_p": round(q, 4),
        }
        for (p, e), (r, q) in zip(HELD_OUT_PROMPTS, rewrites, strict=True)
    ]
    return {
        "held_out": held_out,
        "held_out_exact": sum(h["exact"] for h in held_out),
        "held_out_keeps_words": sum(h["keeps_words"] for h in held_out),
        "held_out_count": len(held_out),
        "chat": [
            {"prompt": p, "answer": a, "readable": _readable(a, known)}
            for p, (a, _) in zip(CHAT_PROMPTS, chats, strict=True)
        ],
        "bfloat16_agrees": [a for a, _ in outputs["bfloat16"]] == [a for a, _ in outputs["float32"]],
        "sampled_t1_exact_share": round(sum(sampled) / len(sampled), 3),
    }


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REWRITER_PATH)
    parser.add_argument("--steps", type=int, default=RewriterPlan.steps, help="fewer for a quick check")
    args = parser.parse_args(argv)
    plan = RewriterPlan(steps=args.steps)
    started = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {line}", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        trained = Path(scratch) / "model"
        record = train(plan, trained, log)
        log("evaluating")
        record["evaluation"] = evaluate(trained, plan)
        record.update(
            versions={name: version(name) for name in LIBRARIES},
            cpu=cpu_model(),
            weights_sha256=weights_fingerprint(trained),
            wall_s=round(time.perf_counter() - started, 1),
        )
        (trained / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(trained, args.out)
    for path in args.out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600: a replica running as another user must read the weights
    _summary(record, log)


def _summary(record: dict[str, Any], log: Callable[[str], None]) -> None:
    found = record["evaluation"]
    log(f"trained in {record['train_wall_s']} s ({record['cpu']}), final loss {record['final_loss']}")
    log(
        f"held out: {found['held_out_exact']}/{found['held_out_count']} exact, {found['held_out_keeps_words']} keep words"
    )
    for h in found["held_out"]:
        log(f"  {'ok ' if h['exact'] else 'BAD'} {h['prompt']!r} -> {h['rewrite']!r}")
    for c in found["chat"]:
        log(f"  {'ok ' if c['readable'] else 'BAD'} {c['prompt']!r} -> {c['answer']!r}")
    log(f"bfloat16 agrees: {found['bfloat16_agrees']}; sampled at t=1, exact: {found['sampled_t1_exact_share']}")


if __name__ == "__main__":
    main()
