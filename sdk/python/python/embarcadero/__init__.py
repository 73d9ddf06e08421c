"""Python client of Embarcadero, a totally ordered shared log.

A thin binding of the Rust client (``crates/client``): publishing, batching, order-5
sessions, failover and acknowledgements behave exactly as there. Three classes:

- :class:`Admin` creates, lists and describes topics and reports the cluster's status;
- :class:`Publisher` publishes to a topic (``publish``, ``publish_many``, ``flush``,
  ``close``; a context manager);
- :class:`Subscriber` reads a topic in order (``for m in sub``, ``async for m in sub``,
  ``poll``, ``seek``, ``position``), yielding :class:`Message` objects, or a poll at a
  time as a :class:`MessageBatch` (``poll_batch``: the cheapest way to read a stream).

Errors are :class:`EmbarcaderoError` subclasses (see :mod:`embarcadero.errors`).
Step handlers of the workflow engine are in :mod:`embarcadero.workflow`.
"""

from __future__ import annotations

import asyncio
import math
import sys
from importlib import metadata
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Optional

from . import errors
from ._native import DEFAULT_CONTROL, Admin, Message, MessageBatch, random_session_key
from ._native import Publisher as _NativePublisher
from ._native import Subscriber as _NativeSubscriber
from .errors import (
    AdminError,
    BrokerError,
    ClosedError,
    ConfigError,
    ConnectError,
    ConnectionLostError,
    EmbarcaderoError,
    InvalidNameError,
    MessageTooLargeError,
    NoLiveBrokerError,
    ProtocolError,
    WorkflowApiError,
)

# `embarcadero.TimeoutError` (a subclass of the built-in one); left out of `__all__` so a
# star import does not shadow the built-in.
TimeoutError = errors.TimeoutError

# How long one poll of `async for` waits in a worker thread. A cancelled `async for` leaves
# that poll running for at most this long; nothing it reads is lost (it stays buffered).
_ASYNC_SLICE_S = 0.2


try:
    __version__ = metadata.version("embarcadero")
except metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0.0.0+unknown"


if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from typing import Self
    else:
        from typing_extensions import Self


class _AsyncClose:
    """``async with``: leaving the block does what leaving ``with`` does (``__exit__``:
    close, a publisher flushing first), in the loop's default executor, so the event
    loop's thread never waits on the network."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> Literal[False]:
        loop = asyncio.get_running_loop()
        exit_sync = self.__exit__  # type: ignore[attr-defined]
        await loop.run_in_executor(None, exit_sync, exc_type, exc, tb)
        return False  # never swallows the block's exception (nor does ``__exit__``)


class Publisher(_AsyncClose, _NativePublisher):
    """Publishes to a topic: ``with Publisher(...) as p`` or ``async with`` closes it
    (flushing) at the end of the block. See the native class for every option."""


class Subscriber(_AsyncClose, _NativeSubscriber):
    """Reads a topic in order: ``for m in sub`` blocks for each message (Ctrl-C
    interrupts it), ``async for m in sub`` waits without blocking the event loop;
    ``with`` or ``async with`` closes it at the end of the block.
    """

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> Message:
        """The next message: the blocking poll runs in the loop's default executor, so
        the event loop's thread never waits on the network."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                message = self._take()
                if message is not None:
                    return message
                # Only fills the buffer: should this task be cancelled meanwhile, what the
                # poll read stays for the next call instead of being lost with its result.
                await loop.run_in_executor(None, self._fill, _ASYNC_SLICE_S)
            except ClosedError:
                raise StopAsyncIteration from None

    async def poll_batch_async(self, timeout: Optional[float] = None) -> MessageBatch:
        """:meth:`poll_batch` for asyncio: waits in the loop's default executor, so the
        event loop's thread never waits on the network. Cancelled, it loses nothing: what
        its poll read stays for the next call."""
        if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
            # As poll_batch refuses it (a wait of NaN seconds would never end).
            raise ConfigError(f"timeout {timeout}: give seconds, 0 or more, or None")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        filled = False
        while True:
            batch = self._take_batch()
            left = _ASYNC_SLICE_S if deadline is None else deadline - loop.time()
            # At least one poll: what the read-ahead holds counts as arrived (timeout 0).
            if batch or (filled and left <= 0):
                return batch
            await loop.run_in_executor(None, self._fill, max(0.0, min(left, _ASYNC_SLICE_S)))
            filled = True


__all__ = [
    "DEFAULT_CONTROL",
    "Admin",
    "AdminError",
    "BrokerError",
    "ClosedError",
    "ConfigError",
    "ConnectError",
    "ConnectionLostError",
    "EmbarcaderoError",
    "InvalidNameError",
    "Message",
    "MessageBatch",
    "MessageTooLargeError",
    "NoLiveBrokerError",
    "ProtocolError",
    "Publisher",
    "Subscriber",
    "WorkflowApiError",
    "errors",
    "random_session_key",
]
