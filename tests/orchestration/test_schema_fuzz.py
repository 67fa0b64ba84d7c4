"""The served OpenAPI document tells the truth, checked by a schema-driven fuzzer (schemathesis) over real HTTP:
requests drawn from `/openapi.json` itself, as the document says they may be (every operation, every field within
its declared bounds, enums, patterns and formats). For each: no 5xx, a response the document declares (status,
content type, body schema), and no refusal of a request the document calls valid.

The app is the package's "/small" (tests/orchestration/conftest.py: both switches on, limits small enough that any
valid request renders in about a second on 2 cores: at most 64x64 pixels and 8 steps, the LLM's context 256 tokens,
videos of one step and at most 9 frames): what is fuzzed is the document against the server, not the machine's speed.
Derandomized: the same requests every run.
"""

import math


import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = {"POST": 80, "GET": 20, "DELETE": 20}  # per operation


@pytest.fixture(scope="module")
def document(small_server):
    loaded = schemathesis.openapi.from_url(f"{small_server}/openapi.json")
    image = loaded.raw_schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]["size"]["anyOf"][0]
    video = loaded.raw_schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schemathesis.openapi.format("image-size", image_size([image, video["properties"]["size"]["anyOf"][0]]))
    return loaded


def image_size(schemas: list[dict]) -> st.SearchStrategy:
    """The document's `format: image-size` (one strategy for every size of the document: images' and videos'): "auto",
    or width x height, each a multiple of every `x-size-multiple`, at most the least `x-max-pixels` in all."""
    step = math.lcm(*(schema["x-size-multiple"] for schema in schemas))
    most = min(schema["x-max-pixels"] for schema in schemas)
    sides = st.integers(1, most // step // step).flatmap(
        lambda w: st.integers(1, most // (w * step) // step).map(lambda h: f"{w * step}x{h * step}")
    )
    return st.one_of(st.just("auto"), sides)


def as_json_integers(value):
    """The body as the document's `info.x-json-integers` asks: a whole number the fuzzer spelled as a float (JSON
    Schema's `integer` takes 4.0, so the fuzzer draws it) written as the integer. Safe for every field: a number field
    takes an integer too."""
    if isinstance(value, dict):
        return {key: as_json_integers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_json_integers(item) for item in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


def within_declared(body, schema: dict) -> bool:
    """The document's rules that JSON Schema has no keyword for, each an `x-` keyword the document states:
    `x-not-above` (a field at most the first of `first_of` the body gives, else `default`), `x-unique-by` (an array's
    items distinct by a key), `x-context-tokens` (a chat's messages and completion within the LLM's context, counted
    as the keyword says)."""
    if not isinstance(body, dict):
        return True
    for name, rule in schema.get("x-not-above", {}).items():
        limit = next((body[f] for f in rule["first_of"] if body.get(f) is not None), rule["default"])
        if body.get(name) is not None and body[name] > limit:
            return False
    for name, field in schema.get("properties", {}).items():
        key = next((s.get("x-unique-by") for s in field.get("anyOf", [field]) if "x-unique-by" in s), None)
        if key and isinstance(body.get(name), list) and len({i[key] for i in body[name]}) < len(body[name]):
            return False
    context = schema.get("x-context-tokens")
    if context:
        completion = body.get("max_completion_tokens") or body.get("max_tokens") or 64
        prompt = sum(len(m["content"].encode("utf-8", "surrogatepass")) + 2 for m in body["messages"]) + 2
        return prompt + completion <= context["tokens"]
    return True


OPERATIONS = [
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/images/edits"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/v1/images/img_{token}"),
    ("GET", "/v1/loras"),
    ("GET", "/health"),
    ("POST", "/v1/videos"),
    ("GET", "/v1/videos/{video_id}"),
    ("GET", "/v1/videos/{video_id}/content"),
    ("DELETE", "/v1/videos/{video_id}"),
]
#: An edit's `image` is declared as a file (`format: binary`): whether its bytes decode as a picture is beyond what a
#: schema can say, so a drawn edit is checked for no 5xx and a declared response only (tests/orchestration/test_edits.py
#: covers real images).
ACCEPTANCE_UNSTATABLE = {"/v1/images/edits"}
#: A form's text is the fuzzer's own spelling of each value (a bool as Python writes it, "True", which is no JSON
#: `true`): a drawn form is checked for no 5xx and a declared response only; the JSON body for acceptance too.
FORM = "multipart/form-data"


@pytest.mark.parametrize("method,path", OPERATIONS)
def test_every_request_the_document_calls_valid_is_served_as_the_document_says(small_server, document, method, path):
    from schemathesis.checks import not_a_server_error, positive_data_acceptance, response_schema_conformance

    checks = [not_a_server_error, response_schema_conformance]
    accepted = [] if path in ACCEPTANCE_UNSTATABLE else [positive_data_acceptance]

    operation = document[path][method]
    body_schema = operation.definition.raw.get("requestBody", {}).get("content", {}).get("application/json", {})
    ref = body_schema.get("schema", {}).get("$ref", "")
    declared = document.raw_schema["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {}) if ref else {}
    failures = []
    integers_only = document.raw_schema["info"].get("x-json-integers", False)

    @settings(max_examples=EXAMPLES[method], derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy().filter(lambda case: within_declared(case.body, declared)))
    def run(case):
        try:
            also = [] if case.media_type == FORM else accepted
            if integers_only and case.media_type != FORM:
                case.body = as_json_integers(case.body)
            case.call_and_validate(base_url=small_server, timeout=120, checks=checks + also)
        except Exception as failure:  # every failure collected, so one run shows them all
            failures.append(f"{case.body!r:.300}: {str(failure)[:500]}")

    run()
    assert not failures, "\n".join(failures[:10])
