"""1,000+ generated bad bodies over real HTTP: each gets a 4xx with an `error.message`, never a 5xx; afterwards the
app still serves valid requests of both routes.

The app is real: the package's "/" (LLM and diffusion stages, both switches on; tests/orchestration/conftest.py,
shared rather than a third app of its own, which cost a minute of the suite to start and stop); the bodies are
drawn by hypothesis, derandomized (the same bodies every run), from:
- both request schemas (`/openapi.json`'s own JSON schemas): each field given a value of another JSON type, a value
  past its range or length, a value outside its enum; an unknown field; a required field left out;
- mutations of valid bodies: text where the API wants visible text or ASCII digits (zero-width, direction marks,
  RTL, emoji, other scripts' digits), stop strings vLLM refuses, huge integers, deep nesting, duplicate keys,
  truncated, non-UTF-8 and non-object JSON, other content types, and bodies over the size limit.
Every body is bad by construction: a 2xx is a bound missing, a 5xx a client mistake taken for the server's.
"""

import asyncio
import json
import math
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from contracts.http import BODY_RULES, ChatCompletionRequest, ImageEditRequest, ImageGenerationRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

IMAGES, CHAT, EDITS = "/v1/images/generations", "/v1/chat/completions", "/v1/images/edits"
VALID = {
    IMAGES: {"prompt": "a red fox", "seed": 7, "size": "64x64", "num_inference_steps": 1, "enhance_prompt": False},
    CHAT: {"messages": [{"role": "user", "content": "a fox"}], "seed": 7, "max_tokens": 4},
}
SCHEMAS = {IMAGES: ImageGenerationRequest, CHAT: ChatCompletionRequest}
CONCURRENCY = 16

# --- JSON values by type, and what a schema allows ------------------------------------------------------

JSON_VALUES = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer": st.integers(-(2**70), 2**70),
    "number": st.floats(allow_nan=False, allow_infinity=False),  # whole ones too: `1.0` is no integer field's value
    "string": st.text(max_size=12),
    "array": st.lists(st.integers(), max_size=3),
    "object": st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
}
INVISIBLE = "\u200b\u200c\u200d\u200e\u200f\u202e\u2060\ufeff\u00a0\u3000\u3164\u2800\u180e \t\n\r"
MARKS = ["\u200f", "\u200b", "\u202e", "\ufeff", "\U0001f98a", "\u05e9", "\u0663", "\u00a0"]
DIGITS = ["\u0660", "\u06f0", "\u0966", "\uff10", "\u09e6", "\u0e50", "\U0001d7ce"]  # zeros: add 0..9 for the others


def members(schema: dict, defs: dict) -> list[dict]:
    """The alternatives of a property's schema, `$ref`s resolved."""
    alternatives = schema.get("anyOf", [schema])
    return [defs[m["$ref"].split("/")[-1]] if "$ref" in m else m for m in alternatives]


def kinds(schema: dict, defs: dict) -> set[str]:
    found = set()
    for member in members(schema, defs):
        found |= set(member["type"]) if isinstance(member.get("type"), list) else {member.get("type", "array")}
    return found | ({"integer"} if "number" in found else set())


def wrong_type(schema: dict, defs: dict, required: bool) -> st.SearchStrategy:
    allowed = kinds(schema, defs) | (set() if required else {"null"})
    return st.one_of([values for kind, values in JSON_VALUES.items() if kind not in allowed])


def past_bounds(member: dict) -> list[st.SearchStrategy]:
    """Values of the member's own type outside its bounds: just past them, and far."""
    found = []
    if member.get("type") in ("integer", "number"):
        floats = member["type"] == "number"
        if "minimum" in member or "exclusiveMinimum" in member:
            low = member.get("minimum", member.get("exclusiveMinimum"))
            found.append(st.integers(max_value=math.ceil(low) - 1 if "minimum" in member else math.floor(low)))
            found += [st.floats(max_value=low, exclude_max="minimum" in member, allow_infinity=False)] if floats else []
        if "maximum" in member or "exclusiveMaximum" in member:
            high = member.get("maximum", member.get("exclusiveMaximum"))
            found.append(st.integers(min_value=math.floor(high) + 1 if "maximum" in member else math.ceil(high)))
            found += [st.floats(min_value=high, exclude_min="maximum" in member, allow_infinity=False)] if floats else []
    if member.get("type") == "string" and "maxLength" in member:
        over = member["maxLength"] + 1
        found.append(st.builds(lambda c, k: c * (over + k), st.characters(codec="utf-8"), st.integers(0, 64)))
    if member.get("type") == "string" and member.get("minLength", 0) > 0:
        found.append(st.just(""))
    if "enum" in member:
        found.append(st.text(max_size=20).filter(lambda v: v not in member["enum"]))
        found.append(st.tuples(st.sampled_from(member["enum"]), st.sampled_from(MARKS), st.booleans()).map(marked))
    if member.get("type") == "array" and "maxItems" in member:
        found.append(st.integers(1, 8).map(lambda k: ["x"] * (member["maxItems"] + k)))
    if member.get("type") == "array" and member.get("minItems", 0) > 0:
        found.append(st.just([]))
    return found


