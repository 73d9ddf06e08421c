#!/usr/bin/env python3
"""Issue 25's benchmark handlers in Python for Embarcadero's workflow engine (our Python SDK,
`embarcadero.workflow`): the same arithmetic as the engine's built-in handlers of the same
names (crates/workflow/src/builtin.rs), so run.sh can time the linear and batch shapes with
Python handlers against the Rust ones. Owns nothing but its worker; touches only the engine
at --control. Prints a readiness line to stderr and works until SIGTERM or SIGINT.
"""

import argparse
import signal
import sys
import threading

from embarcadero.workflow import StepError, Worker, step_handler
from shapes import csv_aggregate, csv_analyze, csv_value, square


@step_handler("math.square")
def math_square(ctx):
    # Results in dependency order; a decision's outcome (`step_names`) is not a number.
    results = [r for r in ctx.dependency_results.values()
               if not (isinstance(r, dict) and "step_names" in r)]
    try:
        return square(results, ctx.context.get("even_number"))
    except (TypeError, ValueError) as e:
        raise StepError(str(e), retryable=False) from None


@step_handler("decision.choose")
def choose(ctx):
    names = ctx.context.get("branches")
    if not isinstance(names, list):
        raise StepError(f"the context's `branches` is {names!r}, not a list", retryable=False)
    return {"type": "create_steps", "step_names": names}


@step_handler("csv.analyze")
def analyze(ctx):
    cursors, rows = csv_analyze(ctx.context)
    return {"type": "create_batches", "worker_count": len(cursors), "total_items": rows,
            "cursors": [{"start": s, "end": e} for s, e in cursors]}


@step_handler("csv.process_batch")
def process_batch(ctx):
    if ctx.batch is None:
        raise StepError("csv.process_batch runs as a batch_worker step", retryable=False)
    start, end = ctx.batch.cursor["start"], ctx.batch.cursor["end"]
    return {"rows": end - start, "value": csv_value(start, end), "resumed_from": None}


@step_handler("csv.aggregate")
def aggregate(ctx):
    return csv_aggregate(r for r in ctx.dependency_results.values() if r is not None)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--control", required=True)
    p.add_argument("--namespace", default="bench")
    p.add_argument("--ack", type=int, default=2)
    p.add_argument("--rf", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Worker(args.control, namespace=args.namespace, ack=args.ack, rf=args.rf,
                concurrency=args.concurrency) as worker:
        # run() raises if the worker's loop fails: the thread then ends, and so does main.
        running = threading.Thread(target=worker.run, daemon=True)
        running.start()
        print(f"embarcadero python worker is running ({worker.id})", file=sys.stderr, flush=True)
        while not stop.is_set() and running.is_alive():
            stop.wait(0.2)
    print("embarcadero python worker stopped", file=sys.stderr)
    sys.exit(0 if stop.is_set() else 1)


if __name__ == "__main__":
    main()
