// TypeScript step handlers (Worker, stepHandler, StepError) run by a worker in this
// process, against a real `embarcadero serve` and a real `embarcadero orchestrator`,
// driven through the orchestrator's HTTP API (the counterpart of the Python SDK's
// tests/test_workflow.py): results flow from step to step, thrown errors become failures
// retried per the template's policy or the StepError's delay, a StepError that is not
// retryable fails the step at once, results that are not JSON fail it for good, decision
// and batch steps (with a checkpoint resumed by the next attempt) work, close() waits
// for a running handler and publishes its result, and the same worker rides out a restart
// of its server (or gives up after its retryForMs).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import {
  Admin,
  BrokerError,
  ConfigError,
  ConnectError,
  EmbarcaderoError,
  HandlerFailure,
  Json,
  StepContext,
  StepError,
  StepHandler,
  Worker,
  WorkerRestart,
  registeredHandlers,
  stepHandler,
} from "../ts/index";
import { Engine, LEASE_MS, Task, step } from "./engine";
import { Proc, Server } from "./servers";

const LINEAR = `name: linear
namespace: ts_linear
version: 1.0.0
steps:
  - {name: one, handler: {callable: ts.square}}
  - {name: two, dependencies: [one], handler: {callable: ts.square}}
  - {name: three, dependencies: [two], handler: {callable: ts.square}}
  - {name: four, dependencies: [three], handler: {callable: ts.ancestry, initialization: {label: last}}}
`;

const FAILING = `name: failing
namespace: ts_failing
version: 1.0.0
steps:
  - name: once
    handler: {callable: ts.fail_first}
    retry: {max_attempts: 3, backoff: none}
  - name: always
    dependencies: [once]
    handler: {callable: ts.always_fails}
    retry: {max_attempts: 3, backoff: linear, backoff_base_ms: 10}
  - name: odd
    handler: {callable: ts.throws_odd}
    retry: {max_attempts: 2, backoff: none}
`;

const TIMED = `name: timed
namespace: ts_timed
version: 1.0.0
steps:
  - name: overruns
    handler: {callable: ts.overruns}
    timeout_seconds: 1
    retry: {max_attempts: 1, backoff: none}
`;

const BACKOFF = `name: backoff
namespace: ts_failing
version: 1.0.0
steps:
  - name: policy
    handler: {callable: ts.busy_once}
    retry: {max_attempts: 2, backoff: linear, backoff_base_ms: 400}
  - name: told
    handler: {callable: ts.busy_once_for_a_while}
    retry: {max_attempts: 2, backoff: linear, backoff_base_ms: 10}
`;

const PERMANENT = `name: permanent
namespace: ts_failing
version: 1.0.0
steps:
  - name: refuses
    handler: {callable: ts.refuses}
    retry: {max_attempts: 5, backoff: none}
`;

const CONDITIONAL = `name: conditional
namespace: ts_shapes
version: 1.0.0
steps:
  - {name: route, type: decision, handler: {callable: ts.choose}}
  - {name: left, dependencies: [route], handler: {callable: ts.side}}
  - {name: right, dependencies: [route], handler: {callable: ts.side}}
  - {name: join, type: deferred_convergence, dependencies: [left, right], handler: {callable: ts.join}}
`;

const BATCH = `name: batch
namespace: ts_shapes
version: 1.0.0
steps:
  - name: split
    type: batchable
    handler: {callable: ts.split}
  - name: count
    type: batch_worker
    dependencies: [split]
    handler: {callable: ts.count}
    retry: {max_attempts: 2, backoff: none}
  - name: total
    type: deferred_convergence
    dependencies: [count]
    handler: {callable: ts.total}
`;

const SLOW = `name: slow
namespace: ts_slow
version: 1.0.0
steps:
  - {name: only, handler: {callable: ts.gated}}
`;

let engine: Engine;

before(async () => {
  engine = await Engine.start();
});

after(async () => {
  await engine.stop();
});


