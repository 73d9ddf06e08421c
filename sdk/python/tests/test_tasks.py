"""The task client (embarcadero.workflow.TaskClient, AsyncTaskClient) against a real
`embarcadero serve` and a real `embarcadero orchestrator`, through the control port that
forwards the workflow API: templates registered, tasks started (of the newest version when
none is named) and waited for by long polls, a wait that runs out, a cancelled task, a
failed step completed by hand, and every error typed with the API's status and code."""

from __future__ import annotations

import asyncio
import builtins
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterator, List

import pytest
from test_workflow import Engine, step

import embarcadero
from embarcadero.errors import WorkflowApiError
from embarcadero.workflow import AsyncTaskClient, StepContext, StepError, TaskClient

from conftest import wait_for

SQUARES = """name: squares
namespace: py_tasks
version: {version}
steps:
  - {{name: first, handler: {{callable: py.tasks_square}}}}
  - {{name: second, dependencies: [first], handler: {{callable: py.tasks_square}}}}
"""

UNSERVED = """name: unserved
namespace: py_tasks_unserved
version: 1.0.0
steps:
  - {name: only, handler: {callable: py.nobody_serves_this}}
"""

REFUSED = """name: refused
namespace: py_tasks
version: 1.0.0
steps:
  - name: refuses
    handler: {callable: py.tasks_refuses}
    retry: {max_attempts: 1}
  - {name: after, dependencies: [refuses], handler: {callable: py.tasks_square}}
"""


CALLED_OFF = """name: called_off
namespace: py_tasks
version: 1.0.0
steps:
  - {name: loops, timeout_seconds: 600, handler: {callable: py.tasks_loops}}
  - {name: awaits, timeout_seconds: 600, handler: {callable: py.tasks_awaits}}
"""


def tasks_square(ctx: StepContext) -> Dict[str, Any]:
    previous = list(ctx.dependency_results.values())
    n = previous[0]["n"] if previous else ctx.context["n"]
    return {"n": n * n}


def tasks_refuses(ctx: StepContext) -> None:
    raise StepError("refused on purpose", retryable=False)


HANDLERS = {"py.tasks_square": tasks_square, "py.tasks_refuses": tasks_refuses}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.stop()


def forwards(client: TaskClient) -> bool:
    """Whether the control port forwards the API yet: the orchestrator announces itself
    to the head within a second of serving, and until then the port answers 503."""
    try:
        client.templates()
        return True
    except WorkflowApiError as e:
        if e.code != "no_workflow_engine":
            raise
        return False


@pytest.fixture(scope="module")
def client(engine: Engine) -> TaskClient:
    # The control port, which forwards the API to the orchestrator that announced itself.
    c = TaskClient(engine.server.control)
    wait_for("the orchestrator to announce itself to the head", lambda: forwards(c))
    return c


def test_a_task_runs_to_completion_of_the_newest_version_and_is_found_again(engine, client):
    for version in ("1.0.0", "1.10.0", "1.9.0"):
        registered = client.register_template(SQUARES.format(version=version))
        assert registered["version"] == version, registered
    assert client.template("py_tasks", "squares")["version"] == "1.10.0"
    with engine.worker(HANDLERS, "py_tasks"):
        task = client.run_task("py_tasks", "squares", {"n": 3}, timeout=60)
    assert (task["status"], task["version"]) == ("complete", "1.10.0"), task
    assert [step(task, s)["result"] for s in ("first", "second")] == [{"n": 9}, {"n": 81}]
    uuid = task["task_uuid"]
    assert client.task(uuid)["status"] == "complete"
    # The same context again is the same task (identity_strategy strict); a new
    # idempotency key is a new one.
    assert client.create_task("py_tasks", "squares", {"n": 3})["task_uuid"] == uuid
    other = client.create_task("py_tasks", "squares", {"n": 3}, idempotency_key="k2")
    assert other["task_uuid"] != uuid
    listed = client.tasks(namespace="py_tasks", name="squares", status="complete")
    assert uuid in [t["task_uuid"] for t in listed["tasks"]], listed
    assert [s["name"] for s in client.steps(uuid)["steps"]] == ["first", "second"]
    assert client.step(uuid, "second")["result"] == {"n": 81}


