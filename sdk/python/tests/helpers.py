"""Shared by the tests: numbered payloads and reading a topic up to a count."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import List, Tuple

import embarcadero

HEADER = struct.Struct("<QQ")


def payload(source: int, seq: int, size: int = 64) -> bytes:
    """A message naming its publisher (`source`) and its place in that publisher's stream."""
    return HEADER.pack(source, seq) + b"x" * (size - HEADER.size)


def publish_numbered(control: str, topic: str, count: int, size: int = 64) -> None:
    """Publishes `payload(0, i, size)` for i in 0..count, in one `publish_many`, and closes."""
    with embarcadero.Publisher(control, topic) as p:
        p.publish_many([payload(0, i, size) for i in range(count)])


def parse(message: embarcadero.Message) -> Tuple[int, int]:
    return HEADER.unpack_from(message.payload)


def read(
    sub: embarcadero.Subscriber, count: int, timeout: float = 60.0
) -> List[embarcadero.Message]:
    """`count` messages from `sub`; fails (never hangs) if they do not come in `timeout`."""
    got: List[embarcadero.Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} of {count} messages arrived within {timeout} s"
        got.extend(sub.poll_many(timeout=min(left, 1.0), max_messages=count - len(got)))
    return got


class LoopTicker:
    """Counts turns of the running asyncio loop, one every 10 ms, while a test awaits
    something else: a call that blocked the loop would let none through. Make it inside a
    coroutine; `cancel` it at the end."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.01)

    def cancel(self) -> None:
        self._task.cancel()