const square: StepHandler<{ even_number: number }> = (ctx) => {
  const previous = Object.values(ctx.dependencyResults) as { result: number }[];
  const value = previous.length > 0 ? previous[0]!.result : ctx.context.even_number;
  return { result: value ** 2 };
};

/** Everything the handler was given, as its result. */
const ancestry: StepHandler = (ctx) => {
  const { taskUuid, stepName, attempt, context, initialization, ancestors, dependencies } = ctx;
  const { dependencyResults, batch } = ctx;
  return { taskUuid, stepName, attempt, context, initialization, ancestors, dependencies, dependencyResults, batch };
};

test("a linear task completes with the TypeScript handlers' results", { timeout: 90_000 }, async () => {
  await engine.register(LINEAR);
  let task: Task;
  {
    await using worker = await engine.worker({ "ts.square": square, "ts.ancestry": ancestry }, "ts_linear");
    assert.match(worker.id, /^worker-/);
    const running = worker.run();
    task = await engine.runTask("ts_linear", "linear", { even_number: 2 });
    await worker.close();
    await running;
  }
  assert.equal(task.status, "complete", JSON.stringify(task));
  assert.deepEqual(
    ["one", "two", "three"].map((s) => step(task, s).result),
    [{ result: 4 }, { result: 16 }, { result: 256 }],
  );
  assert.deepEqual(step(task, "four").result, {
    taskUuid: task.task_uuid,
    stepName: "four",
    attempt: 1,
    context: { even_number: 2 },
    initialization: { label: "last" },
    ancestors: { one: { result: 4 }, two: { result: 16 }, three: { result: 256 } },
    dependencies: ["three"],
    dependencyResults: { three: { result: 256 } },
    batch: null,
  });
});

test("thrown errors are retried per the policy and then fail the task", { timeout: 90_000 }, async () => {
  const attempts: number[] = [];
  const failFirst = (ctx: StepContext): string => {
    if (ctx.attempt === 1) throw new Error("the service is away");
    return "done";
  };
  const alwaysFails = (ctx: StepContext): never => {
    attempts.push(ctx.attempt);
    throw new RangeError(`no luck on attempt ${ctx.attempt}`);
  };
  await engine.register(FAILING);
  let task: Task;
  const failures: HandlerFailure[] = [];
  {
    // What no `String()` can print: the worker must still report it.
    const throwsOdd = (ctx: StepContext): string => {
      if (ctx.attempt === 1) throw Object.create(null);
      return "fine";
    };
    const handlers = { "ts.fail_first": failFirst, "ts.always_fails": alwaysFails, "ts.throws_odd": throwsOdd };
    const onHandlerFailure = (f: HandlerFailure): void => {
      failures.push(f);
    };
    await using _ = await engine.worker(handlers, "ts_failing", { onHandlerFailure });
    task = await engine.runTask("ts_failing", "failing", {});
  }
  assert.equal(task.status, "error", JSON.stringify(task));
  const once = step(task, "once");
  assert.deepEqual([once.current_state, once.attempts, once.result], ["complete", 2, "done"]);
  const always = step(task, "always");
  assert.deepEqual([always.current_state, always.attempts, always.failures], ["error", 3, 3]);
  assert.deepEqual(attempts, [1, 2, 3]);
  assert.equal(always.last_error, "max attempts (3) reached: RangeError: no luck on attempt 3");
  const odd = step(task, "odd");
  assert.deepEqual([odd.current_state, odd.attempts, odd.result], ["complete", 2, "fine"]);
  // Every attempt's failure was told, each with what was thrown.
  const told = failures.map((f) => `${f.stepName} ${f.attempt} ${f.calledOff} ${f.taskUuid === task.task_uuid}`);
  assert.deepEqual(told.sort(), [
    "always 1 false true",
    "always 2 false true",
    "always 3 false true",
    "odd 1 false true",
    "once 1 false true",
  ]);
  const last = failures.find((f) => f.stepName === "always" && f.attempt === 3)!;
  assert.ok(last.error instanceof RangeError);
  assert.equal(
    last.message,
    `ts.always_fails (step always of task ${task.task_uuid}, attempt 3) failed: RangeError: no luck on attempt 3`,
  );
  const oddFailure = failures.find((f) => f.stepName === "odd")!;
  assert.equal(oddFailure.message, `ts.throws_odd (step odd of task ${task.task_uuid}, attempt 1) failed: [object Object]`);
});

