"""The embedded default LLM (`embedded:tiny-rewriter`, trained by `training.rewriter`, committed): it
rewrites free prompts it never saw into the image model's words, keeping their colour and shape words, and answers
chat in readable words. Run with transformers (greedy, as the record's evaluation); the LLM stage serves the same
directory with vLLM (tests/orchestration/test_rewriter_http.py)."""

import json

import pytest

from stages.embedded import DEFAULT_MODELS, EMBEDDED_MODELS
from stages.embedded.llm import REWRITER_PATH, weights_fingerprint
from training.rewriter import (
    CHAT_PROMPTS,
    HELD_OUT_PROMPTS,
    RECORD,
    answer,
    chat_examples,
    held_out_key,
    keeps_words,
    rewrite_examples,
    rewrite_rule,
    words_of,
)


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(2)
    return LlamaForCausalLM.from_pretrained(REWRITER_PATH, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        REWRITER_PATH
    )


def test_the_trained_rewriter_is_the_llm_default_and_its_record_describes_the_committed_weights():
    from stages.llm.settings import resolve_model

    assert EMBEDDED_MODELS["embedded:tiny-rewriter"].trained and DEFAULT_MODELS["llm"] == "embedded:tiny-rewriter"
    choice = resolve_model(None)
    assert choice == resolve_model("embedded:tiny-rewriter")
    assert choice.embedded and choice.path == str(REWRITER_PATH)
    record = json.loads((REWRITER_PATH / RECORD).read_text())
    assert record["weights_sha256"] == weights_fingerprint(REWRITER_PATH)
    assert record["evaluation"]["held_out_keeps_words"] == record["evaluation"]["held_out_count"] >= 20


def test_no_held_out_prompt_or_its_combination_is_in_the_training_corpus():
    held = {held_out_key(p) for p, _ in HELD_OUT_PROMPTS}
    trained = [p for p, _ in rewrite_examples()]
    assert not held & {held_out_key(p) for p in trained}
    assert not {p for p, _ in HELD_OUT_PROMPTS} & set(trained)
    assert all(rewrite_rule(p) == caption for p, caption in HELD_OUT_PROMPTS)  # the rule the corpus was made by


def test_each_held_out_prompt_is_rewritten_keeping_its_colour_and_shape_words(model):
    rewrites = {prompt: answer(*model, prompt)[0] for prompt, _ in HELD_OUT_PROMPTS}
    kept = [prompt for prompt, rewrite in rewrites.items() if keeps_words(prompt, rewrite)]
    exact = [prompt for prompt, caption in HELD_OUT_PROMPTS if rewrites[prompt] == caption]
    assert len(kept) == len(HELD_OUT_PROMPTS), rewrites
    assert len(exact) >= len(HELD_OUT_PROMPTS) - 2, rewrites


def test_chat_answers_in_readable_words(model):
    # Readable: every word one of its training language's (what it was taught to answer, chats and rewrites alike).
    answers = [m["content"] for chat in chat_examples() for m in chat if m["role"] == "assistant"]
    known = {w for text in answers + [caption for _, caption in rewrite_examples()] for w in words_of(text)}
    for prompt in CHAT_PROMPTS:
        text = answer(*model, prompt)[0]
        words = words_of(text)
        assert len(words) >= 3 and set(words) <= known, (prompt, text)
