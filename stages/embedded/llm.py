"""Tiny Llama models with random weights and a locally trained tokenizer, built from a fixed seed.

Nothing can be downloaded where this project runs, so the LLM stage's embedded default is built
here on first use: a byte-level BPE tokenizer trained (with `tokenizers`) on a fixed corpus of
prompt-writing words, and a `LlamaForCausalLM` whose weights come from `torch.manual_seed(seed)`.
The result is a normal Hugging Face model directory that vLLM loads like any other. Builds go
through `stages.embedded.build_cached` (atomic: concurrent first uses never see half a model); the
registry (`stages.embedded.EMBEDDED_MODELS`) names them `embedded:<spec name>`.

Random weights write no sensible free text, so the stage enhances a prompt with an embedded model
through `StyleEnhancement`: a grammar picks "<size>, <position>" from the embedded
image model's vocabulary (`stages.embedded.shapes`), and the user's subject leads the revised prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path
from typing import Any

from contracts.sampling import LLMSamplingParams

from . import build_cached, cache_root, shapes

#: Bump when the build procedure changes, so old cached builds are not reused.
BUILD_VERSION = 2
#: The LLM default (`embedded:tiny-rewriter`): trained, not built (training/rewriter.py), committed with its record.
REWRITER_PATH = Path(__file__).resolve().parent / "tiny-rewriter-llama"

# The rewrite's vocabulary is the embedded image model's own (`stages.embedded.shapes`): a size and a position
# it was trained to draw, so a rewrite visibly changes the picture. Short on purpose: "large, left" is 7 tokens of
# this tokenizer (9 at most, every token a decode step). A background phrase would double that with this
# tokenizer, and a tokenizer that knew those words would be a new model (new weights, new audit records).
SIZES = shapes.SIZES
POSITIONS = shapes.POSITIONS

# A GBNF/EBNF grammar (xgrammar, through vLLM's structured output): "<size>, <position>".
STYLE_GRAMMAR = (
    'root ::= size ", " position\n'
    "size ::= " + " | ".join(json.dumps(s) for s in SIZES) + "\n"
    "position ::= " + " | ".join(json.dumps(s) for s in POSITIONS) + "\n"
)

# The tokenizer's corpus: the style words of the first rewrite vocabulary. Kept as they were: a new corpus is a
# new tokenizer and new weights, and audit records (docs/evidence) name the model by its weights hash.
_STYLES = (
    "watercolor",
    "oil painting",
    "pencil sketch",
    "digital art",
    "film photograph",
    "ink wash",
    "pastel drawing",
    "low poly render",
)
_LIGHTING = (
    "soft morning light",
    "golden hour",
    "overcast daylight",
    "neon glow",
    "candlelight",
    "moonlight",
    "studio lighting",
    "dramatic shadows",
)
_MOODS = ("calm", "dreamy", "vivid", "moody", "serene", "whimsical")

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Roles map onto their own special tokens; unknown roles are refused by the stage, not here.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SUBJECTS = (
    "a cat",
    "a dog",
    "a fox",
    "an owl",
    "a lighthouse",
    "a mountain lake",
    "a city street",
    "a forest path",
    "a sailing boat",
    "an old castle",
    "a bowl of fruit",
    "a portrait of a woman",
    "a robot",
    "a dragon",
    "a garden",
    "a desert",
    "a waterfall",
    "a bridge",
    "a train station",
    "a small village",
    "the sea",
)
_WORDS = (
    "the a an of in on at with and under over near beside through across beautiful detailed highly "
    "intricate colorful quiet bright dark warm cold red blue green yellow purple orange white black "
    "sky cloud sun moon star rain snow wind tree flower river hill field house window door road "
    "sitting standing running flying sleeping walking looking painted drawn rendered style light "
    "shadow color texture background foreground composition scene view close wide angle photo art "
    "prompt image picture describe rewrite improve add keep short clear please write one line"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Everything that decides a built model's bytes (with the library versions)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    tokenizer_vocab_size: int = 1024  # an upper bound: the fixed corpus yields 694 tokens
    seed: int = 20240229

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def fingerprint(self) -> str:
        blob = json.dumps({**asdict(self), "build_version": BUILD_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def directory(self) -> Path:
        """Where this model is built and cached (its name and fingerprint)."""
        return cache_root() / "llm" / f"{self.name}-{self.fingerprint()}"

    def tokenizer(self):
        """A byte-level BPE tokenizer (any text encodes) trained on the fixed corpus."""
        return byte_level_tokenizer(_corpus(), self.tokenizer_vocab_size, self.max_position_embeddings)

    def llama_config(self, tokenizer):
        """The LlamaConfig of this spec over `tokenizer` (the embedded Llamas, random and trained alike)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=len(tokenizer),  # exactly the tokenizer's: no id the model emits is undecodable
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            dtype="float32",
        )

    def build(self, out: Path) -> None:
        """This model's tokenizer, config and seeded random weights, saved into `out`."""
        import torch
        from transformers import LlamaForCausalLM

        tokenizer = self.tokenizer()
        tokenizer.save_pretrained(out)
        config = self.llama_config(tokenizer)
        # Fork the global RNG so building never disturbs the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            # transformers' wrapper of `.to` is typed as the unbound method (its `self` first).
            model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.save_pretrained(out, safe_serialization=True)