test("a retryable StepError is retried after its backoff, or its own delay, and then succeeds", { timeout: 90_000 }, async () => {
  // When each attempt started, by this process's wall clock, which the orchestrator's
  // shares: a retry is enqueued no earlier than the failure's time plus the delay, so the
  // second attempt starts at least the delay after the first one threw.
  const started: Record<string, number[]> = { policy: [], told: [] };
  const busyOnce =
    (retryAfterMs?: number): StepHandler =>
    async (ctx) => {
      started[ctx.stepName]!.push(Date.now());
      await new Promise((r) => setImmediate(r)); // a truly async handler
      if (ctx.attempt === 1) throw new StepError("busy, come back later", { retryAfterMs });
      return { attempt: ctx.attempt };
    };
  await engine.register(BACKOFF);
  let task: Task;
  {
    const handlers = { "ts.busy_once": busyOnce(), "ts.busy_once_for_a_while": busyOnce(700) };
    await using _ = await engine.worker(handlers, "ts_failing");
    task = await engine.runTask("ts_failing", "backoff", {});
  }
  assert.equal(task.status, "complete", JSON.stringify(task));
  for (const [name, delay] of [["policy", 400], ["told", 700]] as const) {
    const s = step(task, name);
    assert.deepEqual([s.attempts, s.failures, s.result], [2, 1, { attempt: 2 }], JSON.stringify(s));
    const states = s.transitions.map((t) => t.to);
    assert.deepEqual(states.slice(states.indexOf("waiting_for_retry") - 1).slice(0, 3), [
      "enqueued_for_orchestration",
      "waiting_for_retry",
      "enqueued",
    ]);
    const [first, second] = started[name]!;
    assert.ok(second! - first! >= delay, `${name}: attempt 2 began ${second! - first!} ms after attempt 1`);
  }
});

test("a handler's signal aborts at its deadline, so a timed-out attempt can stop", { timeout: 90_000 }, async () => {
  let leftAtStart = -1;
  let aborted!: () => void;
  const stopped = new Promise<void>((resolve) => (aborted = resolve));
  const overruns: StepHandler = async (ctx) => {
    leftAtStart = ctx.deadline.getTime() - Date.now();
    await new Promise<void>((resolve) => ctx.signal.addEventListener("abort", () => resolve()));
    aborted();
    throw ctx.signal.reason;
  };
  await engine.register(TIMED);
  let task: Task;
  {
    await using _ = await engine.worker({ "ts.overruns": overruns }, "ts_timed");
    task = await engine.runTask("ts_timed", "timed", {});
    await stopped;
  }
  assert.equal(task.status, "error", JSON.stringify(task));
  assert.equal(step(task, "overruns").last_error, "max attempts (1) reached: timed out after 1 s");
  // The step's 1 s timeout, the deadline rounded up to the next millisecond.
  assert.ok(leftAtStart > 0 && leftAtStart <= 1001, `${leftAtStart} ms left at the start`);
});

test("a StepError that is not retryable fails the step at once", { timeout: 90_000 }, async () => {
  const refuses = (): never => {
    throw new StepError("the input is wrong", { retryable: false });
  };
  await engine.register(PERMANENT);
  let task: Task;
  {
    await using _ = await engine.worker({ "ts.refuses": refuses }, "ts_failing");
    task = await engine.runTask("ts_failing", "permanent", {});
  }
  assert.equal(task.status, "error", JSON.stringify(task));
  const refused = step(task, "refuses");
  assert.deepEqual([refused.attempts, refused.failures], [1, 1]);
  assert.match(String(refused.last_error), /not retryable: the input is wrong/);
  assert.throws(() => new StepError("x", { retryAfterMs: -1 }), RangeError);
});

