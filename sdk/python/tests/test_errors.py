"""Bad input raises the right exception, and nothing hangs: an unknown topic, a message over
the maximum, a closed publisher, a server that is gone, Ctrl-C in a blocking read."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import embarcadero
import embarcadero.workflow
from embarcadero import Admin, Publisher, Subscriber

from conftest import Server


def test_an_unknown_topic_is_refused(server, topic_name):
    with pytest.raises(embarcadero.EmbarcaderoError) as pub:
        p = Publisher(server.control, topic_name)
        p.publish(b"x")
        p.flush()
    with pytest.raises(embarcadero.BrokerError) as sub:
        Subscriber(server.control, topic_name)
    for e in (pub.value, sub.value):
        assert isinstance(e, embarcadero.BrokerError), repr(e)
        assert (e.code, e.code_number) == ("UnknownTopic", 3)
        assert str(e).startswith(f"broker {e.broker} refused: ")
        assert str(e).endswith("(UnknownTopic)")


def test_an_invalid_topic_name_is_refused_before_connecting(server):
    with pytest.raises(embarcadero.InvalidNameError, match="invalid topic name"):
        Publisher(server.control, "a?b")
    with pytest.raises(embarcadero.InvalidNameError):
        Subscriber(server.control, "")


def test_a_message_over_the_maximum_is_refused(server, topic_name):
    Admin(server.control).create_topic(topic_name)
    with Publisher(server.control, topic_name) as p:
        assert p.max_message_bytes == 1 << 20
        with pytest.raises(embarcadero.MessageTooLargeError) as e:
            p.publish(b"x" * (p.max_message_bytes + 1))
        assert (e.value.size, e.value.max) == (p.max_message_bytes + 1, p.max_message_bytes)
        assert str(e.value) == (
            f"message of {e.value.size} bytes exceeds the broker's maximum of {e.value.max} bytes"
        )
        with pytest.raises(embarcadero.MessageTooLargeError):
            p.publish_many([b"ok", b"x" * (2 << 20)])
        assert p.stats()["messages"] == 0, "publish_many publishes all or none"
        p.publish(b"x" * p.max_message_bytes)


def test_publish_many_refuses_a_single_message_instead_of_splitting_it(server, topic_name):
    Admin(server.control).create_topic(topic_name)
    with Publisher(server.control, topic_name) as p:
        for one in ("abc", b"abc", bytearray(b"abc")):
            with pytest.raises(TypeError, match="publish_many takes an iterable of messages"):
                p.publish_many(one)
        assert p.stats()["messages"] == 0, "nothing of a refused call is published"
        assert p.publish_many(["abc"]) == 1


def test_a_closed_publisher_refuses_everything_but_stats(server, topic_name):
    Admin(server.control).create_topic(topic_name)
    p = Publisher(server.control, topic_name)
    p.publish(b"one")
    assert p.close()["messages"] == 1
    for call in (lambda: p.publish(b"x"), lambda: p.publish_many([b"x"]), p.flush):
        with pytest.raises(embarcadero.ClosedError, match="the publisher is closed"):
            call()
    assert p.stats()["messages"] == 1
    assert p.close()["messages"] == 1, "closing again returns the final statistics again"
    sub = Subscriber(server.control, topic_name)
    sub.close()
    assert list(sub) == []
    for call in (lambda: sub.poll(0), lambda: sub.poll_many(0), lambda: sub.seek(0)):
        with pytest.raises(embarcadero.ClosedError, match="the subscriber is closed"):
            call()


def test_a_bad_topic_name_is_an_invalid_name_error_before_any_request(topic_name):
    # No server at all: the name is refused before the client asks anything.
    for make in (Publisher, Subscriber):
        with pytest.raises(embarcadero.InvalidNameError):
            make("127.0.0.1:1", "bad name")


def test_bad_options_raise_config_errors(server, topic_name):
    Admin(server.control).create_topic(topic_name)
    with pytest.raises(embarcadero.ConfigError, match="16 bytes"):
        Publisher(server.control, topic_name, session_key=b"short")
    with pytest.raises(embarcadero.ConfigError, match="linger_ms=-1.*milliseconds, a finite"):
        Publisher(server.control, topic_name, linger_ms=-1)
    with pytest.raises(embarcadero.ConfigError, match='"end"'):
        Subscriber(server.control, topic_name, start="middle")
    # None in flight would never send a batch: flush() waited its whole timeout.
    with pytest.raises(embarcadero.ConfigError, match="max_inflight_batches must be at least 1"):
        Publisher(server.control, topic_name, max_inflight_batches=0)
    # A timeout in seconds says so, in the SDK's words (not Rust's Duration's).
    with Subscriber(server.control, topic_name) as sub:
        with pytest.raises(embarcadero.ConfigError, match="timeout -1: give seconds"):
            sub.poll(-1)
    # Checked before any request: not a ConnectError from an unreachable control plane.
    with pytest.raises(embarcadero.ConfigError, match="ack level 7 does not exist"):
        Publisher("127.0.0.1:1", topic_name, ack_level=7)
    # Numbers out of an option's range name the option (PyO3 alone raised a bare
    # OverflowError, "can't convert negative int to unsigned").
    out_of_range = [
        ("ack_level", -1),
        ("threads_per_broker", -1),
        ("client_id", 2**64),
        ("batch_bytes", -5),
        ("session_epoch", -1),
    ]
    for option, value in out_of_range:
        named = f"^invalid configuration: {option}={value}: want a whole number from 0 to"
        with pytest.raises(embarcadero.ConfigError, match=named):
            Publisher(server.control, topic_name, **{option: value})
    with pytest.raises(embarcadero.ConfigError, match="max_reconnects=-1"):
        Subscriber(server.control, topic_name, max_reconnects=-1)
    with pytest.raises(embarcadero.ConfigError, match="concurrency=-1"):
        embarcadero.workflow.Worker(server.control, handlers={"h": lambda c: None}, concurrency=-1)


def test_a_subscriber_with_retry_for_rides_out_a_server_restart(topic_name):
    """A subscriber given ``retry_for_ms`` keeps reconnecting while its server restarts and
    continues from where it was; one without gives up (the server stays down until it
    has), so the first one's tries outlasted the default ones."""
    server = Server(brokers=1, fixed_ports=True)
    try:
        Admin(server.control).create_topic(topic_name, rf=1)
        with Publisher(server.control, topic_name) as p:
            p.publish(b"before")
        riding = Subscriber(server.control, topic_name, retry_for_ms=60_000)
        giving_up = Subscriber(server.control, topic_name)
        for sub in (riding, giving_up):
            assert sub.poll(timeout=30).payload == b"before"
        got = queue.Queue()

        def read() -> None:
            try:
                got.put(riding.poll(timeout=120))
            except embarcadero.EmbarcaderoError as e:
                got.put(e)

        reader = threading.Thread(target=read, daemon=True)
        server.kill()
        reader.start()
        with pytest.raises((embarcadero.ConnectionLostError, embarcadero.ConnectError)):
            giving_up.poll(timeout=60)
        server.restart()
        with Publisher(server.control, topic_name) as p:
            p.publish(b"after")
        after = got.get(timeout=120)
        assert not isinstance(after, Exception), after
        assert after.payload == b"after", "continued after the first message"
        riding.close()
    finally:
        server.stop()


