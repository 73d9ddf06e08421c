"""The transport choice (``transport="auto" | "tcp" | "shm"``, the Rust client's ``Transport``)
for publishers and subscribers against real servers: ``shm`` publishes and reads over shared
memory where the server offers it, ``tcp`` never does, ``auto`` takes shared memory when
offered and falls back to TCP when not (where ``shm`` is refused); and a subscriber from the
beginning of a topic whose start was reclaimed is told what it skipped."""

from __future__ import annotations

import sys
from typing import Iterator, List, Tuple

import pytest

import embarcadero
from embarcadero import Admin, Publisher, Subscriber

from conftest import Server
from helpers import read

# Shared-memory channels need Linux (memfd, futex); elsewhere the server offers none.
needs_shm = pytest.mark.skipif(sys.platform != "linux", reason="shared memory needs Linux")

# The Rust test's tiny region (crates/server/tests/memory.rs): 1 MiB of log memory per broker.
TINY = """
[region]
max_topics = 8
segment_bytes = 262144
segments_per_broker = 4

[broker]
max_batch_bytes = 131072
max_message_bytes = 16384
"""


@pytest.fixture
def no_shm_server() -> Iterator[Server]:
    s = Server(config="[broker]\nshm = false\n")
    yield s
    s.stop()


@pytest.fixture
def tiny_server() -> Iterator[Server]:
    s = Server(config=TINY)
    yield s
    s.stop()


def publish_over(control: str, topic: str, transport: str, count: int) -> List[str]:
    """Publishes m0..m{count-1} over `transport`; the transports its queues got."""
    with Publisher(control, topic, transport=transport, batch_bytes=4096) as p:
        used = [q["transport"] for q in p.stats()["queues"]]
        assert p.publish_many(f"m{i}" for i in range(count)) == count
    return used


def read_over(control: str, topic: str, transport: str, count: int) -> Tuple[str, List[bytes]]:
    """Reads m0..m{count-1}, each once (order 2 keeps each connection's order, not the
    publisher's across brokers), at positions 0..count-1, over `transport`: the transport the
    connection used, and the payloads in the order read."""
    with Subscriber(control, topic, transport=transport) as sub:
        over = sub.transport
        got = read(sub, count)
    payloads = [m.payload for m in got]
    assert sorted(payloads) == sorted(f"m{i}".encode() for i in range(count)), "each once"
    assert [m.global_seq for m in got] == list(range(count))
    return over, payloads


@needs_shm
def test_shm_publishes_and_reads_over_shared_memory_in_order(server, topic_name):
    Admin(server.control).create_topic(topic_name, memory_only=True)
    used = publish_over(server.control, topic_name, "shm", 3000)
    assert used and all(t == "shm" for t in used), used
    over, order = read_over(server.control, topic_name, "shm", 3000)
    assert over == "shm"
    # The same topic over TCP reads the same order.
    assert read_over(server.control, topic_name, "tcp", 3000) == ("tcp", order)


@needs_shm
def test_auto_takes_shared_memory_where_offered_and_tcp_never_does(server, topic_name):
    Admin(server.control).create_topic(topic_name, memory_only=True)
    assert all(t == "shm" for t in publish_over(server.control, topic_name, "auto", 10))
    assert all(t == "tcp" for t in publish_over(server.control, topic_name, "tcp", 10))
    with Subscriber(server.control, topic_name) as sub:
        assert sub.transport == "shm", "auto is the default"


def test_auto_falls_back_to_tcp_without_shared_memory_and_shm_is_refused(no_shm_server, topic_name):
    control = no_shm_server.control
    Admin(control).create_topic(topic_name, memory_only=True)
    used = publish_over(control, topic_name, "auto", 500)
    assert used and all(t == "tcp" for t in used), used
    assert read_over(control, topic_name, "auto", 500)[0] == "tcp"
    with pytest.raises(embarcadero.ConnectError):
        Publisher(control, topic_name, transport="shm")
    with pytest.raises(embarcadero.ConnectError):
        Subscriber(control, topic_name, transport="shm")


def test_an_unknown_transport_is_a_config_error_naming_the_choices(server, topic_name):
    Admin(server.control).create_topic(topic_name, memory_only=True)
    with pytest.raises(embarcadero.ConfigError, match="auto, tcp or shm"):
        Publisher(server.control, topic_name, transport="udp")
    with pytest.raises(embarcadero.ConfigError, match="auto, tcp or shm"):
        Subscriber(server.control, topic_name, transport="udp")


def test_a_subscriber_from_the_beginning_is_told_what_was_reclaimed(tiny_server, topic_name):
    control = tiny_server.control
    admin = Admin(control)
    admin.create_topic(topic_name, memory_only=True)
    n = 12_000  # ~12 MB through 4 MiB of log memory
    with Publisher(control, topic_name, batch_bytes=32 * 1024) as p:
        for _ in range(0, n, 500):
            p.publish_many([b"\x04" * 1000] * 500)
    assert admin.describe_topic(topic_name)["next_position"] == n
    # An explicit position that is gone is refused, not waited for.
    with Subscriber(control, topic_name, start=0) as from_zero:
        with pytest.raises(embarcadero.BrokerError) as e:
            from_zero.poll(timeout=10)
        assert e.value.code == "PositionNotRetained"
        assert from_zero.skipped is None, "a given start skips nothing: it is refused"
    # From the beginning: told on connecting, before any message.
    with Subscriber(control, topic_name) as sub:
        skipped = sub.skipped
        assert skipped is not None, "the skipped range is told"
        first, to = skipped
        assert first == 0 and 0 < to < n, skipped
        rest = read(sub, n - to)
        assert [m.global_seq for m in rest] == list(range(to, n)), "every retained message"
        assert sub.poll(timeout=0.2) is None
        assert sub.skipped == skipped
        # Back to the start: the first message still retained, not the gone position 0.
        for start in ("start", None):
            sub.seek(start)
            again = read(sub, n - to)
            assert [m.global_seq for m in again] == list(range(to, n)), start
    # Nothing reclaimed: nothing skipped.
    admin.create_topic(f"{topic_name}-whole", memory_only=True)
    with Publisher(control, f"{topic_name}-whole") as p:
        p.publish(b"one")
    with Subscriber(control, f"{topic_name}-whole") as sub:
        assert read(sub, 1)[0].payload == b"one"
        assert sub.skipped is None