def marked(value_mark_front: tuple[str, str, bool]) -> str:
    """A valid word with an invisible, RTL, emoji or foreign-digit character before or after it."""
    value, mark, front = value_mark_front
    return mark + value if front else value + mark


def bad_field(props: dict, defs: dict, required: list[str]) -> st.SearchStrategy:
    """(field, bad value) over every property of a schema."""
    choices = []
    for name, schema in props.items():
        bad = [wrong_type(schema, defs, name in required)]
        bad += [s for member in members(schema, defs) for s in past_bounds(member)]
        choices.append(st.tuples(st.just(name), st.one_of(bad)))
    return st.one_of(choices)


def schema_bodies(route: str) -> st.SearchStrategy:
    """The valid body with one field made bad, an unknown field added, or a required field removed."""
    model = SCHEMAS[route]
    schema = model.model_json_schema()
    props, defs, required = schema["properties"], schema.get("$defs", {}), schema.get("required", [])
    valid = VALID[route]
    unknown = st.text(min_size=1, max_size=12).filter(lambda k: k not in props and k not in model.UNSUPPORTED)
    edits = [
        bad_field(props, defs, required).map(lambda kv: {**valid, kv[0]: kv[1]}),
        st.tuples(unknown, st.one_of(list(JSON_VALUES.values()))).map(lambda kv: {**valid, kv[0]: kv[1]}),
        st.sampled_from(required).map(lambda name: {k: v for k, v in valid.items() if k != name}),
        st.sampled_from(sorted(model.UNSUPPORTED)).flatmap(
            lambda name: st.one_of([JSON_VALUES[k] for k in JSON_VALUES if k != "null"]).map(lambda v: {**valid, name: v})),
    ]
    if route == CHAT:  # a bad message inside a valid chat
        message = defs["ChatMessage"]
        edits.append(bad_field(message["properties"], defs, message["required"]).map(
            lambda kv: {**valid, "messages": [{**valid["messages"][0], kv[0]: kv[1]}]}))
    return st.one_of(edits).map(lambda body: (route, "application/json", json.dumps(body).encode()))


# --- mutations of valid bodies ---------------------------------------------------------------------------


def foreign_size(zeros: list[str]) -> str:
    """ "64x64" with its k-th digit written from zeros[k % len(zeros)] (each script's zero, then its 1..9)."""
    digits = iter(range(4))
    return "".join(chr(ord(zeros[next(digits) % len(zeros)]) + int(c)) if c.isdigit() else c for c in "64x64")


def as_json(route: str, body: dict) -> tuple[str, str, bytes]:
    return route, "application/json", json.dumps(body).encode()


#: Fields whose text is checked character by character: each valid value here, made bad by a mark.
WORDS = {"size": "64x64", "response_format": "b64_json", "output_format": "png", "scheduler": "euler"}

UNICODE_BODIES = st.one_of(
    st.text(alphabet=INVISIBLE, max_size=20).map(lambda p: as_json(IMAGES, {**VALID[IMAGES], "prompt": p})),
    st.lists(st.sampled_from(DIGITS + ["0"]), min_size=1, max_size=4).filter(lambda z: set(z) != {"0"}).map(
        lambda zeros: as_json(IMAGES, {**VALID[IMAGES], "size": foreign_size(zeros)})),
    st.tuples(st.sampled_from(sorted(WORDS)), st.sampled_from(MARKS), st.booleans()).map(
        lambda f: as_json(IMAGES, {**VALID[IMAGES], f[0]: marked((WORDS[f[0]], f[1], f[2]))})),
    st.sampled_from(["", [""], ["\n", ""], [""] * 3]).map(lambda s: as_json(CHAT, {**VALID[CHAT], "stop": s})),
    st.text(alphabet="\u05e9\u05d5\u0639\u0644\U0001f98a\u200f", min_size=1, max_size=8).map(
        lambda t: as_json(CHAT, {**VALID[CHAT], "messages": [{"role": t, "content": "x"}]})),
    st.tuples(st.sampled_from([IMAGES, CHAT]), st.text(min_size=1, max_size=24)).filter(  # a model not served: 404
        lambda rm: rm[1] not in ("llm", "diffusion") and not rm[1].startswith(("omniserve/", "embedded:"))).map(
        lambda rm: as_json(rm[0], {**VALID[rm[0]], "model": rm[1]})),
)


