"""`Subscriber.poll_batch`: a poll's messages handed over whole, against a real server."""

from __future__ import annotations

import asyncio
from typing import List

import pytest

from embarcadero import Admin, ClosedError, ConfigError, MessageBatch, Publisher, Subscriber

from helpers import LoopTicker, parse, payload, publish_numbered, read


def batches(sub: Subscriber, count: int, timeout: float = 30.0) -> List[MessageBatch]:
    """Batches from `sub` until they hold `count` messages; fails if one poll times out."""
    got: List[MessageBatch] = []
    while sum(len(b) for b in got) < count:
        batch = sub.poll_batch(timeout=timeout)
        assert len(batch) > 0, f"no batch within {timeout} s after {sum(map(len, got))}"
        got.append(batch)
    return got


@pytest.mark.parametrize("order", [0, 2])
def test_batches_hold_every_message_once_in_the_order_poll_gives(server, topic_name, order):
    # The same topic read twice: one message at a time, and a batch at a time. The batches
    # give the same messages with the same fields in the same order, and their sizes,
    # payloads and totals agree with the messages'.
    Admin(server.control).create_topic(topic_name, order=order)
    count = 5000
    with Publisher(server.control, topic_name) as p:
        p.publish_many([payload(0, i, size=100 + i % 900) for i in range(count)])
    one_by_one = read(Subscriber(server.control, topic_name), count)
    got = batches(Subscriber(server.control, topic_name), count)
    assert len(got) > 1, "5000 messages of up to 1 KiB come in more than one poll"
    messages = [m for b in got for m in b]
    fields = lambda m: (m.position, m.broker_id, m.client_id, m.batch_seq, m.payload)  # noqa: E731
    assert [fields(m) for m in messages] == [fields(m) for m in one_by_one]
    for b in got:
        assert [b.size(i) for i in range(len(b))] == [len(m.payload) for m in b]
        assert b.payloads() == [m.payload for m in b]
        assert [b.payload(i) for i in range(len(b))] == b.payloads()
        assert b.payload_bytes == sum(len(p) for p in b.payloads())
        assert b[-1].position == b[len(b) - 1].position and b[0].position == next(iter(b)).position
        # Slices as a list's: messages with the same fields as those iterated.
        listed = [(m.position, m.payload) for m in b]
        for cut in (slice(None), slice(1, 3), slice(None, None, -2), slice(-3, None), slice(5, 2)):
            assert [(m.position, m.payload) for m in b[cut]] == listed[cut]
    assert sorted(parse(m) for m in messages) == [(0, i) for i in range(count)]


def test_a_batch_is_the_rest_of_a_poll_partly_taken_and_moves_the_position(server, topic_name):
    # Messages taken one at a time first: the batch starts with the next, none skipped or
    # repeated, and the position is past the batch as soon as it is taken.
    Admin(server.control).create_topic(topic_name, order=2)
    publish_numbered(server.control, topic_name, 300)
    sub = Subscriber(server.control, topic_name)
    assert [m.global_seq for m in read(sub, 3)] == [0, 1, 2]
    seen = 3
    while seen < 300:
        batch = sub.poll_batch(timeout=30)
        assert [m.global_seq for m in batch] == list(range(seen, seen + len(batch)))
        seen += len(batch)
        assert sub.position == seen
    assert sub.poll(timeout=0.1) is None


def test_a_batch_outlives_later_polls_and_its_subscriber(server, topic_name):
    # A batch keeps its deliveries: read after thousands more messages have been polled
    # into the subscriber's reused buffers, and after the subscriber is closed, its
    # payloads are still those published.
    Admin(server.control).create_topic(topic_name, order=2)
    count = 20_000
    publish_numbered(server.control, topic_name, count, size=1024)
    sub = Subscriber(server.control, topic_name)
    first = sub.poll_batch(timeout=30)
    # What the batch read when it came (the total order interleaves the publisher's
    # batches to different brokers, so its numbers are not 0, 1, 2...).
    numbers = [parse(m)[1] for m in first]
    rest = batches(sub, count - len(first))
    sub.close()
    assert sum(len(b) for b in rest) == count - len(first)
    assert [first.payload(i) for i in range(len(first))] == [
        payload(0, n, size=1024) for n in numbers
    ]
    assert [parse(m)[1] for m in first] == numbers


def test_an_empty_batch_when_the_time_runs_out_and_bad_indexes_are_index_errors(
    server, topic_name
):
    Admin(server.control).create_topic(topic_name, order=2)
    sub = Subscriber(server.control, topic_name)
    empty = sub.poll_batch(timeout=0.05)
    assert len(empty) == 0 and not empty and list(empty) == [] and empty.payload_bytes == 0
    publish_numbered(server.control, topic_name, 5)
    got = batches(sub, 5)
    last = got[-1]
    for bad in (len(last), -len(last) - 1, 10**6):
        with pytest.raises(IndexError, match="of a batch of"):
            last[bad]
        with pytest.raises(IndexError):
            last.size(bad)
    # Past any length, as a list says; not an index at all, a TypeError.
    for call in (lambda: last[2**70], lambda: last.size(2**70), lambda: last.payload(-(2**70))):
        with pytest.raises(IndexError, match="index-sized integer"):
            call()
    with pytest.raises(TypeError):
        last["0"]
    assert "MessageBatch(" in repr(last)
    sub.close()
    with pytest.raises(ClosedError):
        sub.poll_batch(timeout=0.1)


def test_poll_batch_async_waits_without_blocking_the_loop_and_reads_on_after_a_cancel(
    server, topic_name
):
    Admin(server.control).create_topic(topic_name, order=2)
    sub = Subscriber(server.control, topic_name)

    async def main() -> List[int]:
        ticker = LoopTicker()
        # Nothing published yet: a cancelled wait, then an empty batch at its timeout,
        # while the loop's other task runs on.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sub.poll_batch_async(), 0.05)
        assert len(await sub.poll_batch_async(timeout=0.05)) == 0
        assert ticker.ticks >= 3
        with Publisher(server.control, topic_name) as p:
            p.publish_many(payload(0, i) for i in range(400))
        seqs: List[int] = []
        while len(seqs) < 400:
            batch = await asyncio.wait_for(sub.poll_batch_async(timeout=30), 60)
            assert len(batch) > 0
            seqs.extend(parse(m)[1] for m in batch)
        ticker.cancel()
        return seqs

    assert asyncio.run(main()) == list(range(400))


def test_poll_batch_async_cancelled_again_and_again_keeps_the_order(server, topic_name):
    # Everything is published first; then each read is cancelled after half a millisecond,
    # so most are cancelled while their poll still runs in the executor, and the next call
    # polls beside it. The messages still come once each, in the topic's order.
    Admin(server.control).create_topic(topic_name, order=2)
    count = 100_000
    publish_numbered(server.control, topic_name, count, size=256)
    sub = Subscriber(server.control, topic_name)

    async def main() -> List[int]:
        seqs: List[int] = []
        while len(seqs) < count:
            try:
                batch = await asyncio.wait_for(sub.poll_batch_async(timeout=5), 0.0005)
            except asyncio.TimeoutError:
                continue
            seqs.extend(m.global_seq for m in batch)
        return seqs

    assert asyncio.run(asyncio.wait_for(main(), 120)) == list(range(count))


def test_poll_batch_async_refuses_the_timeouts_poll_batch_refuses(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2)
    sub = Subscriber(server.control, topic_name)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            sub.poll_batch(timeout=bad)
        with pytest.raises(ConfigError):
            asyncio.run(sub.poll_batch_async(timeout=bad))

