"""Step handlers of the workflow engine written in Python (``docs/WORKFLOW.md``).

A handler is a function of a :class:`StepContext` returning a JSON-able value (dicts,
lists, strings, numbers, booleans, ``None``). :func:`step_handler` registers one under the
``handler.callable`` name templates use; a :class:`Worker` runs them::

    from embarcadero.workflow import Worker, step_handler

    @step_handler("py.square")
    def square(ctx):
        previous = list(ctx.dependency_results.values())
        value = previous[0]["result"] if previous else ctx.context["even_number"]
        return {"result": value**2}

    with Worker(control="127.0.0.1:12140", namespace="demo") as worker:
        worker.run()

The worker is the engine's own (the Rust one ``embarcadero worker`` runs): claims,
heartbeats, leases, timeouts and retries behave exactly as there, and so does riding out a
server restart: a worker whose log is lost is replaced by a new one (a new :attr:`Worker.id`)
with the same handlers, with backoff, for as long as it lives or up to ``retry_for_ms``;
each failure and restart is logged at WARNING to the ``embarcadero.workflow``
logger. A handler that raises
fails its attempt: :class:`StepError` says whether to retry and after how long; any other
exception is a retryable failure with the message ``Type: text``. Whether and when a
retryable failure is retried is the template's ``retry`` policy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import signal
import threading
from types import TracebackType
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    Mapping,
    Optional,
    Type,
    TypeVar,
    Union,
)

from . import _AsyncClose
from ._native import BatchInput, NativeWorker, StepContext, mark_handler_thread
from .tasks import AsyncTaskClient, TaskClient

__all__ = [
    "AsyncTaskClient",
    "BatchInput",
    "Handler",
    "StepContext",
    "StepError",
    "TaskClient",
    "Worker",
    "registered_handlers",
    "step_handler",
]

Handler = Callable[[StepContext], Any]
"""A step handler: a function (or ``async`` function) of the context, returning JSON."""

H = TypeVar("H", bound=Handler)

_log = logging.getLogger("embarcadero.workflow")

# Handlers registered by `@step_handler`, by callable name: what a Worker runs when it is
# not given its own.
_REGISTERED: Dict[str, Handler] = {}


class StepError(Exception):
    """Raised by a handler to fail its attempt on its own terms.

    ``retryable=False`` fails the step for good whatever the template's policy;
    ``retry_after_ms`` replaces the policy's backoff before the next attempt.
    """

    def __init__(
        self, message: str, *, retryable: bool = True, retry_after_ms: Optional[int] = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after_ms = retry_after_ms


def step_handler(callable_name: str) -> Callable[[H], H]:
    """Registers the decorated function as the handler of ``callable_name`` (a template
    step's ``handler.callable``), for every :class:`Worker` not given handlers of its own.
    The function is returned unchanged, so it can still be called directly (in tests)."""

    def register(function: H) -> H:
        if callable_name in _REGISTERED and _REGISTERED[callable_name] is not function:
            raise ValueError(f"a handler is already registered for {callable_name!r}")
        _REGISTERED[callable_name] = function
        return function

    return register


def registered_handlers() -> Dict[str, Handler]:
    """The handlers registered with :func:`step_handler`, by callable name (a copy)."""
    return dict(_REGISTERED)


# The one event loop every ``async`` handler of this process runs on, in a thread of its
# own, started by the first such call: objects a handler keeps between calls (a lock, an
# HTTP session, a connection pool) are bound to the loop they were first used on, so a
# loop per call broke them ("bound to a different event loop").
_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


def _forget_loop_in_child() -> None:
    # A forked child has the loop object but not its thread: it makes its own.
    global _LOOP, _LOOP_LOCK
    _LOOP, _LOOP_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_loop_in_child)


def _run_handler_loop(loop: asyncio.AbstractEventLoop) -> None:
    # Worker.stop() from a coroutine here begins the drain and returns, as from a sync
    # handler's thread, instead of waiting for its own attempt.
    mark_handler_thread()
    asyncio.set_event_loop(loop)
    loop.run_forever()


def _handler_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_handler_loop,
                args=(loop,),
                name="embarcadero-async-handlers",
                daemon=True,
            )
            thread.start()
            _LOOP = loop
        return _LOOP


# How often the thread waiting for an ``async`` handler looks whether its attempt was
# called off (``ctx.cancelled``): the longest a called-off coroutine runs on.
_CANCEL_LOOK_S = 0.1


def _sync(function: Handler) -> Handler:
    """An ``async`` handler as a plain function for the worker's attempt threads: the
    coroutine runs on the process's handler loop (:func:`_handler_loop`), alongside every
    other ``async`` handler, and is cancelled when its outcome is no longer wanted: at its
    deadline (``ctx.deadline``), or once the attempt is called off (``ctx.cancelled``: its
    task cancelled or resolved by hand, or the attempt taken back)."""
    if not inspect.iscoroutinefunction(function):
        return function

    def call(ctx: StepContext) -> Any:
        future = asyncio.run_coroutine_threadsafe(function(ctx), _handler_loop())
        # Waited for apart from its result: on Python 3.11+ `concurrent.futures`'s
        # TimeoutError is the builtin one, which the handler's own timeouts raise too.
        while not future.done() and not ctx.should_stop():
            concurrent.futures.wait([future], timeout=min(ctx.time_left(), _CANCEL_LOOK_S))
        if future.done():
            return future.result()
        future.cancel()
        if ctx.cancelled:
            raise StepError(f"step {ctx.step_name} was called off (attempt {ctx.attempt})")
        raise TimeoutError(
            f"step {ctx.step_name} was cancelled at its deadline (attempt {ctx.attempt})"
        )

    return call


def _logged(callable_name: str, function: Handler) -> Handler:
    """``function``, whose failures are logged at WARNING to ``embarcadero.workflow``
    (with the traceback, but for a :class:`StepError`, which says what it means): the
    task's record keeps only the last attempt's error text."""

    def call(ctx: StepContext) -> Any:
        try:
            return function(ctx)
        except StepError as e:
            if ctx.cancelled:
                # Called off (its task cancelled or resolved, the attempt taken back):
                # what was asked for, not a failure; nothing of it is published.
                _log.info(
                    "%s (step %s of task %s, attempt %d) called off",
                    callable_name, ctx.step_name, ctx.task_uuid, ctx.attempt,
                )
                raise
            _log.warning(
                "%s (step %s of task %s, attempt %d) failed: %s",
                callable_name, ctx.step_name, ctx.task_uuid, ctx.attempt, e,
            )
            raise
        except Exception:
            _log.warning(
                "%s (step %s of task %s, attempt %d) raised",
                callable_name, ctx.step_name, ctx.task_uuid, ctx.attempt,
                exc_info=True,
            )
            raise

    return call


@contextlib.contextmanager
def _sigterm_raises_system_exit() -> Iterator[None]:
    """While in the block on the main thread, SIGTERM raises ``SystemExit(143)`` (128 +
    SIGTERM, what a process killed by it reports) instead of ending the process at once,
    so that a ``with Worker`` block drains as on Ctrl-C. A handler the program installed
    itself is left alone."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _report(kind: str, worker: Optional[str], message: str) -> None:
    """Logs what the worker's supervisor reports (from its own thread): a lost log, a new
    worker that could not start yet, a new worker running, giving up (``kind``:
    ``failed``, ``startFailed``, ``restarted``, ``gaveUp``) at WARNING, a drain at INFO.
    ``worker`` (the failed or the new worker's id) and ``kind`` are on the record as
    ``workflow_worker`` and ``workflow_event``."""
    level = logging.INFO if kind == "draining" else logging.WARNING
    _log.log(level, message, extra={"workflow_event": kind, "workflow_worker": worker})


class Worker(_AsyncClose):
    """Runs step handlers for the engine: claims enqueued attempts of its namespaces whose
    handler it has, runs them (at most ``concurrency`` at once, each on a thread of its own
    with the step's ``timeout_seconds``) and publishes their results.

    It starts at once; :meth:`run` or :meth:`run_for` wait while it works, :meth:`stop`
    (from any thread) or leaving the ``with`` block ends it, once the attempts it started
    have published their results. ``async with`` works too: leaving the block stops it in
    the loop's default executor, so the event loop goes on while it drains. ``control``:
    default ``EMBARCADERO_CONTROL``, else ``127.0.0.1:12140``. ``handlers`` defaults to those
    registered with :func:`step_handler`; ``namespace`` (one or several) to every
    namespace. ``lease_ms`` should be the orchestrator's ``--lease-ms`` (heartbeats go out
    three times per lease; a longer one gives way to the orchestrator's, which it tells
    in the log); ``topic`` its ``--topic``. ``ack`` is the acknowledgement level
    of the worker's events (claims, heartbeats, results), as ``embarcadero worker --ack``:
    1 ordered, 2 durable (the default; needs a topic of rf 2); ``rf`` the topic's
    replication factor if the worker creates it (default 2: on disk).

    It rides out a server restart: when its log is lost (the server gone, restarting, or
    refusing the worker's session), the worker is replaced by a new one with the same
    handlers, after 250 ms, doubling to 10 s between tries; its attempts go back to the
    orchestrator a lease later. Each failure and restart is logged at WARNING to the
    ``embarcadero.workflow`` logger. ``retry_for_ms`` bounds how long a lost log is waited
    for: then :meth:`run` raises the last error (a
    :class:`~embarcadero.errors.ConnectError`, say); ``None`` (the default, as
    ``embarcadero worker``): for as long as it lives. An error no new worker would mend (a
    topic of the wrong order, an option the server refuses) ends it at once. The first
    worker starts in the constructor, which raises if it cannot (the server not there
    included).
    """

    def __init__(
        self,
        control: Optional[str] = None,
        *,
        namespace: Union[str, Iterable[str], None] = None,
        handlers: Optional[Mapping[str, Handler]] = None,
        concurrency: int = 32,
        lease_ms: int = 3000,
        topic: str = "workflow.events",
        ack: int = 2,
        rf: int = 2,
        retry_for_ms: Optional[int] = None,
    ) -> None:
        chosen = registered_handlers() if handlers is None else dict(handlers)
        if not chosen:
            raise ValueError("no handlers: register some with @step_handler or pass handlers")
        if namespace is None:
            namespaces = []
        elif isinstance(namespace, str):
            namespaces = [namespace]
        else:
            namespaces = list(namespace)
        self._native = NativeWorker(
            {name: _logged(name, _sync(fn)) for name, fn in chosen.items()},
            control,
            namespaces=namespaces,
            concurrency=concurrency,
            lease_ms=lease_ms,
            topic=topic,
            ack=ack,
            rf=rf,
            retry_for_ms=retry_for_ms,
            report=_report,
        )

    @property
    def id(self) -> str:
        """The current worker's id, as its claims and results name it in the log. It
        changes each time the worker is replaced after losing its log."""
        return self._native.id

    def run(self) -> None:
        """Works until :meth:`stop` is called (from another thread), riding out server
        restarts, or until it fails for good: an error no new worker mends, or a log lost
        for longer than ``retry_for_ms`` (the error is raised). Ctrl-C raises
        ``KeyboardInterrupt`` and, on the main thread while Python's own handling of it is
        in place, SIGTERM (a service manager's stop) raises ``SystemExit(143)``; either
        way the worker keeps working until stopped, and leaving the ``with`` block stops
        it, publishing the results of the attempts under way first."""
        with _sigterm_raises_system_exit():
            self._native.wait(None)
        self._native.stop()

    def run_for(self, seconds: float) -> None:
        """Works for at most ``seconds`` (less if stopped or it fails for good), then
        returns without stopping: call it again, or :meth:`stop`."""
        if self._native.wait(seconds):
            self._native.stop()

    def stop(self) -> None:
        """Stops claiming, then waits until every attempt already running has finished
        and published its result and the log has acknowledged everything this worker
        published, heartbeating meanwhile so that no running attempt loses its lease
        however long its handler takes (up to its step's ``timeout_seconds``): once it
        returns, the process may exit without losing a finished result (a handler still
        running when the process exits would leave its step to a lease expiry and a retry
        elsewhere). Between a lost log and its new worker it returns at once, starting
        none. Raises the error that ended the worker for good, if one did. Idempotent; from
        another thread, a second call waits for the first. Called from inside a handler
        it begins the same drain and returns at once (it would otherwise wait for
        itself): :meth:`run` returns once every attempt has published its result."""
        self._native.stop()

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()