def test_a_killed_server_makes_the_next_calls_raise_within_a_bounded_time(fresh_server, topic_name):
    control = fresh_server.control
    Admin(control).create_topic(topic_name)
    p = Publisher(control, topic_name, flush_timeout_ms=10_000)
    sub = Subscriber(control, topic_name, max_reconnects=3)
    p.publish(b"before")
    p.flush()
    assert sub.poll(timeout=30).payload == b"before"
    fresh_server.kill()

    start = time.monotonic()
    lost = (
        embarcadero.ConnectionLostError,
        embarcadero.ConnectError,
        embarcadero.NoLiveBrokerError,
    )
    with pytest.raises(lost):
        # Publishing only appends; the loss shows at the latest when flushing.
        for _ in range(1000):
            p.publish(b"after")
        p.flush()
    with pytest.raises((embarcadero.ConnectionLostError, embarcadero.ConnectError)):
        sub.poll(timeout=60)
    with pytest.raises(embarcadero.ConnectError):
        Admin(control, timeout=5).list_topics()
    with pytest.raises(embarcadero.ConnectError):
        Publisher(control, topic_name)
    # Closing a publisher that failed may report the failure again; it closes all the same.
    try:
        p.close()
    except lost:
        pass
    assert p.closed
    assert time.monotonic() - start < 60, "every call gave up in bounded time"


