"""Step handlers of the workflow engine written in Python (``docs/WORKFLOW.md``).

A handler is a function of a :class:`StepContext` returning a JSON-able value (dicts,
lists, strings, numbers, booleans, ``None``). :func:`step_handler` registers one under the
``handler.callable`` name templates use; a :class:`Worker` runs them::

    from embarcadero.workflow import Worker, step_handler

    @step_handler("math.square")
    def square(ctx):
        previous = list(ctx.dependency_results.values())
        value = previous[0]["result"] if previous else ctx.context["even_number"]
        return {"result": value**2}

    with Worker(control="127.0.0.1:12140", namespace="demo") as worker:
        worker.run()

The worker is the engine's own (the Rust one ``embarcadero worker`` runs): claims,
heartbeats, leases, timeouts and retries behave exactly as there. A handler that raises
fails its attempt: :class:`StepError` says whether to retry and after how long; any other
exception is a retryable failure with the message ``Type: text``. Whether and when a
retryable failure is retried is the template's ``retry`` policy.
"""

from __future__ import annotations

import asyncio
import inspect
from types import TracebackType
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Type, TypeVar, Union

from ._native import DEFAULT_CONTROL, BatchInput, NativeWorker, StepContext

__all__ = [
    "BatchInput",
    "Handler",
    "StepContext",
    "StepError",
    "Worker",
    "registered_handlers",
    "step_handler",
]

Handler = Callable[[StepContext], Any]
"""A step handler: a function (or ``async`` function) of the context, returning JSON."""

H = TypeVar("H", bound=Handler)

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


def _sync(function: Handler) -> Handler:
    """An ``async`` handler as a plain function: each call runs the coroutine to completion
    on an event loop of its own (the worker calls handlers on threads of their own, where
    no loop runs)."""
    if not inspect.iscoroutinefunction(function):
        return function

    def call(ctx: StepContext) -> Any:
        return asyncio.run(function(ctx))

    return call


class Worker:
    """Runs step handlers for the engine: claims enqueued attempts of its namespaces whose
    handler it has, runs them (at most ``concurrency`` at once, each on a thread of its own
    with the step's ``timeout_seconds``) and publishes their results.

    It starts at once; :meth:`run` or :meth:`run_for` wait while it works, :meth:`stop`
    (from any thread) or leaving the ``with`` block ends it, once the attempts it started
    have published their results. ``handlers`` defaults to those
    registered with :func:`step_handler`; ``namespace`` (one or several) to every
    namespace. ``lease_ms`` must be the orchestrator's ``--lease-ms`` (heartbeats go out
    three times per lease); ``topic`` its ``--topic``. ``ack`` is the acknowledgement level
    of the worker's events (claims, heartbeats, results), as ``embarcadero worker --ack``:
    1 ordered, 2 durable (the default; needs a topic of rf 2); ``rf`` the topic's
    replication factor if the worker creates it (default 2: on disk).
    """

    def __init__(
        self,
        control: str = DEFAULT_CONTROL,
        *,
        namespace: Union[str, Iterable[str], None] = None,
        handlers: Optional[Mapping[str, Handler]] = None,
        concurrency: int = 32,
        lease_ms: int = 3000,
        topic: str = "workflow.events",
        ack: int = 2,
        rf: int = 2,
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
            {name: _sync(fn) for name, fn in chosen.items()},
            control,
            namespaces=namespaces,
            concurrency=concurrency,
            lease_ms=lease_ms,
            topic=topic,
            ack=ack,
            rf=rf,
        )

    @property
    def id(self) -> str:
        """The worker's id, as its claims and results name it in the log."""
        return self._native.id

    def run(self) -> None:
        """Works until :meth:`stop` is called (from another thread) or the log fails (the
        error is raised). Ctrl-C raises ``KeyboardInterrupt``; the worker keeps working
        until stopped (leaving the ``with`` block stops it)."""
        self._native.wait(None)
        self._native.stop()

    def run_for(self, seconds: float) -> None:
        """Works for at most ``seconds`` (less if stopped or the log fails), then returns
        without stopping: call it again, or :meth:`stop`."""
        if self._native.wait(seconds):
            self._native.stop()

    def stop(self) -> None:
        """Stops claiming, then waits until every attempt already running has finished
        and published its result and the log has acknowledged everything this worker
        published, heartbeating meanwhile so that no running attempt loses its lease
        however long its handler takes (up to its step's ``timeout_seconds``): once it
        returns, the process may exit without losing a finished result (a handler still
        running when the process exits would leave its step to a lease expiry and a retry
        elsewhere). Raises the error that ended the loop, if one did. Idempotent; from
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