# vLLM's CPU attention takes head_dim 32/64/...; 64 is the smallest common one (16 is refused).
#: The embedded default: small enough to start in seconds, wide enough (down projection K = 1408)
#: that oneDNN computes a solo decode row differently from a co-batched one, so the audit's
#: control varies (docs/invariance/llm.md, the LLM evidence table).
TINY = TinyLlamaSpec(
    name="tiny-llama",
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
)
#: A wider check for the audit (`--model embedded:wide-llama`); its control varies too.
WIDE = TinyLlamaSpec(
    name="wide-llama",
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=8,
)
#: Llama 3.2 1B's body (hidden 2048, FFN 8192, 16 layers, 32 heads, 8 KV heads) with the embedded tokenizer: the
#: real-size LLM of the real-width audit (docs/performance/real-width.md). Random weights, 3.9 GB in float32; its LM head
#: has the tokenizer's rows, not Llama's 128,256 (the body's GEMMs are the real model's, the head's are not).
LLAMA_1B_WIDTH = TinyLlamaSpec(
    name="llama-1b-width",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
)
#: By recipe name (the registry's `EmbeddedModel.recipe`).
SPECS = {spec.name: spec for spec in (TINY, WIDE, LLAMA_1B_WIDTH)}


def ensure_tiny_llama(spec: TinyLlamaSpec | str = TINY) -> Path:
    """Return the directory of `spec`'s model, building and caching it on first use."""
    if isinstance(spec, str):
        if spec not in SPECS:
            raise ValueError(f"unknown embedded LLM {spec!r}; expected one of {sorted(SPECS)}")
        spec = SPECS[spec]

    def build(directory: Path) -> dict[str, Any]:
        spec.build(directory)
        return {**asdict(spec), "build_version": BUILD_VERSION, "weights_sha256": weights_fingerprint(directory)}

    return build_cached(spec.directory(), build)


def byte_level_tokenizer(texts: Iterable[str], vocab_size: int, max_length: int):
    """A byte-level BPE tokenizer (any text encodes) trained on `texts`, with the embedded models' special tokens,
    their BOS post-processor and chat template (the random Llamas' and the trained rewriter's alike)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Plain prompts get a BOS like Llama's; chat prompts carry it through the template instead.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def weights_fingerprint(directory: Path) -> str:
    """sha256 over the files that decide the model's outputs: weights, config, tokenizer."""
    digest = hashlib.sha256()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        digest.update(name.encode())
        digest.update((Path(directory) / name).read_bytes())
    return digest.hexdigest()


def _corpus() -> list[str]:
    lines = [" ".join(_WORDS.split()[i : i + 9]) for i in range(0, len(_WORDS.split()), 9)]
    for subject in _SUBJECTS:
        for i, style in enumerate(_STYLES):
            light = _LIGHTING[(i + len(subject)) % len(_LIGHTING)]
            mood = _MOODS[(i + len(subject)) % len(_MOODS)]
            lines.append(f"{subject}, {style}, {light}, {mood}")
    return lines


# --- the stage's enhancement with an embedded model ---------------------------------------------

#: Spare tokens past the longest grammar completion: the end-of-sequence token.
_GRAMMAR_SLACK = 2


def style_completions() -> list[str]:
    """Every string STYLE_GRAMMAR accepts."""
    return [f"{s}, {p}" for s, p in product(SIZES, POSITIONS)]


def longest_style_completion() -> int:
    """The longest string STYLE_GRAMMAR accepts, in bytes: any tokenization of it may go down to one byte per token."""
    return max(len(c.encode()) for c in style_completions())


