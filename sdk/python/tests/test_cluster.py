"""Cluster mode: a follower broker SIGKILLed while a publisher is publishing, and every
message still delivered exactly once (the publisher fails over to the live brokers and
resends exactly the batches the head says did not make it into the order)."""

from __future__ import annotations

import threading

from embarcadero import Admin, Publisher, Subscriber

from conftest import wait_for
from helpers import parse, payload, read

# Published before the kill (at least), and after it.
BEFORE = 10_000
AFTER = 10_000


def test_a_follower_killed_under_load_loses_and_duplicates_nothing(cluster, topic_name):
    control = cluster.control
    Admin(control).create_topic(topic_name, order=2, memory_only=True)
    published = 0
    killed = threading.Event()
    result = {}

    def publish() -> None:
        # Publishes without pause until the kill, so it lands with batches in flight, and
        # AFTER more messages once it happened.
        nonlocal published
        try:
            with Publisher(control, topic_name, batch_bytes=8192) as p:
                stop_at = None
                while stop_at is None or published < stop_at:
                    batch = [payload(0, j, 100) for j in range(published, published + 100)]
                    p.publish_many(batch)
                    published += 100
                    if stop_at is None and killed.is_set():
                        stop_at = published + AFTER
            result["stats"] = p.stats()
        except BaseException as e:  # reported by the test thread below
            result["error"] = e

    publisher = threading.Thread(target=publish)
    publisher.start()
    wait_for("messages published", lambda: published >= BEFORE or not publisher.is_alive())
    # The victim's address from the head before the kill (as the TypeScript suite does), not
    # by its absence from the broker list afterwards: on a loaded machine the publisher can
    # finish before the head has dropped the killed follower.
    victim_addr = next(b["addr"] for b in Admin(control).cluster()["brokers"] if b["id"] == 2)
    cluster.followers[2].kill()
    killed.set()
    publisher.join(timeout=120)
    assert not publisher.is_alive(), "the publisher finished after the kill"
    assert "error" not in result, f"the publisher failed: {result.get('error')!r}"
    stats = result["stats"]
    COUNT = published
    assert stats["messages"] == COUNT
    assert stats["acked_batches"] == stats["batches"], "every batch acknowledged"
    victim = [q for q in stats["queues"] if q["batches"] and q["broker"] == victim_addr]
    assert victim, "the killed broker had been given batches"

    assert Admin(control).describe_topic(topic_name)["next_position"] == COUNT, "no duplicates"
    first = read(Subscriber(control, topic_name), COUNT)
    assert sorted(parse(m)[1] for m in first) == list(range(COUNT)), "each message once"
    second = read(Subscriber(control, topic_name), COUNT)
    assert [parse(m) for m in first] == [parse(m) for m in second], "one order"
