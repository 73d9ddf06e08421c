#!/usr/bin/env python3
"""Issue 25's benchmark handlers in Python for Tasker, on Tasker's own Python worker
(`tasker-py` from PyPI: `tasker_core.Worker`, which boots tasker-worker through PyO3 and
polls it for steps): the same arithmetic as our Rust worker for Tasker (worker/src/) and as
Embarcadero's built-in handlers, through shapes.py. Registered under the templates' callable
names (math.square, csv.analyze, csv.process_batch, csv.aggregate), so the same YAML
templates serve. Tasker's Python results must be dicts (StepHandlerResult.result), so a
number travels as {"result": n}, the envelope Tasker's own functional API wraps numbers in
and its StepContext.get_dependency_result unwraps. Configuration as for the Rust worker:
DATABASE_URL, TASKER_CONFIG_PATH, TASKER_TEMPLATE_PATH. Prints a readiness line to stderr
and works until SIGTERM or SIGINT. Owns nothing but its worker.
"""

import signal
import sys
import threading

from shapes import csv_aggregate, csv_analyze, csv_value, square
from tasker_core import HandlerRegistry, StepHandler, StepHandlerResult, Worker
from tasker_core.types import ErrorType, RustCursorConfig, create_batches


def failed(message):
    """A permanent failure, as our Rust worker's (its errors are not retryable either)."""
    return StepHandlerResult.failure(message, ErrorType.PERMANENT_ERROR, retryable=False)


def step_definition(context):
    return context.event.task_sequence_step.get("step_definition", {})


class Square(StepHandler):
    handler_name = "math.square"

    def call(self, context):
        # The dependencies' results in the template's order, skipping a decision's outcome
        # and a dependency never created.
        results = []
        for name in step_definition(context).get("dependencies", []):
            if name not in context.dependency_results:
                continue
            value = context.get_dependency_result(name)  # the stored result's `result`
            if isinstance(value, dict) and "decision_point_outcome" in value:
                continue
            if isinstance(value, dict) and list(value) == ["result"]:
                value = value["result"]  # this handler's own envelope of a number
            results.append(value)
        try:
            return StepHandlerResult.success(
                {"result": square(results, context.get_input("even_number"))})
        except (TypeError, ValueError) as e:
            return failed(str(e))


class CsvAnalyze(StepHandler):
    handler_name = "csv.analyze"

    def call(self, context):
        config = step_definition(context).get("batch_config") or {}
        if "worker_template" not in config:
            return failed("csv.analyze runs as a batchable step with a batch_config")
        cursors, rows = csv_analyze(context.input_data)
        configs = [RustCursorConfig(batch_id=f"{k + 1:03}", start_cursor=s, end_cursor=e,
                                    batch_size=e - s) for k, (s, e) in enumerate(cursors)]
        outcome = create_batches(config["worker_template"], len(configs), configs, rows)
        return StepHandlerResult.success({"batch_processing_outcome": outcome.model_dump()})


class CsvProcessBatch(StepHandler):
    handler_name = "csv.process_batch"

    def call(self, context):
        # Tasker hands a batch worker its cursor in workflow_step.inputs.
        inputs = context.step_inputs
        if inputs.get("is_no_op"):
            return StepHandlerResult.success({"rows": 0, "value": 0})
        cursor = inputs.get("cursor") or {}
        start, end = cursor.get("start_cursor"), cursor.get("end_cursor")
        try:
            return StepHandlerResult.success({"rows": end - start, "value": csv_value(start, end)})
        except (TypeError, ValueError) as e:
            return failed(f"cursor {cursor!r}: {e}")


class CsvAggregate(StepHandler):
    handler_name = "csv.aggregate"

    def call(self, context):
        results = (context.get_dependency_result(n) for n in context.dependency_results)
        return StepHandlerResult.success(csv_aggregate(results))


def main():
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Worker.start() as worker:
        # After Worker.start's own template-based discovery (which finds no class for these
        # names), so these registrations are the ones used; no step is dispatched before
        # the readiness line below, as run.sh creates no task until then.
        registry = HandlerRegistry.instance()
        for handler in (Square, CsvAnalyze, CsvProcessBatch, CsvAggregate):
            registry.register(handler.handler_name, handler)
        print(f"tasker python worker is running ({worker.worker_id})", file=sys.stderr, flush=True)
        while not stop.is_set() and worker.is_running:
            stop.wait(0.2)
    print("tasker python worker stopped", file=sys.stderr)


if __name__ == "__main__":
    main()