#: Enough tokens for the grammar to finish whatever it picks.
GRAMMAR_MAX_TOKENS = longest_style_completion() + _GRAMMAR_SLACK


@dataclass(frozen=True)
class StyleTokens:
    """The tokens a style completion may be written with, and the most any completion then takes.

    Random weights pick among every token the grammar allows, single bytes included (14 tokens per rewrite on
    average, measured), although each completion has a tokenization of 5-10 word-sized tokens. Restricting the
    sampler to the canonical tokens (plus the few that rescue a dead end) keeps every completion reachable and
    halves the decode steps of a rewrite. A pure function of the tokenizer: the same ids in every replica.
    """

    allowed: tuple[int, ...]  # without the end-of-sequence token
    longest: int  # the most tokens any completion takes with `allowed` (end-of-sequence not counted)


def style_tokens(tokenizer) -> StyleTokens:
    """Canonical tokens of every completion, grown until no prefix they reach is a dead end."""
    completions = style_completions()
    prefixes = {c[:k] for c in completions for k in range(len(c) + 1)}
    allowed: set[int] = {i for c in completions for i in tokenizer.encode(c, add_special_tokens=False)}
    while True:
        texts = {i: tokenizer.decode([i]) for i in allowed}
        reached = _reachable(texts.values(), prefixes)
        dead = sorted(p for p in reached if not any(p + t in prefixes for t in texts.values()) and p not in completions)
        if not dead:
            return StyleTokens(
                tuple(sorted(allowed)), _longest("", tuple(texts.values()), prefixes, set(completions), {})
            )
        for prefix in dead:  # finish one completion it begins with, canonically from there
            rest = next(c for c in completions if c.startswith(prefix))[len(prefix) :]
            allowed.update(tokenizer.encode(rest, add_special_tokens=False))


def _reachable(texts, prefixes: set[str]) -> set[str]:
    reached, frontier = {""}, [""]
    while frontier:
        prefix = frontier.pop()
        for text in texts:
            if prefix + text in prefixes and prefix + text not in reached:
                reached.add(prefix + text)
                frontier.append(prefix + text)
    return reached


def _longest(prefix: str, texts: tuple[str, ...], prefixes: set[str], ends: set[str], memo: dict[str, int]) -> int:
    if prefix not in memo:
        steps = [1 + _longest(prefix + t, texts, prefixes, ends, memo) for t in texts if prefix + t in prefixes]
        memo[prefix] = max(steps, default=0)
    return memo[prefix]


class StyleEnhancement:
    """How the LLM stage enhances a prompt with an embedded model: a size and a position word of the embedded
    image model, picked by STYLE_GRAMMAR; a size or position the user's prompt already says is kept, not overridden.

    With the model's tokenizer, the sampler is also held to `style_tokens` (word-sized tokens, see there).
    """

    structured_output = True
    # Random weights read no instruction (the grammar decides the form), so the instruction is only a cost: the
    # stage's default one is 62 tokens of this corpus-trained tokenizer, and prefill was ~40% of a rewrite's time.
    system_prompt = "rewrite: add style, light"  # 9 tokens; any words would do

    def __init__(self, tokenizer=None):
        self.tokens = style_tokens(tokenizer) if tokenizer is not None else None
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def sampling(self, params: LLMSamplingParams) -> tuple[LLMSamplingParams, dict[str, Any]]:
        """The params the enhancement runs with, the grammar for vLLM's structured output, and its tokens."""
        from vllm.sampling_params import StructuredOutputsParams

        # The grammar must be able to finish: enough tokens, no stop strings or forced length.
        params = LLMSamplingParams.from_params(
            params, max_tokens=max(params.max_tokens, GRAMMAR_MAX_TOKENS), min_tokens=0, stop=[]
        )
        extra: dict[str, Any] = {"structured_outputs": StructuredOutputsParams(grammar=STYLE_GRAMMAR)}
        if self.tokens is not None:
            extra["allowed_token_ids"] = [*self.tokens.allowed, self.eos]
        return params, extra

    def compose(self, prompt: str, completion: str) -> str:
        """The user's subject first, then the completion's words for what the prompt leaves unsaid."""
        subject = prompt.strip().rstrip(",.;")
        said = set(subject.lower().replace(",", " ").split())
        kept = [
            word for word in completion.split(", ") if word and not said & set(SIZES if word in SIZES else POSITIONS)
        ]
        return ", ".join([subject, *kept])
