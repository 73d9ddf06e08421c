"""Python step handlers (embarcadero.workflow) run by a worker in this process, against a real
`embarcadero serve` and a real `embarcadero orchestrator`, driven through the orchestrator's
HTTP API: results flow from step to step, exceptions become failures retried per the
template's policy, and StepError overrides the policy."""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any, Dict, Iterator, List

import pytest

import embarcadero
from embarcadero.workflow import StepContext, StepError, Worker, registered_handlers, step_handler

from conftest import Process, Server

LEASE_MS = "3000"

LINEAR = """name: linear
namespace: py_linear
version: 1.0.0
steps:
  - {name: one, handler: {callable: py.square, initialization: {power: 2}}}
  - {name: two, dependencies: [one], handler: {callable: py.square}}
  - {name: three, dependencies: [two], handler: {callable: py.square}}
  - {name: four, dependencies: [three], handler: {callable: py.ancestry}}
"""

FAILING = """name: failing
namespace: py_failing
version: 1.0.0
steps:
  - name: once
    handler: {callable: py.fail_first}
    retry: {max_attempts: 3, backoff: none}
  - name: always
    dependencies: [once]
    handler: {callable: py.always_fails}
    retry: {max_attempts: 3, backoff: linear, backoff_base_ms: 10}
"""

PERMANENT = """name: permanent
namespace: py_failing
version: 1.0.0
steps:
  - name: refuses
    handler: {callable: py.refuses}
    retry: {max_attempts: 5, backoff: none}
"""


class Engine:
    """A server and an orchestrator on it (accepting any handler name: the Python ones
    are not built in), with a client of its API."""

    def __init__(self) -> None:
        self.server = Server()
        self.orchestrator = Process(
            [
                "orchestrator",
                "--control",
                self.server.control,
                "--listen",
                "127.0.0.1:0",
                "--lease-ms",
                LEASE_MS,
                "--any-handler",
            ]
        )
        line = self.orchestrator.wait_line("workflow orchestrator is serving")
        self.api = "http://" + line.rsplit("http://", 1)[1].strip()

    def request(self, method: str, path: str, body: bytes = b"", kind: str = "") -> Any:
        req = urllib.request.Request(self.api + path, data=body or None, method=method)
        if kind:
            req.add_header("Content-Type", kind)
        with urllib.request.urlopen(req, timeout=90) as answer:
            return json.loads(answer.read())

    def register(self, template: str) -> None:
        self.request("POST", "/v1/templates", template.encode(), "application/yaml")

    def run_task(self, namespace: str, name: str, context: Dict[str, Any]) -> Dict[str, Any]:
        """Creates a task and returns it once finished (the API's long poll)."""
        body = {"namespace": namespace, "name": name, "version": "1.0.0", "context": context}
        task = self.request("POST", "/v1/tasks", json.dumps(body).encode(), "application/json")
        return self.request("GET", f"/v1/tasks/{task['task_uuid']}?wait=60")

    def worker(self, handlers: Dict[str, Any], namespace: str) -> Worker:
        return Worker(
            self.server.control,
            namespace=namespace,
            handlers=handlers,
            lease_ms=int(LEASE_MS),
        )

    def stop(self) -> None:
        self.orchestrator.stop()
        self.server.stop()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.stop()


def step(task: Dict[str, Any], name: str) -> Dict[str, Any]:
    return next(s for s in task["steps"] if s["name"] == name)


def square(ctx: StepContext) -> Dict[str, Any]:
    if ctx.dependency_results:
        (previous,) = ctx.dependency_results.values()
        value = previous["result"]
    else:
        value = ctx.context["even_number"]
    return {"result": value**2}


def ancestry(ctx: StepContext) -> Dict[str, Any]:
    """Everything the handler was given, as its result."""
    return {
        "task_uuid": ctx.task_uuid,
        "step_name": ctx.step_name,
        "attempt": ctx.attempt,
        "context": ctx.context,
        "initialization": ctx.initialization,
        "ancestors": ctx.ancestors,
        "dependencies": ctx.dependencies,
        "batch": ctx.batch,
    }


