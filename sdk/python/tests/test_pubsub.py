"""Publishing and subscribing at every order and ack level against a real server."""

from __future__ import annotations

import asyncio
import threading

import pytest

import embarcadero
from embarcadero import Admin, Publisher, Subscriber

from helpers import LoopTicker, parse, payload, publish_numbered, read

COUNT = 2000


@pytest.mark.parametrize("order", [0, 1, 2, 5])
def test_every_order_delivers_each_message_once_with_its_fields(server, topic_name, order):
    Admin(server.control).create_topic(topic_name, order=order)
    with Publisher(server.control, topic_name, batch_bytes=4096) as p:
        assert p.publish_many(payload(0, i) for i in range(COUNT)) == COUNT
        p.flush()
    stats = p.stats()
    assert stats["messages"] == COUNT and stats["acked_batches"] == stats["batches"]
    assert p.closed
    sub = Subscriber(server.control, topic_name)
    assert sub.order == order
    got = read(sub, COUNT)
    assert sorted(parse(m)[1] for m in got) == list(range(COUNT))
    assert {m.client_id for m in got} == {p.client_id}
    if order >= 2:
        assert [m.global_seq for m in got] == list(range(COUNT))
        assert all(m.broker_seq is None for m in got)
        assert sub.position == COUNT
    else:
        assert all(m.global_seq is None for m in got)
        for broker in {m.broker_id for m in got}:
            seqs = [m.broker_seq for m in got if m.broker_id == broker]
            assert seqs == list(range(len(seqs))), "each broker's log from 0, in order"
        assert sum(sub.position) == COUNT
    if order in (1, 2, 5):
        # One publisher's messages through one broker keep their order (FIFO per broker).
        for broker in {m.broker_id for m in got}:
            ids = [parse(m)[1] for m in got if m.broker_id == broker]
            assert ids == sorted(ids)
    assert sub.poll(timeout=0) is None
    sub.close()


@pytest.mark.parametrize("ack", [0, 1, 2])
def test_every_ack_level_on_a_replicated_topic(server, topic_name, ack):
    Admin(server.control).create_topic(topic_name, order=2, rf=2)
    p = Publisher(server.control, topic_name, ack_level=ack, batch_bytes=8192)
    for i in range(COUNT):
        p.publish(payload(0, i))
    p.flush()
    stats = p.close()
    assert stats["messages"] == COUNT
    got = read(Subscriber(server.control, topic_name), COUNT)
    assert sorted(parse(m)[1] for m in got) == list(range(COUNT)), "each message once"
    assert [m.global_seq for m in got] == list(range(COUNT))


def test_ack_2_on_a_memory_only_topic_is_refused_by_the_broker(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2, memory_only=True)
    with pytest.raises(embarcadero.EmbarcaderoError):
        p = Publisher(server.control, topic_name, ack_level=2)
        p.publish(b"x")
        p.flush()


