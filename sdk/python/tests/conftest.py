"""Real `embarcadero` processes for the tests: `serve` on ephemeral ports with a temporary
data directory, and cluster mode (a head and follower brokers). The binary is
$EMBARCADERO_BIN (test.sh sets it to the cargo-built one)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

import pytest

BIN = os.environ.get("EMBARCADERO_BIN") or shutil.which("embarcadero") or "embarcadero"

# The region settings of every test server: 64 topic slots instead of 256, so a
# server's region is about 1.3 GiB instead of 2.8 GiB. `serve` refuses a region its
# filesystem could not hold whole, and a CI host's disk can be nearly full. The logs
# keep their default size: a module's tests share a server and fill them. Not applied
# to a server started with a config file of the test's own.
TEST_REGION = {
    "EMBARCADERO_REGION_MAX_TOPICS": "64",
}

# Fast failure detection in cluster mode: a follower is dead after 3 x 100 ms.
FAST_CLUSTER = {
    "EMBARCADERO_CLUSTER_HEARTBEAT_INTERVAL_MS": "100",
    "EMBARCADERO_CLUSTER_SEQUENCER_LEASE_MS": "400",
}


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Polls `cond` until it holds; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


class Process:
    """An `embarcadero` process whose stderr is read (and kept) by a thread, so lines can
    be waited for and the pipe never fills."""

    def __init__(self, args: List[str], env: Optional[Dict[str, str]] = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [BIN, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "NO_COLOR": "1", **(env or {})},
            text=True,
            errors="replace",
        )
        self.lines: List[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append("<exited>")
            self._changed.notify_all()

    def wait_line(self, marker: str, timeout: float = 30.0) -> str:
        """The first stderr line containing `marker`, waiting at most `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if marker in line:
                        return line
                if self.lines and self.lines[-1] == "<exited>":
                    raise RuntimeError(f"`{BIN} {' '.join(self.args)}` exited:\n" + self.log())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"no line with {marker!r} within {timeout} s:\n" + self.log()
                    )
                self._changed.wait(left)

    def log(self) -> str:
        return "\n".join(self.lines[-40:])

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def control_address(line: str) -> str:
    found = re.search(r"control API http://(\S+)", line)
    assert found, f"no control address in {line!r}"
    return found.group(1)


def free_port() -> int:
    """A port free now (the kernel's choice), for a server that must come back on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`embarcadero serve` (control plane, brokers and sequencer in one process)."""

    def __init__(
        self,
        brokers: int = 4,
        env: Optional[Dict[str, str]] = None,
        config: Optional[str] = None,
        fixed_ports: bool = False,
    ) -> None:
        """``config``: the text of a configuration file for ``serve --config`` (TOML).
        ``fixed_ports``: ports chosen now (ephemeral ones otherwise), so that
        :meth:`restart` comes back on the same addresses (one broker only)."""
        self.dir = tempfile.mkdtemp(prefix="embarcadero-py-")
        base, control = (free_port(), free_port()) if fixed_ports else (0, 0)
        # The ports after the base one are not known to be free.
        assert brokers == 1 or not fixed_ports, "fixed ports for one broker only"
        args = ["serve", "--base-port", str(base), "--control-port", str(control)]
        args += ["--data-dir", self.dir, "--brokers", str(brokers)]
        if config is not None:
            path = os.path.join(self.dir, "serve.toml")
            with open(path, "w") as f:
                f.write(config)
            args += ["--config", path]
        else:
            env = {**TEST_REGION, **(env or {})}
        self._args, self._env = args, env
        self.process = Process(args, env)
        self.control = control_address(self.process.wait_line("embarcadero is serving"))

    def kill(self) -> None:
        self.process.kill()

    def restart(self) -> None:
        """Starts `serve` again on the same data directory (and ports: ``fixed_ports``)
        after :meth:`kill`, and waits until it serves."""
        assert self.process.proc.poll() is not None, "restart a killed server"
        self.process = Process(self._args, self._env)
        restarted = control_address(self.process.wait_line("embarcadero is serving"))
        assert restarted == self.control, (restarted, self.control)

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """Cluster mode: a head with broker 0 and the sequencer, and followers 1..n-1, each
    its own process."""

    def __init__(self, brokers: int = 3) -> None:
        self.dir = tempfile.mkdtemp(prefix="embarcadero-py-cluster-")
        self.head = Process(
            [
                "broker",
                "--head",
                "--brokers",
                str(brokers),
                "--base-port",
                "0",
                "--control-port",
                "0",
                "--data-dir",
                os.path.join(self.dir, "head"),
            ],
            {**TEST_REGION, **FAST_CLUSTER},
        )
        self.control = control_address(self.head.wait_line("embarcadero is serving"))
        self.followers = {i: self.follower(i) for i in range(1, brokers)}

    def follower(self, broker_id: int) -> Process:
        p = Process(
            ["broker", "--follower", "--head-addr", self.control, "--broker-id", str(broker_id)]
        )
        p.wait_line("is serving at")
        return p

    def stop(self) -> None:
        for f in self.followers.values():
            f.stop()
        self.head.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


_names = itertools.count()


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic name of its own for each test (the module's server is shared)."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", request.node.name)[:50]
    return f"{base}-{next(_names)}"


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def fresh_server():
    """A server of the test's own, for tests that kill it."""
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.stop()
