"""One ingress replica's drain (`orchestration.drain`), without Ray: Ray's internal KV stood in for by a dict.

Once the app process writes the flag, a new request is answered 503 `shutting_down` (Retry-After, Connection: close)
while the one admitted before runs to its end, and the replica reports itself drained only after it. The whole path,
SIGTERM to `make serve` under load, is tests/test_make_serve.py."""

import asyncio
import json

import pytest

from orchestration import drain
from orchestration.drain import DRAINED_PREFIX, DRAINING, Drain, DrainGate


@pytest.fixture
def kv(monkeypatch):
    store: dict[bytes, bytes] = {}
    monkeypatch.setattr(drain, "_kv_get", store.get)
    monkeypatch.setattr(drain, "_kv_put", store.__setitem__)
    return store


async def call(gate: DrainGate) -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    await gate({"type": "http", "method": "POST", "path": "/v1/images/generations"}, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_a_draining_replica_refuses_new_requests_answers_the_admitted_one_then_reports_drained(kv):
    async def scenario():
        release = asyncio.Event()

        async def app(scope, receive, send):  # a request that runs until released
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"image"})

        replica = Drain("r1")
        gate = DrainGate(app, replica)
        watching = asyncio.create_task(replica.watch())
        admitted = asyncio.create_task(call(gate))
        await asyncio.sleep(2 * drain.POLL_S)
        assert replica.in_flight == 1 and not replica.draining
        kv[DRAINING] = b"1"
        await asyncio.sleep(2 * drain.POLL_S)
        assert replica.draining
        status, headers, body = await call(gate)
        assert status == 503 and headers["retry-after"] == "5" and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "shutting_down"
        assert DRAINED_PREFIX + b"r1" not in kv  # the admitted request still runs
        release.set()
        assert await admitted == (200, {}, b"image")
        await asyncio.wait_for(watching, timeout=5)
        assert kv[DRAINED_PREFIX + b"r1"] == b"1" and replica.in_flight == 0

    asyncio.run(scenario())
