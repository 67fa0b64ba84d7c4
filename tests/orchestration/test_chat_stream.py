"""Streamed chat completions (`stream: true`) on the package's "/" app (LLM switch on), as OpenAI and vLLM stream them:
`chat.completion.chunk` events, the role first, `[DONE]` last, `stream_options.include_usage`; through the official
openai client the streamed text and the chunks' token ids concatenated equal the non-streamed completion for the same
seed, token for token; a client that leaves mid-stream aborts the request in vLLM (the replica has nothing in flight
after); a malformed stream request is a 400 before anything is streamed."""

import json
import time

import httpx
import pytest

from tests.openai_types import read_as_openai

from .conftest import TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BODY = {"messages": [{"role": "user", "content": "a red fox in the snow"}], "max_tokens": 24, "seed": 11,
        "temperature": 0.9, "logprobs": True}


def events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_the_stream_concatenated_is_the_non_streamed_completion_token_for_token(server, http):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    whole = http.post("/v1/chat/completions", json=BODY).json()
    read_as_openai("chat", whole)  # logprobs included
    chunks = list(client.chat.completions.create(**BODY, model="llm", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole["choices"][0]["message"]["content"]
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == whole["token_ids"]
    streamed_logprobs = [p.logprob for c in chunks if c.choices and c.choices[0].logprobs
                         for p in c.choices[0].logprobs.content]
    assert streamed_logprobs == [p["logprob"] for p in whole["choices"][0]["logprobs"]["content"]]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole["choices"][0]["finish_reason"]]
    assert chunks[-1].choices == [] and {k: getattr(chunks[-1].usage, k) for k in whole["usage"]} == whole["usage"]
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_the_raw_stream_is_data_lines_ending_in_done_without_usage_unless_asked(http):
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = events(response)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(c["usage"] is None for c in chunks) and all(c["choices"] for c in chunks)
    for chunk in chunks:
        read_as_openai("chunk", chunk)


@pytest.mark.parametrize("body, param", [({"stream_options": {"include_usage": True}}, "stream_options"),
                                         ({"stream": True, "stream_options": {"include": True}}, "stream_options"),
                                         ({"stream": True, "temperature": 9}, "temperature")])
def test_a_malformed_stream_request_is_a_400_before_anything_streams(http, body, param):
    response = http.post("/v1/chat/completions", json={**BODY, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_a_client_leaving_mid_stream_aborts_the_request_in_vllm(server, http):
    """A long completion (1000 tokens exactly), left after its first chunks: vLLM has no request left (its own count)
    sooner than half the time the same completion takes when nobody leaves (the control, measured after)."""
    long = {**BODY, "max_tokens": 1000, "min_tokens": 1000}
    started = time.monotonic()
    with httpx.Client(base_url=server, timeout=TIMEOUT_S) as leaving, leaving.stream(
            "POST", "/v1/chat/completions", json={**long, "stream": True}) as response:
        for count, _ in enumerate(response.iter_lines()):
            if count >= 6:
                break
    left_s, details = None, {}
    while time.monotonic() < started + 120:
        details = http.get("/health").json()["stages"]["llm"]["describe"]["details"]
        if details["requests_in_engine"] == 0 and details["in_flight"] == 0:
            left_s = time.monotonic() - started
            break
        time.sleep(0.1)
    assert left_s is not None, f"vLLM still had the abandoned request after 120 s: {details}"
    started = time.monotonic()
    whole = http.post("/v1/chat/completions", json=long)
    whole_s = time.monotonic() - started
    assert whole.status_code == 200 and len(whole.json()["token_ids"]) == 1000
    print(f"vLLM had no request {left_s:.2f} s after the stream began; the whole completion takes {whole_s:.2f} s")
    assert left_s < whole_s / 2, f"left after {left_s:.2f} s; the whole completion takes {whole_s:.2f} s"