def test_a_wait_that_runs_out_raises_and_a_cancelled_task_is_finished(client):
    client.register_template(UNSERVED)
    task = client.create_task("py_tasks_unserved", "unserved", {})
    uuid = task["task_uuid"]
    with pytest.raises(embarcadero.TimeoutError) as raised:
        client.wait(uuid, timeout=1)
    assert isinstance(raised.value, builtins.TimeoutError)
    assert raised.value.timeout == 1 and uuid in str(raised.value)
    assert client.cancel_task(uuid)["status"] == "cancelled"
    # Finished now: the wait answers at once, whatever its timeout.
    assert client.wait(uuid, timeout=300)["status"] == "cancelled"
    with pytest.raises(WorkflowApiError) as closed:
        client.cancel_task(uuid)
    assert (closed.value.status, closed.value.code) == (409, "task_closed")
    other = client.create_task("py_tasks_unserved", "unserved", {"case": "resolved"})["task_uuid"]
    resolved = client.resolve_task(other, reason="not needed", by="test")
    assert resolved["status"] == "resolved_manually", resolved
    assert client.wait(other, timeout=0)["status"] == "resolved_manually"


def test_a_failed_step_completed_by_hand_lets_its_task_complete(engine, client):
    client.register_template(REFUSED)
    with engine.worker(HANDLERS, "py_tasks"):
        failed = client.run_task("py_tasks", "refused", {"n": 2}, timeout=60)
        assert failed["status"] == "error", failed
        uuid = failed["task_uuid"]
        dead = client.dead_letters()["entries"]
        assert [(e["task_uuid"], e["step"]) for e in dead] == [(uuid, "refuses")], dead
        # Run again by hand, then as a rerun of the task: it fails each time.
        reset = client.reset_step(uuid, "refuses", reason="try again", by="test")
        assert reset["current_state"] in ("pending", "enqueued", "in_progress", "error"), reset
        assert client.wait(uuid, timeout=60)["status"] == "error"
        assert client.rerun_task(uuid, reason="once more")["status"] != "error"
        again = client.wait(uuid, timeout=60)
        assert (again["status"], step(again, "refuses")["attempts"]) == ("error", 3), again
        done = client.complete_step(uuid, "refuses", {"n": 5}, reason="by hand", by="test")
        assert done["current_state"] == "complete", done
        task = client.wait(uuid, timeout=60)
    assert task["status"] == "complete", task
    assert step(task, "after")["result"] == {"n": 25}
    assert client.dead_letters()["entries"] == []


def test_errors_carry_the_apis_status_and_code(client):
    cases = [
        (lambda: client.task("no-such-task"), 404, "not_found"),
        (lambda: client.create_task("py_tasks", "no_such_template"), 404, "template_not_found"),
        (lambda: client.register_template("name: x\n"), 400, "invalid_template"),
        (lambda: TaskClient("127.0.0.1:1").templates(), 0, "unreachable"),
    ]
    for call, status, code in cases:
        with pytest.raises(WorkflowApiError) as raised:
            call()
        assert (raised.value.status, raised.value.code) == (status, code), raised.value
        assert isinstance(raised.value, embarcadero.EmbarcaderoError)
    # An empty id (which would name the task list) and a client that would wait no time
    # at all are refused before anything is sent.
    with pytest.raises(embarcadero.ConfigError):
        client.wait("")
    with pytest.raises(embarcadero.ConfigError):
        TaskClient(client.url, timeout=0)
    assert embarcadero.WorkflowApiError is WorkflowApiError
    # A context that JSON cannot carry is refused before anything is sent.
    with pytest.raises(ValueError):
        client.create_task("py_tasks", "squares", {"n": float("nan")}, version="1.0.0")


