"""Order 5: each publisher session's messages keep their publish order in the total order,
although its batches travel through every broker."""

from __future__ import annotations

import threading

import pytest

import embarcadero
from embarcadero import Admin, Publisher, Subscriber

from helpers import parse, payload, read

SESSIONS = 3
COUNT = 3000


def test_order5_sessions_are_fifo_across_brokers(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=5)
    stats = {}

    def publish(source: int) -> None:
        # Small batches over 4 brokers x 2 connections: consecutive batches of one session
        # take different paths and can arrive out of order; order 5 must restore it.
        with Publisher(
            server.control,
            topic_name,
            batch_bytes=1024,
            threads_per_broker=2,
            session_key=embarcadero.random_session_key(),
        ) as p:
            for i in range(0, COUNT, 100):
                p.publish_many([payload(source, j) for j in range(i, i + 100)])
        stats[source] = p.stats()

    threads = [threading.Thread(target=publish, args=(s,)) for s in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    brokers_used = {q["broker"] for s in stats.values() for q in s["queues"] if q["batches"]}
    assert len(brokers_used) == 4, "each session's batches went through every broker"

    first = read(Subscriber(server.control, topic_name), SESSIONS * COUNT)
    second = read(Subscriber(server.control, topic_name), SESSIONS * COUNT)
    assert [parse(m) for m in first] == [parse(m) for m in second], "one order"
    for source in range(SESSIONS):
        seqs = [seq for (s, seq) in map(parse, first) if s == source]
        assert seqs == list(range(COUNT)), f"session {source} in publish order, exactly once"
    by_session = {}
    for m in first:
        by_session.setdefault(m.client_id, []).append(m.batch_seq)
    for client, batch_seqs in by_session.items():
        assert batch_seqs == sorted(batch_seqs), f"session {client}'s batches in sequence"


def test_a_second_publisher_of_a_session_takes_it_over(server, topic_name):
    """Two publishers with one client id and session key (a restarted program whose first
    run still lives): the second opens the next epoch, and the first stops with
    SessionTakenOver instead of publishing beside it; every acknowledged message is read once."""
    Admin(server.control).create_topic(topic_name, order=5)
    key = embarcadero.random_session_key()
    first = Publisher(server.control, topic_name, client_id=77, session_key=key)
    first.publish_many([b"first 0", b"first 1"])
    first.flush()
    with Publisher(server.control, topic_name, client_id=77, session_key=key) as second:
        assert (first.stats()["session_epoch"], second.stats()["session_epoch"]) == (1, 2)
        second.publish(b"second 0")
        second.flush()
        with pytest.raises(embarcadero.BrokerError) as taken:
            first.publish(b"late")
            first.flush()
        assert taken.value.code == "SessionTakenOver"
        assert "took this order-5 session over" in str(taken.value)
        second.publish(b"second 1")
    # Closed by hand: collected open, it would warn that its close failed.
    with pytest.raises(embarcadero.BrokerError, match="SessionTakenOver"):
        first.close()
    got = read(Subscriber(server.control, topic_name), 4)
    assert [m.payload for m in got] == [b"first 0", b"first 1", b"second 0", b"second 1"]