def test_a_linear_task_completes_with_the_python_handlers_results(engine):
    engine.register(LINEAR)
    with engine.worker({"py.square": square, "py.ancestry": ancestry}, "py_linear") as w:
        running = threading.Thread(target=w.run)
        running.start()
        task = engine.run_task("py_linear", "linear", {"even_number": 2})
        w.stop()
        running.join()
    assert task["status"] == "complete", task
    results = [step(task, s)["result"] for s in ["one", "two", "three"]]
    assert results == [{"result": 4}, {"result": 16}, {"result": 256}]
    assert step(task, "four")["result"] == {
        "task_uuid": task["task_uuid"],
        "step_name": "four",
        "attempt": 1,
        "context": {"even_number": 2},
        "initialization": None,
        "ancestors": {"one": {"result": 4}, "two": {"result": 16}, "three": {"result": 256}},
        "dependencies": ["three"],
        "batch": None,
    }


def test_exceptions_are_retried_per_the_policy_and_then_fail_the_task(engine):
    attempts: List[int] = []

    def fail_first(ctx: StepContext) -> str:
        if ctx.attempt == 1:
            raise ConnectionError("the service is away")
        return "done"

    def always_fails(ctx: StepContext) -> None:
        attempts.append(ctx.attempt)
        raise ValueError(f"no luck on attempt {ctx.attempt}")

    engine.register(FAILING)
    handlers = {"py.fail_first": fail_first, "py.always_fails": always_fails}
    with engine.worker(handlers, "py_failing"):
        task = engine.run_task("py_failing", "failing", {})
    assert task["status"] == "error", task
    once = step(task, "once")
    assert (once["current_state"], once["attempts"], once["result"]) == ("complete", 2, "done")
    always = step(task, "always")
    assert (always["current_state"], always["attempts"], always["failures"]) == ("error", 3, 3)
    assert attempts == [1, 2, 3]
    assert always["last_error"] == "max attempts (3) reached: ValueError: no luck on attempt 3"


def test_a_step_error_that_is_not_retryable_fails_the_step_at_once(engine):
    def refuses(ctx: StepContext) -> None:
        raise StepError("the input is wrong", retryable=False)

    engine.register(PERMANENT)
    with engine.worker({"py.refuses": refuses}, "py_failing"):
        task = engine.run_task("py_failing", "permanent", {})
    assert task["status"] == "error", task
    refused = step(task, "refuses")
    assert (refused["attempts"], refused["failures"]) == (1, 1)
    assert "the input is wrong" in refused["last_error"], refused


def test_async_handlers_and_results_that_are_not_json(engine):
    async def square_async(ctx: StepContext) -> Dict[str, Any]:
        return square(ctx)

    def not_json(ctx: StepContext) -> object:
        return object()

    engine.register(LINEAR.replace("linear", "mixed").replace("py.ancestry", "py.not_json"))
    handlers = {"py.square": square_async, "py.not_json": not_json}
    with engine.worker(handlers, "py_mixed"):
        task = engine.run_task("py_mixed", "mixed", {"even_number": 2})
    assert task["status"] == "error", task
    assert step(task, "three")["result"] == {"result": 256}
    last = step(task, "four")
    assert last["attempts"] == 1, "a result that is not JSON is not retried"
    assert "not JSON" in last["last_error"], last


def test_step_handler_registers_for_workers_without_handlers_of_their_own():
    @step_handler("py.test.registered")
    def registered(ctx: StepContext) -> int:
        return 1

    assert registered_handlers()["py.test.registered"] is registered
    with pytest.raises(ValueError, match="already registered"):
        step_handler("py.test.registered")(square)


def test_the_workers_ack_level_and_rf_reach_the_log(engine):
    """`ack`/`rf` are `embarcadero worker --ack/--rf`: the broker refuses ack 2 on the module's
    topic (rf 1) when the worker connects, and accepts it on a topic the worker creates
    with rf 2."""
    handlers = {"py.square": square, "py.ancestry": ancestry}
    with pytest.raises(embarcadero.BrokerError) as refused:
        Worker(engine.server.control, handlers=handlers, ack=2)
    assert refused.value.code == "AckNotAllowed", refused.value
    with pytest.raises(embarcadero.ConfigError, match="ack must be 1 or 2"):
        Worker(engine.server.control, handlers=handlers, ack=3)
    topic = "workflow.durable"
    with Worker(engine.server.control, handlers=handlers, topic=topic, ack=2, rf=2):
        described = embarcadero.Admin(engine.server.control).describe_topic(topic)
    assert (described["order"], described["replication_factor"]) == (5, 2), described