def test_two_subscribers_see_one_order_of_concurrent_publishers(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2)

    def publish(source: int) -> None:
        with Publisher(server.control, topic_name, batch_bytes=2048) as p:
            p.publish_many([payload(source, i) for i in range(COUNT)])

    threads = [threading.Thread(target=publish, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    # The first subscriber reads while they publish.
    first = read(Subscriber(server.control, topic_name), 3 * COUNT)
    for t in threads:
        t.join()
    second = read(Subscriber(server.control, topic_name), 3 * COUNT)
    assert [parse(m) for m in first] == [parse(m) for m in second]
    assert [m.global_seq for m in first] == list(range(3 * COUNT))
    assert sorted(parse(m) for m in first) == [(s, i) for s in range(3) for i in range(COUNT)]


def test_payload_types_start_seek_and_position(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2)
    with Publisher(server.control, topic_name) as p:
        p.publish(b"bytes")
        p.publish("str é")
        p.publish(bytearray(b"bytearray"))
        p.publish_many(iter([b"a", "b", bytearray(b"c")]))
        with pytest.raises(TypeError, match="bytes, bytearray or str"):
            p.publish(42)  # type: ignore[arg-type]
    expected = [b"bytes", "str é".encode(), b"bytearray", b"a", b"b", b"c"]
    sub = Subscriber(server.control, topic_name)
    assert [m.payload for m in read(sub, 6)] == expected
    sub.seek(2)
    assert sub.position == 2
    assert sub.poll(timeout=10).payload == b"bytearray"
    assert sub.position == 3
    assert [m.payload for m in Subscriber(server.control, topic_name, start=4).poll_many(10)] == [
        b"b",
        b"c",
    ]
    at_end = Subscriber(server.control, topic_name, start="end")
    assert at_end.position == 6
    with Publisher(server.control, topic_name) as p:
        p.publish(b"after")
    assert at_end.poll(timeout=10).payload == b"after"
    with pytest.raises(embarcadero.ConfigError, match="cannot be negative"):
        Subscriber(server.control, topic_name, start=-1)
    with pytest.raises(embarcadero.ConfigError, match="positions are global"):
        sub.seek([0, 0, 0, 0])


def test_per_broker_positions_for_order_1(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=1)
    with Publisher(server.control, topic_name, batch_bytes=1024) as p:
        p.publish_many(payload(0, i) for i in range(400))
    sub = Subscriber(server.control, topic_name)
    got = read(sub, 400)
    ends = sub.position
    assert isinstance(ends, list) and len(ends) == 4 and sum(ends) == 400
    again = Subscriber(server.control, topic_name, start=ends)
    assert again.poll(timeout=0.2) is None
    assert Subscriber(server.control, topic_name, start="end").position == ends
    with pytest.raises(embarcadero.ConfigError, match="per broker"):
        Subscriber(server.control, topic_name, start=5)
    replay = Subscriber(server.control, topic_name, start=[0, 0, 0, 0])
    assert sorted(parse(m) for m in read(replay, 400)) == sorted(parse(m) for m in got)


def test_async_for_reads_in_order_without_blocking_the_loop(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2)

    async def main() -> list:
        ticker = LoopTicker()
        sub = Subscriber(server.control, topic_name)
        got = []

        async def consume() -> None:
            async for m in sub:
                got.append(m)
                if len(got) == 500:
                    return

        consumer = asyncio.create_task(consume())
        # The loop keeps running (the ticker ticks) while the subscriber waits for data.
        while ticker.ticks < 5:
            await asyncio.sleep(0.01)
        with Publisher(server.control, topic_name) as p:
            p.publish_many(payload(0, i) for i in range(500))
        await asyncio.wait_for(consumer, timeout=60)
        ticker.cancel()
        return got

    got = asyncio.run(main())
    assert [parse(m)[1] for m in got] == list(range(500))


def test_a_cancelled_async_read_loses_no_message(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2)
    sub = Subscriber(server.control, topic_name)

    async def next_within(timeout: float):
        return await asyncio.wait_for(sub.__anext__(), timeout)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(next_within(0.05))
    with Publisher(server.control, topic_name) as p:
        p.publish_many(payload(0, i) for i in range(10))
    got = [asyncio.run(next_within(30)) for _ in range(10)]
    assert [parse(m)[1] for m in got] == list(range(10))


def test_async_with_flushes_a_publisher_and_closes_a_subscriber(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2)

    async def main() -> list:
        async with Publisher(server.control, topic_name, linger_ms=60_000.0) as p:
            # A linger longer than the test: only the close at the end of the block sends it.
            p.publish_many(payload(0, i) for i in range(10))
        assert p.closed and p.stats()["acked_batches"] >= 1
        async with Subscriber(server.control, topic_name) as sub:
            got = [await asyncio.wait_for(sub.__anext__(), 30) for _ in range(10)]
        assert sub.closed
        return got

    got = asyncio.run(main())
    assert [parse(m)[1] for m in got] == list(range(10))


def test_a_blocked_poll_lets_other_threads_run(server, topic_name):
    # The poll below waits for ever; were the GIL held while it waits, this thread could
    # never publish the message it waits for.
    Admin(server.control).create_topic(topic_name, order=2)
    sub = Subscriber(server.control, topic_name)
    got = []
    reader = threading.Thread(target=lambda: got.append(sub.poll()))
    reader.start()
    with Publisher(server.control, topic_name) as p:
        p.publish(b"while blocked")
    reader.join(timeout=60)
    assert not reader.is_alive() and got[0].payload == b"while blocked"


def test_seek_after_the_reader_filled_its_read_ahead(server, topic_name):
    # Rounds published one at a time while the subscriber's thread reads: each lands in a
    # poll of its own, so the thread fills its queue and then waits for room; a seek empties
    # the queue, and reading must go on from the new position.
    Admin(server.control).create_topic(topic_name, order=2)
    sub = Subscriber(server.control, topic_name)
    with Publisher(server.control, topic_name) as p:
        p.publish(payload(0, 0))
        p.flush()
        assert sub.poll(timeout=30).global_seq == 0
        for i in range(1, 200):
            p.publish(payload(0, i))
            if i % 10 == 0:
                p.flush()
    sub.seek(150)
    assert [m.global_seq for m in read(sub, 50, timeout=20)] == list(range(150, 200))
    sub.seek("end")
    assert sub.position == 200 and sub.poll(timeout=0.2) is None


def test_payloads_kept_from_early_polls_survive_later_polls(server, topic_name):
    # The binding now takes whole batch buffers from the Rust subscriber and copies each
    # payload out of them: a message kept from the first polls must still read as it was
    # published after thousands more messages, whose deliveries reuse those buffers once
    # their messages are taken.
    Admin(server.control).create_topic(topic_name, order=2)
    count = 20_000
    publish_numbered(server.control, topic_name, count, size=1024)
    sub = Subscriber(server.control, topic_name)
    kept = read(sub, 100)
    rest = read(sub, count - 100)
    assert sorted(parse(m) for m in kept + rest) == [(0, i) for i in range(count)]
    assert all(m.payload == payload(0, parse(m)[1], size=1024) for m in kept)
    assert all(len(m.payload) == 1024 for m in rest)


def test_position_is_the_next_message_wherever_it_lies_in_a_poll(server, topic_name):
    # A poll brings many messages (one record each, in the lent batches of that poll) and
    # Python takes them one at a time: the position is that of the first not taken, inside
    # a poll partly taken or at its edge, and the messages come in order across polls.
    Admin(server.control).create_topic(topic_name, order=2)
    count = 3000
    publish_numbered(server.control, topic_name, count, size=512)
    sub = Subscriber(server.control, topic_name)
    taken, seen = 0, []
    for stop in [1, 5, 999, 1000, 1001, 2500, count]:
        for m in read(sub, stop - taken, timeout=30):
            assert m.global_seq == taken
            seen.append(parse(m))
            taken += 1
        assert sub.position == stop
    assert sub.poll(timeout=0.1) is None and sub.position == count
    # The total order interleaves the publisher's batches to different brokers: each once.
    assert sorted(seen) == [(0, i) for i in range(count)]


def test_a_break_or_a_seek_inside_a_poll_neither_skips_nor_repeats_a_message(server, topic_name):
    # One poll brings many messages; those polled and not taken when a `break` out of `for`
    # comes are the next ones, and a `seek` drops them: none is skipped or repeated.
    Admin(server.control).create_topic(topic_name, order=2)
    publish_numbered(server.control, topic_name, 500)
    sub = Subscriber(server.control, topic_name)
    for m in sub:
        if m.global_seq == 9:
            break
    assert sub.position == 10
    assert next(sub).global_seq == 10, "a break keeps the messages polled after it"
    sub.seek(3)
    assert sub.position == 3
    assert [m.global_seq for m in read(sub, 5)] == [3, 4, 5, 6, 7]
    sub.seek(400)
    assert [m.global_seq for m in read(sub, 100)] == list(range(400, 500))
    assert sub.poll(timeout=0.1) is None and sub.position == 500


def test_seeks_from_another_thread_never_end_an_iteration(server, topic_name):
    # A seek clears what was polled and not taken; a reader between its wait and its take
    # must then wait again, not come back empty (which ends `for m in sub`).
    Admin(server.control).create_topic(topic_name, order=2)
    publish_numbered(server.control, topic_name, 2000)
    sub = Subscriber(server.control, topic_name)
    ended = {"by": "the iteration ending"}
    reading = threading.Event()

    def read_until_the_last() -> None:
        for m in sub:
            reading.set()
            if parse(m)[0] == 1:
                ended["by"] = "the last message"
                break

    reader = threading.Thread(target=read_until_the_last, daemon=True)
    reader.start()
    assert reading.wait(30)
    for _ in range(300):
        sub.seek(0)
    with Publisher(server.control, topic_name) as p:
        p.publish(payload(1, 0))
    reader.join(60)
    assert not reader.is_alive()
    assert ended["by"] == "the last message"
    sub.close()


def test_a_publisher_collected_open_still_sends_what_it_accepted_and_warns(server, topic_name):
    # `del` right after publishing: nothing is sealed yet (the linger is long), so before
    # the fix the collection discarded every message without a word.
    admin = Admin(server.control)
    admin.create_topic(topic_name, order=2)

    def publish_and_forget() -> None:
        p = Publisher(server.control, topic_name, linger_ms=60_000.0)
        assert p.publish_many(payload(0, i) for i in range(1000)) == 1000

    with pytest.warns(ResourceWarning, match="collected open: flushed and closed"):
        publish_and_forget()
    # The collection flushed and closed it before returning: every message is ordered.
    assert admin.describe_topic(topic_name)["next_position"] == 1000
