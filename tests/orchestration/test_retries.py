"""The ingress's retries (orchestration/retries.py): bounded by time, not by count, with exponential, jittered waits.

A fake clock stands in for time here (the waits are the subject, not something to sit through); the real thing, a
replica SIGKILLed under load, is tests/reliability/test_replica_loss.py.
"""

import asyncio
import types

import pytest
from ray.exceptions import ActorUnavailableError
from ray.serve.exceptions import ReplicaUnavailableError

import orchestration.retries as retries
from contracts.config import IngressConfig
from orchestration.retries import MAX_BACKOFF_S, Retrying


@pytest.fixture
def clock(monkeypatch):
    """A monotonic clock that moves only when the code under test sleeps."""
    now = types.SimpleNamespace(t=0.0, waits=[])

    async def sleep(seconds: float) -> None:
        now.waits.append(seconds)
        now.t += seconds

    monkeypatch.setattr(retries, "time", types.SimpleNamespace(monotonic=lambda: now.t))
    monkeypatch.setattr(retries, "asyncio", types.SimpleNamespace(sleep=sleep))
    return now


def failing_until(clock, recovered_at: float, failure=lambda: ReplicaUnavailableError("its replica died")):
    sent = []

    async def send():
        sent.append(clock.t)
        if clock.t < recovered_at:
            raise failure()
        return "rendered"

    return send, sent


def test_a_stage_that_stays_unavailable_longer_than_any_count_of_retries_allowed_is_waited_for_within_the_window(clock):
    # 30 s without a live replica: the counted retries (4 attempts, 3 s) gave a 503 here; the window outlasts it.
    send, sent = failing_until(clock, recovered_at=30.0)
    retrying = Retrying(IngressConfig().retry_window_s, IngressConfig().retry_backoff_s)
    assert asyncio.run(retrying.call("a render", send)) == "rendered"
    assert clock.t >= 30.0 and retrying.retried == len(sent) - 1 > 4


def test_past_the_window_the_last_failure_is_raised_and_no_wait_outlasts_it(clock):
    send, sent = failing_until(clock, recovered_at=float("inf"))
    retrying = Retrying(5.0, 0.25, jitter=lambda: 0.999)
    with pytest.raises(ReplicaUnavailableError):
        asyncio.run(retrying.call("a render", send))
    assert sent[-1] <= 5.0 and len(sent) >= 4  # 0.25, 0.5, 1, 2 (capped), ... all sent within the window
    assert sum(clock.waits) <= 5.0


def test_the_waits_double_from_the_backoff_up_to_the_cap_each_between_half_and_all_of_it():
    low, high = Retrying(60, 0.25, jitter=lambda: 0.0), Retrying(60, 0.25, jitter=lambda: 0.999999)
    assert [low.wait_s(r) for r in (1, 2, 3, 4, 5, 6)] == [0.125, 0.25, 0.5, 1.0, MAX_BACKOFF_S / 2, MAX_BACKOFF_S / 2]
    assert [round(high.wait_s(r), 4) for r in (1, 2, 3, 4, 5)] == [0.25, 0.5, 1.0, 2.0, MAX_BACKOFF_S]


def test_a_client_error_is_raised_at_once_and_never_sent_again(clock):
    send, sent = failing_until(clock, float("inf"), failure=lambda: ValueError("a refusal"))
    with pytest.raises(ValueError):
        asyncio.run(Retrying(60, 0.25).call("a render", send))
    assert len(sent) == 1 and clock.waits == []


def test_a_window_of_zero_never_sends_again(clock):
    send, sent = failing_until(clock, float("inf"), failure=lambda: ActorUnavailableError("gone", None))
    with pytest.raises(ActorUnavailableError):
        asyncio.run(Retrying(0, 0.25).call("a render", send))
    assert len(sent) == 1


def test_a_stream_is_sent_again_only_while_nothing_has_come_unless_it_restarts(clock):
    calls = []

    async def items():
        calls.append(1)
        yield "preview"
        if len(calls) < 3:
            raise ReplicaUnavailableError("its replica died")
        yield "image"

    async def collect(restart: bool) -> list[str]:
        return [item async for item in Retrying(60, 0.25).stream("a render", items, restart=restart)]

    with pytest.raises(ReplicaUnavailableError):
        asyncio.run(collect(restart=False))  # a preview went out: a second attempt would repeat it
    calls.clear()
    assert asyncio.run(collect(restart=True)) == ["preview"] * 3 + ["image"]


def test_a_stream_whose_last_item_came_is_answered_even_if_its_replica_dies_before_its_end(clock):
    # The replica-loss loop's one 503: the image had come, then the end of its stream failed with the replica.
    async def items():
        yield "image"
        raise ReplicaUnavailableError("its replica died after its last item")

    async def collect() -> list[str]:
        stream = Retrying(60, 0.25).stream("a render", items, last=lambda item: item == "image")
        return [item async for item in stream]

    assert asyncio.run(collect()) == ["image"]