def test_the_async_client_waits_without_holding_the_event_loop(client):
    async def main() -> Dict[str, Any]:
        tasks = AsyncTaskClient(client.url)
        uuid = (await tasks.create_task("py_tasks_unserved", "unserved", {"case": "async"}))[
            "task_uuid"
        ]
        waiting = asyncio.ensure_future(tasks.wait(uuid, timeout=60))
        await asyncio.sleep(0)  # let the wait begin
        # Nobody serves the step: the wait can only end by the cancel the loop sends now.
        assert not waiting.done()
        cancelled = await tasks.cancel_task(uuid)
        return {"cancelled": cancelled, "waited": await waiting}

    done = asyncio.run(main())
    assert done["cancelled"]["status"] == "cancelled"
    assert done["waited"]["status"] == "cancelled"


def test_a_cancelled_async_wait_stops_and_lets_the_program_end(client):
    async def main() -> None:
        tasks = AsyncTaskClient(client.url)
        created = await tasks.create_task("py_tasks_unserved", "unserved", {"case": "abandoned"})
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(tasks.wait(created["task_uuid"]), 0.5)
        await tasks.cancel_task(created["task_uuid"])

    # Returns (the wait it abandoned ends within its one-second slice) rather than hang.
    asyncio.run(main())


def test_a_cancelled_task_calls_off_its_running_handlers_sync_and_async(engine, client):
    started = {"loops": threading.Event(), "awaits": threading.Event()}
    stopped: Dict[str, threading.Event] = {k: threading.Event() for k in started}
    seen: List[Any] = []

    def loops(ctx: StepContext) -> None:
        started["loops"].set()
        while not ctx.should_stop():
            time.sleep(0.01)
        seen.append(("loops", ctx.cancelled, ctx.time_left() > 0))
        stopped["loops"].set()

    async def awaits(ctx: StepContext) -> None:
        started["awaits"].set()
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            seen.append(("awaits", ctx.cancelled))
            stopped["awaits"].set()
            raise

    client.register_template(CALLED_OFF)
    handlers = {"py.tasks_loops": loops, "py.tasks_awaits": awaits}
    with engine.worker(handlers, "py_tasks"):
        uuid = client.create_task("py_tasks", "called_off")["task_uuid"]
        assert all(e.wait(60) for e in started.values()), "both handlers started"
        assert client.cancel_task(uuid)["status"] == "cancelled"
        assert all(e.wait(30) for e in stopped.values()), f"both handlers told: {seen}"
    # Called off, not timed out: the deadline (10 minutes away) was not what stopped them.
    assert sorted(seen) == [("awaits", True), ("loops", True, True)]
    task = client.task(uuid)
    assert [step(task, s)["current_state"] for s in ("loops", "awaits")] == ["cancelled"] * 2


def test_a_worker_is_an_async_context_manager_that_drains_off_the_event_loop(engine):
    async def main() -> Dict[str, Any]:
        tasks = AsyncTaskClient(engine.server.control)
        async with engine.worker(HANDLERS, "py_tasks") as worker:
            task = await tasks.run_task("py_tasks", "squares", {"n": 6}, timeout=60)
        return {"task": task, "finished": worker._native.is_finished()}

    done = asyncio.run(main())
    assert done["task"]["status"] == "complete", done
    assert step(done["task"], "second")["result"] == {"n": 1296}
    assert done["finished"], "leaving the block stopped the worker"


def test_ctrl_c_ends_a_wait(client):
    uuid = client.create_task("py_tasks_unserved", "unserved", {"case": "ctrl-c"})["task_uuid"]
    script = (
        "import sys\n"
        "from embarcadero.workflow import TaskClient\n"
        f"tasks = TaskClient({client.url!r})\n"
        "print('waiting', flush=True)\n"
        "try:\n"
        f"    tasks.wait({uuid!r})\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(3)\n"
    )
    waiter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert waiter.stdout is not None
    assert waiter.stdout.readline().strip() == "waiting"
    waiter.send_signal(signal.SIGINT)
    # Nobody serves the step: only Ctrl-C can end the wait (which had no time limit).
    assert waiter.wait(timeout=60) == 3
    assert waiter.stdout.read().strip() == "interrupted"
    client.cancel_task(uuid)
