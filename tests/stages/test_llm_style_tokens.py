"""The embedded model's rewrite tokens (`stages.embedded.llm.style_tokens`): every completion of the style grammar
can be written with them, none of the prefixes they reach is a dead end, and a rewrite stays within its max_tokens."""

import pytest

from contracts import LLMSamplingParams
from stages.embedded import llm as embedded


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded.ensure_tiny_llama())


def test_every_prefix_the_allowed_tokens_reach_can_still_finish_a_completion(tokenizer):
    tokens = embedded.style_tokens(tokenizer)
    texts = [tokenizer.decode([i]) for i in tokens.allowed]
    completions = set(embedded.style_completions())
    prefixes = {c[:k] for c in completions for k in range(len(c) + 1)}
    reached = embedded._reachable(texts, prefixes)
    assert completions <= reached  # every completion is writable with them
    stuck = [p for p in reached if p not in completions and not any(p + t in prefixes for t in texts)]
    assert stuck == []


def test_the_allowed_tokens_are_word_sized_and_a_rewrite_fits_its_max_tokens(tokenizer):
    tokens = embedded.style_tokens(tokenizer)
    assert tokens == embedded.style_tokens(tokenizer)  # a pure function of the tokenizer: every replica agrees
    assert tokenizer.eos_token_id not in tokens.allowed and len(tokens.allowed) < 64
    assert tokens.longest + 1 <= embedded.GRAMMAR_MAX_TOKENS  # the longest way to write one, and the end token
    canonical = max(len(tokenizer.encode(c, add_special_tokens=False)) for c in embedded.style_completions())
    assert canonical <= tokens.longest <= canonical + 2


def test_the_enhancement_hands_vllm_the_allowed_tokens_and_the_end_token(tokenizer):
    _, extra = embedded.StyleEnhancement(tokenizer).sampling(LLMSamplingParams(seed=3))
    allowed = embedded.style_tokens(tokenizer).allowed
    assert extra["allowed_token_ids"] == [*allowed, tokenizer.eos_token_id]
    assert "allowed_token_ids" not in embedded.StyleEnhancement().sampling(LLMSamplingParams(seed=3))[1]
