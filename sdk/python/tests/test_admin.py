"""Admin: topics with the CLI's defaults, cluster status, and refused input."""

from __future__ import annotations

import pytest

import embarcadero
from embarcadero import Admin


def test_create_topic_is_durable_by_default_for_orders_2_and_5(server, topic_name):
    admin = Admin(server.control)
    for order, rf in [(2, 2), (5, 2), (0, 1), (1, 1)]:
        info = admin.create_topic(f"{topic_name}-o{order}", order=order)
        assert (info["order"], info["replication_factor"]) == (order, rf)
        assert info["default_ack"] == 1
    assert admin.create_topic(f"{topic_name}-mem", memory_only=True)["replication_factor"] == 1
    assert admin.create_topic(f"{topic_name}-rf3", rf=3)["replication_factor"] == 3


def test_list_and_describe_topics(server, topic_name):
    admin = Admin(server.control)
    admin.create_topic(topic_name, order=1, default_ack=0)
    info = admin.describe_topic(topic_name)
    assert info["name"] == topic_name
    assert info["order"] == 1 and info["default_ack"] == 0
    assert [b["broker"] for b in info["brokers"]] == [0, 1, 2, 3]
    assert all(b["messages"] == 0 for b in info["brokers"])
    assert info["health"] == {"readers": 0}, "no subscriber, no failing replica"
    assert topic_name in [t["name"] for t in admin.list_topics()]


def test_delete_topic_frees_the_name_and_tells_subscribers(server, topic_name):
    admin = Admin(server.control)
    admin.create_topic(topic_name, order=2)
    with embarcadero.Publisher(server.control, topic_name) as publisher:
        publisher.publish(b"old")
    subscriber = embarcadero.Subscriber(server.control, topic_name)
    assert subscriber.poll(10.0).payload == b"old"
    deleted = admin.delete_topic(topic_name)
    assert deleted["name"] == topic_name
    assert deleted["deleted"] is True, "marked deleted, as the admin API answers"
    with pytest.raises(embarcadero.BrokerError) as told:
        subscriber.poll(10.0)
    assert told.value.code == "TopicDeleted"
    with pytest.raises(embarcadero.AdminError) as gone:
        admin.describe_topic(topic_name)
    assert gone.value.status == 404
    assert admin.create_topic(topic_name, order=2)["next_position"] == 0


def test_cluster_and_status(server):
    admin = Admin(server.control)
    cluster = admin.cluster()
    assert [b["id"] for b in cluster["brokers"]] == [0, 1, 2, 3]
    assert cluster["max_message_bytes"] == 1 << 20
    assert isinstance(admin.status(), dict)
    assert admin.control_url == f"http://{server.control}"


def test_refused_requests_raise_typed_errors_with_the_cli_text(server, topic_name):
    admin = Admin(server.control)
    with pytest.raises(embarcadero.InvalidNameError, match="1 to 63") as bad:
        admin.create_topic("../status")
    assert isinstance(bad.value, ValueError)
    with pytest.raises(embarcadero.AdminError) as missing:
        admin.describe_topic(topic_name)
    assert missing.value.status == 404
    assert str(missing.value).startswith("admin API error (404): ")
    admin.create_topic(topic_name)
    with pytest.raises(embarcadero.AdminError) as twice:
        admin.create_topic(topic_name)
    assert 400 <= twice.value.status < 500
    with pytest.raises(embarcadero.ConfigError, match="memory_only"):
        admin.create_topic(topic_name + "x", rf=2, memory_only=True)


def test_an_unreachable_control_plane_raises_connect_error():
    with pytest.raises(embarcadero.ConnectError, match="is `embarcadero serve` running") as e:
        Admin("127.0.0.1:1", timeout=5).list_topics()
    assert isinstance(e.value, ConnectionError)
    assert "127.0.0.1:1" in e.value.addr


def test_admin_takes_the_control_address_from_the_environment(server, topic_name, monkeypatch):
    """As the CLI and the TypeScript package do: ``EMBARCADERO_CONTROL`` when none is given."""
    monkeypatch.setenv("EMBARCADERO_CONTROL", server.control)
    Admin().create_topic(topic_name)
    assert topic_name in [t["name"] for t in Admin().list_topics()]


def test_publishers_subscribers_and_workers_take_the_control_address_from_the_environment(
    server, topic_name, monkeypatch
):
    """``control=None`` is ``EMBARCADERO_CONTROL``, as for ``Admin()``, the CLI and TypeScript."""
    monkeypatch.setenv("EMBARCADERO_CONTROL", server.control)
    Admin().create_topic(topic_name)
    with embarcadero.Publisher(None, topic_name) as p:
        p.publish(b"found")
    with embarcadero.Subscriber(None, topic_name) as sub:
        assert sub.poll(30.0).payload == b"found"
    # The environment names an address nothing listens on: the failure names that address.
    monkeypatch.setenv("EMBARCADERO_CONTROL", "127.0.0.1:1")
    with pytest.raises(embarcadero.ConnectError) as e:
        embarcadero.Publisher(None, topic_name)
    assert "127.0.0.1:1" in str(e.value)


def test_the_package_has_a_version():
    assert embarcadero.__version__.split(".")[0].isdigit(), embarcadero.__version__


def test_publishers_use_the_topics_default_ack_unless_they_choose_one(server, topic_name):
    Admin(server.control).create_topic(topic_name, order=2, default_ack=2)
    with embarcadero.Publisher(server.control, topic_name) as durable:
        assert durable.stats()["ack_level"] == 2, "as `embarcadero pub` does"
        durable.publish(b"on every replica's disk when flushed")
    with embarcadero.Publisher(server.control, topic_name, ack_level=1) as chosen:
        assert chosen.stats()["ack_level"] == 1
