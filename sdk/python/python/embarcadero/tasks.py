"""Clients of the workflow engine's API: register templates, start tasks, wait for them,
and act on them as an operator (``docs/WORKFLOW.md`` lists every route).

:class:`TaskClient` is blocking (each call releases the GIL while it waits);
:class:`AsyncTaskClient` has the same methods as coroutines, each run in a worker thread.
Both return the API's documents as they are (dicts and lists, Tasker's field names) and
raise :class:`~embarcadero.errors.WorkflowApiError` (``status``, ``code``) for an error
answer or none::

    from embarcadero.workflow import TaskClient

    tasks = TaskClient()  # the control port, 127.0.0.1:12140 (or EMBARCADERO_CONTROL)
    task = tasks.run_task("demo", "squares", {"n": 3}, timeout=30)
    print(task["status"], [(s["name"], s["result"]) for s in task["steps"]])
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from typing import Any, Dict, Iterator, Optional, Tuple
from urllib.parse import quote, urlencode

from . import errors
from ._native import NativeTaskClient

__all__ = ["AsyncTaskClient", "TaskClient"]

Json = Any
"""A JSON value as the standard library decodes it."""


# The longest one request of a wait waits (a long poll of one second), so that Ctrl-C, and
# the cancellation of an AsyncTaskClient's wait, come through within about that long.
_WAIT_SLICE_S = 1.0


def _part(value: str) -> str:
    """One path segment: a uuid, name or version, escaped so it stays one segment; an
    empty one would name another route (``/v1/tasks/`` is the task list)."""
    if not value:
        raise errors.ConfigError("an empty id or name: give one")
    return quote(value, safe="")


def _slices(uuid: str, timeout: Optional[float]) -> Iterator[float]:
    """The long polls of a wait for task ``uuid``, in seconds: one at least, each at most
    :data:`_WAIT_SLICE_S`, until ``timeout`` (``None``: for ever). The arguments are
    checked at the call, not at the first poll."""
    _part(uuid)  # refuses an empty id
    if timeout is not None and not timeout >= 0:
        raise errors.ConfigError(f"timeout {timeout}: want seconds, 0 or more (None: no limit)")

    def slices() -> Iterator[float]:
        if timeout is None:
            while True:
                yield _WAIT_SLICE_S
        deadline = time.monotonic() + timeout
        left = timeout
        while True:
            yield min(left, _WAIT_SLICE_S)
            left = deadline - time.monotonic()
            if left <= 0:
                return

    return slices()


def _still_running(uuid: str, task: Dict[str, Any], timeout: Optional[float]) -> Exception:
    return errors.TimeoutError(
        f"task {uuid} is still {task.get('status')} after {timeout} s "
        "(wait again, or see which step it waits for with steps())",
        timeout=timeout,
    )


class TaskClient:
    """A blocking client of the workflow API at ``control`` (``host:port`` or a URL: the
    control port, which forwards the API to the engine, or an orchestrator's own address;
    default ``EMBARCADERO_CONTROL``, else ``127.0.0.1:12140``). Each request waits at most
    ``timeout`` seconds for its answer (default 20); :meth:`wait` waits as long as it is
    told.
    """

    def __init__(self, control: Optional[str] = None, *, timeout: float = 20.0) -> None:
        self._native = NativeTaskClient(control, timeout)

    @property
    def url(self) -> str:
        """The API's base URL (``http://host:port``)."""
        return self._native.url

    def __repr__(self) -> str:
        return f"TaskClient({self.url!r})"

    # Templates.

    def register_template(self, yaml: str) -> Dict[str, Json]:
        """Registers a template (its YAML text) and returns it as the engine holds it. The
        same template again is accepted; other content under a registered version is
        ``WorkflowApiError`` code ``template_conflict``; an invalid one ``invalid_template``."""
        return self._native.register_template(yaml)

    def templates(self) -> Dict[str, Json]:
        """Every registered template: ``{"templates": [...]}``, each its name, version and steps."""
        return self._request("GET", "/v1/templates")

    def template(self, namespace: str, name: str, version: Optional[str] = None) -> Dict[str, Json]:
        """Template ``namespace/name`` at ``version``, or its newest version, whole."""
        path = f"/v1/templates/{_part(namespace)}/{_part(name)}"
        return self._request("GET", path + (f"/{_part(version)}" if version else ""))

    # Tasks.

    def create_task(
        self,
        namespace: str,
        name: str,
        context: Optional[Dict[str, Json]] = None,
        *,
        version: Optional[str] = None,
        idempotency_key: Optional[str] = None,
    ) -> Dict[str, Json]:
        """Starts a task of template ``namespace/name`` (``version``, else its newest) with
        ``context`` as its input, and returns it (``task_uuid``, ``status``...).

        A second call with the same ``idempotency_key`` (or, without one, the same context,
        per the template's ``identity_strategy``) returns the first task instead of a new
        one. ``WorkflowApiError`` code ``backpressure`` (status 503) means the engine holds
        its maximum of open tasks: try again later."""
        if version is None:
            version = self._native.newest_version(namespace, name)
        task, _existed = self._native.create_task(
            namespace, name, version, context, idempotency_key
        )
        return task

    def task(self, uuid: str) -> Dict[str, Json]:
        """Task ``uuid`` as it stands, with its steps and their results."""
        return self._request("GET", f"/v1/tasks/{_part(uuid)}")

    def wait(self, uuid: str, timeout: Optional[float] = None) -> Dict[str, Json]:
        """Task ``uuid`` once it is finished: ``complete``, ``error``, ``cancelled`` or
        ``resolved_manually`` (check ``status``). Waits by long polls of a second each (so
        Ctrl-C comes through), which cost the engine nothing meanwhile; ``timeout`` in
        seconds (``None``: for as long as it takes; the API counts whole seconds, so a
        wait is at least one), after which :class:`embarcadero.TimeoutError` is raised. A
        task ``blocked_by_failures`` is not finished: it waits for an operator or a retry."""
        task: Dict[str, Json] = {}
        for wait_s in _slices(uuid, timeout):
            task, finished = self._native.wait_task(uuid, wait_s)
            if finished:
                return task
        raise _still_running(uuid, task, timeout)

    def run_task(
        self,
        namespace: str,
        name: str,
        context: Optional[Dict[str, Json]] = None,
        *,
        version: Optional[str] = None,
        idempotency_key: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Dict[str, Json]:
        """:meth:`create_task`, then :meth:`wait`: the finished task."""
        task = self.create_task(
            namespace, name, context, version=version, idempotency_key=idempotency_key
        )
        return self.wait(task["task_uuid"], timeout)

    def tasks(
        self,
        *,
        namespace: Optional[str] = None,
        name: Optional[str] = None,
        status: Optional[str] = None,
        page: int = 1,
        per_page: int = 25,
    ) -> Dict[str, Json]:
        """One page of tasks, oldest first, filtered by template and status:
        ``{"tasks": [...], "pagination": {...}}`` (each task without its steps)."""
        query: Dict[str, Any] = {"page": page, "per_page": per_page}
        for key, value in (("namespace", namespace), ("name", name), ("status", status)):
            if value is not None:
                query[key] = value
        return self._request("GET", "/v1/tasks?" + urlencode(query))

    def cancel_task(self, uuid: str) -> Dict[str, Json]:
        """Cancels an unfinished task (its unfinished steps too; a late result is refused)
        and returns it; ``WorkflowApiError`` code ``task_closed`` if it had finished."""
        return self._request("DELETE", f"/v1/tasks/{_part(uuid)}")

    def resolve_task(
        self, uuid: str, *, reason: Optional[str] = None, by: Optional[str] = None
    ) -> Dict[str, Json]:
        """Ends a task by hand (``resolved_manually``), its unfinished steps cancelled."""
        body = {"reason": reason, "resolved_by": by}
        return self._request("POST", f"/v1/tasks/{_part(uuid)}/resolve", body)

    def rerun_task(self, uuid: str, *, reason: Optional[str] = None) -> Dict[str, Json]:
        """Reopens a failed task: each failed step runs again with a fresh retry budget."""
        return self._request("POST", f"/v1/tasks/{_part(uuid)}/rerun", {"reason": reason})

    # Steps.

    def steps(self, uuid: str) -> Json:
        """Every step of task ``uuid``, as the API lists them."""
        return self._request("GET", f"/v1/tasks/{_part(uuid)}/workflow_steps")

    def step(self, uuid: str, step: str) -> Dict[str, Json]:
        """Step ``step`` of task ``uuid``."""
        return self._request("GET", f"/v1/tasks/{_part(uuid)}/workflow_steps/{_part(step)}")

    def reset_step(
        self, uuid: str, step: str, *, reason: str, by: Optional[str] = None
    ) -> Dict[str, Json]:
        """Runs a failed step again (``error -> pending``) with a fresh retry budget."""
        return self._step_action(uuid, step, "reset_for_retry", reason, by)

    def resolve_step(
        self, uuid: str, step: str, *, reason: str, by: Optional[str] = None
    ) -> Dict[str, Json]:
        """Marks a failed step ``resolved_manually``, which lets its dependents run."""
        return self._step_action(uuid, step, "resolve_manually", reason, by)

    def complete_step(
        self, uuid: str, step: str, result: Json, *, reason: str, by: Optional[str] = None
    ) -> Dict[str, Json]:
        """Completes a failed step by hand with ``result`` as its result."""
        return self._step_action(uuid, step, "complete_manually", reason, by, result)

    def dead_letters(self, *, page: int = 1, per_page: int = 25) -> Dict[str, Json]:
        """One page of the dead-letter list: every failed step of a blocked or failed task,
        with why (``max_retries``, ``worker_unavailable``, ``permanent_failure``...)."""
        return self._request("GET", "/v1/dlq?" + urlencode({"page": page, "per_page": per_page}))

    def _step_action(
        self,
        uuid: str,
        step: str,
        action: str,
        reason: str,
        by: Optional[str],
        result: Json = None,
    ) -> Dict[str, Json]:
        body = {"action_type": action, "reason": reason, "by": by, "completion_data": result}
        path = f"/v1/tasks/{_part(uuid)}/workflow_steps/{_part(step)}"
        return self._request("PATCH", path, body)

    def _request(self, method: str, path: str, body: Optional[Json] = None) -> Json:
        return self._native.request(method, path, body)


# The threads every AsyncTaskClient's requests run on: their own, so that waits do not
# take the event loop's default executor from other work.
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(
    max_workers=32, thread_name_prefix="embarcadero-tasks"
)


def _in_thread(method: Any) -> Any:
    """The coroutine twin of a :class:`TaskClient` method, run in a worker thread."""

    @functools.wraps(method)
    async def call(self: AsyncTaskClient, *args: Any, **kwargs: Any) -> Any:
        blocking = functools.partial(method, self._blocking, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, blocking)

    return call


class AsyncTaskClient:
    """:class:`TaskClient` for ``asyncio``: every method is a coroutine with the same
    arguments and result, run on threads of the client's own (the event loop goes on
    meanwhile). :meth:`wait` waits a second at a time, so a cancelled wait stops within
    about a second."""

    def __init__(self, control: Optional[str] = None, *, timeout: float = 20.0) -> None:
        self._blocking = TaskClient(control, timeout=timeout)

    async def wait(self, uuid: str, timeout: Optional[float] = None) -> Dict[str, Json]:
        """As :meth:`TaskClient.wait`."""
        loop = asyncio.get_running_loop()
        slices = _slices(uuid, timeout)
        task: Dict[str, Json] = {}
        for wait_s in slices:
            one = functools.partial(self._blocking._native.wait_task, uuid, wait_s)
            answer: Tuple[Dict[str, Json], bool] = await loop.run_in_executor(_EXECUTOR, one)
            task, finished = answer
            if finished:
                return task
        raise _still_running(uuid, task, timeout)

    async def run_task(
        self,
        namespace: str,
        name: str,
        context: Optional[Dict[str, Json]] = None,
        *,
        version: Optional[str] = None,
        idempotency_key: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Dict[str, Json]:
        """As :meth:`TaskClient.run_task`."""
        task = await self.create_task(
            namespace, name, context, version=version, idempotency_key=idempotency_key
        )
        return await self.wait(task["task_uuid"], timeout)

    @property
    def url(self) -> str:
        """The API's base URL (``http://host:port``)."""
        return self._blocking.url

    def __repr__(self) -> str:
        return f"AsyncTaskClient({self.url!r})"

    register_template = _in_thread(TaskClient.register_template)
    templates = _in_thread(TaskClient.templates)
    template = _in_thread(TaskClient.template)
    create_task = _in_thread(TaskClient.create_task)
    task = _in_thread(TaskClient.task)
    tasks = _in_thread(TaskClient.tasks)
    cancel_task = _in_thread(TaskClient.cancel_task)
    resolve_task = _in_thread(TaskClient.resolve_task)
    rerun_task = _in_thread(TaskClient.rerun_task)
    steps = _in_thread(TaskClient.steps)
    step = _in_thread(TaskClient.step)
    reset_step = _in_thread(TaskClient.reset_step)
    resolve_step = _in_thread(TaskClient.resolve_step)
    complete_step = _in_thread(TaskClient.complete_step)
    dead_letters = _in_thread(TaskClient.dead_letters)