SIGINT_SCRIPT = textwrap.dedent(
    """
    import sys, embarcadero
    sub = embarcadero.Subscriber(sys.argv[1], sys.argv[2])
    try:
        print("reading", flush=True)
        for m in sub:
            pass
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(7)
    """
)


def test_a_close_from_another_thread_ends_a_blocking_iteration(server, topic_name):
    """The thread in ``for m in sub`` stops iterating when another thread closes the
    subscriber (it raised ``ClosedError`` from inside the loop)."""
    Admin(server.control).create_topic(topic_name)
    sub = Subscriber(server.control, topic_name)
    got, ended, failed = [], threading.Event(), []
    first = threading.Event()

    def iterate() -> None:
        try:
            for m in sub:
                got.append(m.payload)
                first.set()
        except Exception as e:  # the defect: raised instead of ending
            failed.append(e)
        ended.set()

    threading.Thread(target=iterate, daemon=True).start()
    with Publisher(server.control, topic_name) as p:
        p.publish(b"one")
    assert first.wait(30), "the first message never came"
    sub.close()
    assert ended.wait(30), "the iteration did not end after close()"
    assert (got, failed) == ([b"one"], [])


def test_ctrl_c_interrupts_a_blocking_iteration(server, topic_name):
    Admin(server.control).create_topic(topic_name)
    child = subprocess.Popen(
        [sys.executable, "-c", SIGINT_SCRIPT, server.control, topic_name],
        stdout=subprocess.PIPE,
        # As from a terminal: a shell's background job (nohup, `&`) ignores SIGINT, and a
        # Python started with SIGINT ignored keeps ignoring it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "reading"
        os.kill(child.pid, signal.SIGINT)
        assert child.wait(timeout=30) == 7
        assert child.stdout.read().strip() == "interrupted"
    finally:
        if child.poll() is None:
            child.kill()


EXIT_WITH_DAEMON_SCRIPT = textwrap.dedent(
    """
    import sys, threading, embarcadero
    control, topic, what = sys.argv[1:]
    sub = embarcadero.Subscriber(control, topic, start="end")
    pub = embarcadero.Publisher(control, topic)
    started = threading.Event()

    def reading():
        started.set()
        sub.poll()  # nothing comes: it is still waiting when the program ends

    def publishing():
        started.set()
        while True:
            pub.publish(b"x" * 1024)

    threading.Thread(target=reading if what == "poll" else publishing, daemon=True).start()
    started.wait()
    print("exiting", flush=True)
    """
)


@pytest.mark.parametrize("what", ["poll", "publish"])
def test_a_program_exits_cleanly_while_a_daemon_thread_is_inside_a_call(server, topic_name, what):
    """A daemon thread blocked in ``poll()`` or publishing when the program ends used to
    abort the interpreter at exit (SIGABRT, "FATAL: exception not rethrown"): CPython
    ended the thread with ``pthread_exit`` as it came back for the GIL. It exits 0."""
    Admin(server.control).create_topic(topic_name, memory_only=True)
    child = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_DAEMON_SCRIPT, server.control, topic_name, what],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout.strip() == "exiting", child.stderr
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr}"