test("async handlers, and results that are not JSON fail for good", { timeout: 90_000 }, async () => {
  const squareAsync: StepHandler<{ even_number: number }> = async (ctx) => {
    await new Promise((r) => setTimeout(r, 1));
    return square(ctx);
  };
  await engine.register(LINEAR.replace("name: linear", "name: mixed").replace("ts_linear", "ts_mixed").replace("ts.ancestry", "ts.not_json"));
  let task: Task;
  {
    const handlers = { "ts.square": squareAsync, "ts.not_json": () => ({ big: 1n }) };
    await using _ = await engine.worker(handlers, "ts_mixed");
    task = await engine.runTask("ts_mixed", "mixed", { even_number: 2 });
  }
  assert.equal(task.status, "error", JSON.stringify(task));
  assert.deepEqual(step(task, "three").result, { result: 256 });
  const last = step(task, "four");
  assert.equal(last.attempts, 1, "a result that is not JSON is not retried");
  assert.match(String(last.last_error), /the handler's result is not JSON: .*BigInt/);
});

test("a decision creates the branch it names and the convergence waits for it", { timeout: 90_000 }, async () => {
  await engine.register(CONDITIONAL);
  const handlers: Record<string, StepHandler> = {
    "ts.choose": (ctx: StepContext<{ side: string }>) => ({ step_names: [ctx.context.side] }),
    "ts.side": (ctx) => `${ctx.stepName} taken`,
    "ts.join": (ctx) => ({ seen: ctx.dependencyResults, deps: ctx.dependencies }),
  };
  let task: Task;
  {
    await using _ = await engine.worker(handlers, "ts_shapes");
    task = await engine.runTask("ts_shapes", "conditional", { side: "right" });
  }
  assert.equal(task.status, "complete", JSON.stringify(task));
  assert.deepEqual(task.not_created_steps, ["left"]);
  assert.deepEqual(step(task, "join").result, { seen: { right: "right taken" }, deps: ["right"] });
});

test("batch workers run one per cursor, and an attempt resumes from the checkpoint of the one before", { timeout: 90_000 }, async () => {
  // Three ranges of ten items; each instance checkpoints after five items, and the first
  // attempts of instances 2 and 3 then fail: their second attempts start from the
  // checkpoint. Instance 3 does not await its checkpoint, which still reaches the log
  // before its failure.
  const resumed: Record<string, Json> = {};
  const handlers: Record<string, StepHandler> = {
    "ts.split": () => ({ cursors: [0, 10, 20].map((start) => ({ start, end: start + 10 })) }),
    "ts.count": async (ctx) => {
      const b = ctx.batch;
      assert.ok(b, "a batch worker instance is given its batch");
      const range = b.cursor as { start: number; end: number };
      resumed[`${ctx.stepName}#${ctx.attempt}`] = b.resume as Json;
      let at = b.resume ? (b.resume.cursor as number) : range.start;
      let sum = b.resume ? (b.resume.partial as number) : 0;
      for (; at < range.end; at++) {
        sum += at;
        if (at - range.start === 4 && b.resume === null) {
          const saved = b.checkpoint(at + 1, at + 1 - range.start, sum);
          if (b.index !== 3) await saved;
          if (b.index > 1) throw new Error("lost after the checkpoint");
        }
      }
      return { index: b.index, of: b.count, sum };
    },
    "ts.total": (ctx) => Object.values(ctx.dependencyResults).reduce((t: number, r) => t + (r as { sum: number }).sum, 0),
  };
  await engine.register(BATCH);
  let task: Task;
  {
    await using _ = await engine.worker(handlers, "ts_shapes");
    task = await engine.runTask("ts_shapes", "batch", {});
  }
  assert.equal(task.status, "complete", JSON.stringify(task));
  assert.equal(step(task, "total").result, (29 * 30) / 2, "every item counted once");
  assert.deepEqual(step(task, "count_002").result, { index: 2, of: 3, sum: 145 });
  assert.deepEqual([1, 2, 3].map((i) => step(task, `count_00${i}`).attempts), [1, 2, 2]);
  assert.deepEqual(resumed, {
    "count_001#1": null,
    "count_002#1": null,
    "count_002#2": { cursor: 15, itemsDone: 5, partial: 10 + 11 + 12 + 13 + 14 },
    "count_003#1": null,
    "count_003#2": { cursor: 25, itemsDone: 5, partial: 20 + 21 + 22 + 23 + 24 },
  });
});

test("close() waits for a running handler, whose result is published; the event loop stays free", { timeout: 90_000 }, async () => {
  await engine.register(SLOW);
  let entered!: () => void;
  const inHandler = new Promise<void>((r) => (entered = r));
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  const order: string[] = [];
  const worker = await engine.worker(
    {
      "ts.gated": async () => {
        entered();
        await gate; // resolved by this test while close() is pending: the loop is not blocked
        order.push("handler returned");
        return "let through";
      },
    },
    "ts_slow",
  );
  const uuid = await engine.create("ts_slow", "slow", {});
  await inHandler;
  const closed = worker.close().then(() => order.push("closed"));
  assert.equal(worker.close(), worker.close(), "close is idempotent");
  // A timer fires while the handler waits and close() is pending (so the event loop is
  // free). It lets a close() that did not wait for the handler end first: 300 ms is far
  // longer than stopping the loop takes; a correct close() passes whatever the delay.
  await new Promise((r) => setTimeout(r, 300));
  order.push("timer");
  release();
  await closed;
  assert.deepEqual(order, ["timer", "handler returned", "closed"]);
  // No worker is left: only the result the closing worker published can complete the task.
  const task = await engine.finished(uuid, 30);
  assert.equal(task.status, "complete", JSON.stringify(task));
  assert.deepEqual([step(task, "only").result, step(task, "only").attempts], ["let through", 1]);
});

test("stepHandler registers for workers without handlers of their own; bad options are refused", async () => {
  const registered = stepHandler("ts.test.registered", () => 1);
  assert.equal(registeredHandlers().get("ts.test.registered"), registered);
  assert.equal(registered(), 1, "returned unchanged");
  assert.throws(() => stepHandler("ts.test.registered", () => 2), ConfigError);
  await assert.rejects(
    Worker.start({ control: engine.server.control, handlers: {} }),
    (e: unknown) => e instanceof ConfigError && /no handlers/.test(e.message),
  );
  const handlers = { "ts.test.registered": registered };
  for (const bad of [{ concurrency: 0 }, { concurrency: 1.5 }, { leaseMs: 0 }, { leaseMs: NaN }]) {
    await assert.rejects(Worker.start({ control: engine.server.control, handlers, ...bad }), ConfigError);
  }
});

test("the worker's ack level and rf reach the log", { timeout: 90_000 }, async () => {
  // `embarcadero worker --ack/--rf`, durable (2 and 2) by default: a worker that creates
  // its topic makes it with its rf, and the broker refuses ack 2 on a memory-only (rf 1)
  // topic when the worker connects.
  const control = engine.server.control;
  const handlers = { "ts.square": square };
  const admin = new Admin(control);
  for (const bad of [{ ack: 0 }, { ack: 3 }, { rf: 0 }, { rf: 1.5 }]) {
    await assert.rejects(Worker.start({ control, handlers, ...bad }), ConfigError);
  }
  const created = async (topic: string, options: { ack?: number; rf?: number }): Promise<number[]> => {
    const worker = await Worker.start({ control, handlers, topic, ...options });
    try {
      const info = await admin.describeTopic(topic);
      return [info.order, info.replicationFactor];
    } finally {
      await worker.close();
    }
  };
  assert.deepEqual(await created("workflow.durable", {}), [5, 2]);
  assert.deepEqual(await created("workflow.memory", { ack: 1, rf: 1 }), [5, 1]);
  await assert.rejects(
    Worker.start({ control, handlers, topic: "workflow.memory" }),
    (e: unknown) => e instanceof BrokerError && e.code === "AckNotAllowed",
  );
});

/** The reports a worker gives its `onRestart`, and a wait for the first of a kind. */
class Restarts {
  readonly events: WorkerRestart[] = [];
  #wake: (() => void)[] = [];

  readonly onRestart = (event: WorkerRestart): void => {
    this.events.push(event);
    for (const w of this.#wake.splice(0)) w();
  };

  async first(kind: WorkerRestart["kind"], ms = 30_000): Promise<WorkerRestart> {
    const deadline = Date.now() + ms;
    for (;;) {
      const found = this.events.find((e) => e.kind === kind);
      if (found !== undefined) return found;
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`no ${kind} report within ${ms} ms: ${JSON.stringify(this.events)}`);
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, left);
        this.#wake.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
  }
}

test("the same worker rides out its server killed and restarted, and completes a task created after it", { timeout: 90_000 }, async () => {
  const server = await Server.serveOnFixedPorts();
  const own = await Engine.start(server);
  try {
    await own.register(LINEAR);
    const restarts = new Restarts();
    const handlers = { "ts.square": square, "ts.ancestry": ancestry };
    const worker = await Worker.start({
      control: server.control,
      namespace: "ts_linear",
      handlers,
      leaseMs: LEASE_MS,
      onRestart: restarts.onRestart,
    });
    let ended: unknown = "running";
    const running = worker.run().then(
      () => (ended = "resolved"),
      (e: unknown) => (ended = e),
    );
    const first = worker.id;
    const before = await own.runTask("ts_linear", "linear", { even_number: 2 });
    assert.deepEqual([before.status, step(before, "four").worker], ["complete", first]);

    await server.kill();
    const failed = await restarts.first("failed");
    assert.equal(failed.workerId, first);
    assert.ok(failed.error instanceof EmbarcaderoError, String(failed.error));
    assert.match(failed.message, /a new worker starts in/);
    await server.restart();
    const restarted = await restarts.first("restarted");
    // The durable log (rf 2) brings the template back; the orchestrator serves again once it
    // has read the log to its end.
    await own.orchestrator.waitLine("serving again");
    const after = await own.runTask("ts_linear", "linear", { even_number: 4 });
    assert.equal(after.status, "complete", JSON.stringify(after));
    assert.deepEqual(step(after, "three").result, { result: 65536 });
    const second = worker.id;
    assert.notEqual(second, first);
    assert.deepEqual([step(after, "four").worker, restarted.workerId], [second, second]);
    assert.equal(ended, "running", "run() went on through the restart");
    await worker.close();
    await running;
    assert.equal(ended, "resolved");
  } finally {
    await own.stop();
  }
});

test("a retryForMs that runs out while the server is down ends run() with the last error", { timeout: 60_000 }, async () => {
  const server = await Server.serve(["--brokers", "1"]);
  try {
    const restarts = new Restarts();
    const worker = await Worker.start({
      control: server.control,
      namespace: "ts_gone",
      handlers: { "ts.square": square },
      retryForMs: 500,
      onRestart: restarts.onRestart,
    });
    const running = worker.run();
    await server.kill();
    await assert.rejects(running, (e: unknown) => {
      assert.ok(e instanceof ConnectError, String(e));
      assert.match(e.message, /cannot reach the control plane/);
      return true;
    });
    const kinds = restarts.events.map((e) => e.kind);
    assert.deepEqual([kinds[0], kinds.at(-1)], ["failed", "gaveUp"]);
    const gaveUp = await restarts.first("gaveUp");
    assert.ok(gaveUp.error instanceof ConnectError, String(gaveUp.error));
    await assert.rejects(Worker.start({ handlers: { "ts.square": square }, retryForMs: -1 }), ConfigError);
  } finally {
    await server.stop();
  }
});