def nested(route: str, field: str, depth: int) -> tuple[str, str, bytes]:
    """The valid body with `field` a list nested `depth` deep, written by hand (json.dumps stops at ~1000)."""
    rest = json.dumps({k: v for k, v in VALID[route].items() if k != field})
    return route, "application/json", f'{rest[:-1]}, "{field}": {"[" * depth}0.5{"]" * depth}}}'.encode()


STRUCTURE_BODIES = st.one_of(
    st.tuples(st.sampled_from(["prompt", "latents", "sigmas", "seed", "n"]), st.integers(2, 5000)).map(
        lambda f: nested(IMAGES, *f)),
    st.tuples(st.sampled_from(["messages", "stop", "top_k"]), st.integers(2, 5000)).map(lambda f: nested(CHAT, *f)),
    st.tuples(st.sampled_from([IMAGES, CHAT]), st.sampled_from([None, 1, "x", [], [1], True, 2.5])).map(
        lambda rv: (rv[0], "application/json", json.dumps(rv[1]).encode())),
)


def truncated(route: str) -> st.SearchStrategy:
    raw = json.dumps(VALID[route]).encode()
    return st.integers(0, len(raw) - 1).map(lambda k: (route, "application/json", raw[:k]))


def duplicated(route: str) -> st.SearchStrategy:
    raw = json.dumps(VALID[route])
    return st.sampled_from(sorted(VALID[route])).map(
        lambda key: (route, "application/json", ("{" + json.dumps(key) + ": " + json.dumps(VALID[route][key]) + ", " + raw[1:]).encode()))


def not_utf8(route: str) -> st.SearchStrategy:
    raw = json.dumps(VALID[route]).encode()
    bad = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\xfe\xff"])
    return st.tuples(st.integers(0, len(raw)), bad).map(lambda t: (route, "application/json", raw[:t[0]] + t[1] + raw[t[0]:]))


CONTENT_TYPES = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/xml", "application/merge-patch+json", "application/json-seq", "text/json", "", None]


def wrong_content_type(route: str) -> st.SearchStrategy:
    raw = json.dumps(VALID.get(route, VALID[IMAGES])).encode()
    types = [t for t in CONTENT_TYPES if t != "multipart/form-data; boundary=x" or route != EDITS] + (["application/json"] if route == EDITS else [])
    return st.sampled_from(types).map(lambda t: (route, t, raw))


def edit_form(fields: dict, image: bytes | None) -> tuple[str, str, bytes]:
    """An edit as the openai client sends it: multipart, the image a file field (left out when None)."""
    files = None if image is None else {"image": ("in.png", image, "image/png")}
    fixed = {"Content-Type": "multipart/form-data; boundary=omniserve-fuzz"}  # the same bytes every run
    request = httpx.Request("POST", "http://fuzz/", data=fields, files=files, headers=fixed)
    return EDITS, request.headers["Content-Type"], request.read()


def png(side: int = 64) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (200, 80, 20)).save(buffer, format="PNG")
    return buffer.getvalue()


VALID_EDIT = {"prompt": "a red fox", "seed": "7", "num_inference_steps": "2", "enhance_prompt": "false"}
BAD_EDIT_FIELDS = st.one_of(
    st.sampled_from([("n", "0"), ("n", "4.5"), ("n", "\u0662"), ("strength", "2"), ("strength", "0"), ("strength", "0.2"),
                     ("seed", "seven"), ("seed", ["1", "2"]), ("size", "128x128"), ("guidance_scale", "nan"),
                     ("response_format", "link"), ("latents", "[[0.0]]"), ("mask", "x"), ("partial_images", "4")]),
    st.text(alphabet=INVISIBLE, max_size=8).map(lambda p: ("prompt", p)),
    st.lists(st.sampled_from(DIGITS), min_size=1, max_size=4).map(lambda zeros: ("size", foreign_size(zeros))),
    st.text(min_size=1, max_size=10).filter(lambda k: k.isascii() and k.isidentifier() and k not in ImageEditRequest.model_fields).map(
        lambda k: (k, "1")),
)
EDIT_BODIES = st.one_of(
    BAD_EDIT_FIELDS.map(lambda kv: edit_form({**VALID_EDIT, kv[0]: kv[1]}, png())),
    st.sampled_from(["prompt", "image"]).map(  # a required part left out
        lambda gone: edit_form({k: v for k, v in VALID_EDIT.items() if k != gone}, None if gone == "image" else png())),
    st.binary(min_size=0, max_size=64).map(lambda junk: edit_form(VALID_EDIT, junk)),
)

RAW_BODIES = st.one_of(
    *[strategy(route) for route in (IMAGES, CHAT) for strategy in (truncated, duplicated, not_utf8)],
    *[wrong_content_type(route) for route in (IMAGES, CHAT, EDITS)],
)


def oversized() -> list[tuple[str, str | None, bytes | list[bytes]]]:
    """A few bodies over their route's limit: declared by their length, and one sent in chunks (no length)."""
    cases = []
    for route in (IMAGES, CHAT):
        raw = json.dumps({**VALID[route], "user": "u" * BODY_RULES[route].max_bytes}).encode()
        cases.append((route, "application/json", raw))
    cases.append((CHAT, "application/json", [raw[i:i + 2**16] for i in range(0, len(raw), 2**16)]))
    return cases


def draw(strategy: st.SearchStrategy, count: int) -> list:
    """`count` examples of `strategy` through hypothesis' own runner, derandomized: the same ones every run."""
    found = []

    @settings(max_examples=count, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        found.append(case)

    collect()
    return found


def bad_bodies() -> list[tuple[str, str | None, bytes | list[bytes]]]:
    return [
        *draw(schema_bodies(IMAGES), 350), *draw(schema_bodies(CHAT), 350),
        *draw(UNICODE_BODIES, 150), *draw(STRUCTURE_BODIES, 80), *draw(RAW_BODIES, 200), *draw(EDIT_BODIES, 60),
        *oversized(),
    ]


# --- the app and the load ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(server):
    return server  # the package's app, "/" (tests/orchestration/conftest.py)


async def chunks(parts: list[bytes]):
    for part in parts:  # httpx sends an async iterable chunked, without Content-Length
        yield part


async def send_all(url: str, cases: list) -> list[tuple[int, str]]:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(route: str, content_type: str | None, raw: bytes | list[bytes]) -> tuple[int, str]:
            headers = {} if content_type is None else {"Content-Type": content_type}
            content = raw if isinstance(raw, bytes) else chunks(raw)
            async with gate:
                try:
                    response = await client.post(route, content=content, headers=headers)
                except httpx.TransportError as err:
                    return 0, f"no answer: {err!r}"
            return response.status_code, response.text

        return await asyncio.gather(*(one(*case) for case in cases))


def openai_error_message(text: str) -> str:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return ""
    return error.get("message") or "" if isinstance(error, dict) else ""


def test_every_generated_bad_body_is_a_4xx_with_a_message_and_the_app_still_serves(app):
    cases = bad_bodies()
    assert len(cases) >= 1000, len(cases)
    started = time.monotonic()
    answers = asyncio.run(send_all(app, cases))
    elapsed = time.monotonic() - started
    wrong = [(case[0], case[1], bytes(case[2][:120]) if isinstance(case[2], bytes) else "chunks", status, text[:200])
             for case, (status, text) in zip(cases, answers)
             if not 400 <= status < 500 or not openai_error_message(text)]
    statuses = sorted({status for status, _ in answers})
    print(f"{len(cases)} bad bodies in {elapsed:.1f} s; statuses {statuses}")
    assert not wrong, f"{len(wrong)} of {len(cases)} answered wrong: {wrong[:8]}"

    with httpx.Client(base_url=app, timeout=120) as client:
        image = client.post(IMAGES, json={**VALID[IMAGES], "enhance_prompt": True})
        chat = client.post(CHAT, json=VALID[CHAT])
    assert image.status_code == 200 and image.json()["data"][0]["seed"] == 7, image.text
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text
