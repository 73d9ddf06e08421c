// The task client (TaskClient) against a real `embarcadero serve` and a real `embarcadero
// orchestrator`, through the control port that forwards the workflow API (the counterpart
// of the Python SDK's tests/test_tasks.py): templates registered, tasks started (of the
// newest version when none is named) and waited for by long polls, a wait that runs out,
// a cancelled task, a failed step completed by hand, and every error typed with the
// API's status and code.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import {
  ConfigError,
  EmbarcaderoError,
  StepError,
  HandlerFailure,
  StepHandler,
  TaskClient,
  TimeoutError,
  WorkflowApiError,
} from "../ts/index";
import { Engine, step } from "./engine";
import { waitFor } from "./servers";

const SQUARES = (version: string): string => `name: squares
namespace: ts_tasks
version: ${version}
steps:
  - {name: first, handler: {callable: ts.tasks_square}}
  - {name: second, dependencies: [first], handler: {callable: ts.tasks_square}}
`;

const UNSERVED = `name: unserved
namespace: ts_tasks_unserved
version: 1.0.0
steps:
  - {name: only, handler: {callable: ts.nobody_serves_this}}
`;

const REFUSED = `name: refused
namespace: ts_tasks
version: 1.0.0
steps:
  - name: refuses
    handler: {callable: ts.tasks_refuses}
    retry: {max_attempts: 1}
  - {name: after, dependencies: [refuses], handler: {callable: ts.tasks_square}}
`;

const CALLED_OFF = `name: called_off
namespace: ts_tasks
version: 1.0.0
steps:
  - {name: waits, timeout_seconds: 600, handler: {callable: ts.tasks_waits}}
`;

const square: StepHandler<{ n: number }> = (ctx) => {
  const previous = Object.values(ctx.dependencyResults) as { n: number }[];
  const n = previous.length > 0 ? previous[0]!.n : ctx.context.n;
  return { n: n * n };
};

const HANDLERS: Record<string, StepHandler> = {
  "ts.tasks_square": square,
  "ts.tasks_refuses": () => {
    throw new StepError("refused on purpose", { retryable: false });
  },
};

let engine: Engine;
let client: TaskClient;

/** Whether the control port forwards the API yet (the orchestrator announces itself within a second of serving). */
async function forwards(c: TaskClient): Promise<boolean> {
  try {
    await c.templates();
    return true;
  } catch (e) {
    if (e instanceof WorkflowApiError && e.code === "no_workflow_engine") return false;
    throw e;
  }
}

before(async () => {
  engine = await Engine.start();
  // The control port, which forwards the API to the orchestrator that announced itself.
  client = new TaskClient(engine.server.control);
  await waitFor("the orchestrator to announce itself to the head", () => forwards(client));
});

after(async () => {
  await engine.stop();
});

test("a task runs to completion of the newest version and is found again", { timeout: 90_000 }, async () => {
  for (const version of ["1.0.0", "1.10.0", "1.9.0"]) {
    assert.equal((await client.registerTemplate(SQUARES(version))).version, version);
  }
  assert.equal((await client.template("ts_tasks", "squares")).version, "1.10.0");
  let task;
  {
    await using _worker = await engine.worker(HANDLERS, "ts_tasks");
    task = await client.runTask("ts_tasks", "squares", { n: 3 }, { timeoutMs: 60_000 });
  }
  assert.deepEqual([task.status, task.version], ["complete", "1.10.0"], JSON.stringify(task));
  assert.deepEqual(
    ["first", "second"].map((s) => step(task, s).result),
    [{ n: 9 }, { n: 81 }],
  );
  const uuid = task.task_uuid;
  assert.equal((await client.task(uuid)).status, "complete");
  // The same context again is the same task (identity_strategy strict); a new
  // idempotency key is a new one.
  assert.equal((await client.createTask("ts_tasks", "squares", { n: 3 })).task_uuid, uuid);
  const other = await client.createTask("ts_tasks", "squares", { n: 3 }, { idempotencyKey: "k2" });
  assert.notEqual(other.task_uuid, uuid);
  const listed = await client.tasks({ namespace: "ts_tasks", name: "squares", status: "complete" });
  assert.ok(listed.tasks.some((t) => t.task_uuid === uuid), JSON.stringify(listed));
  assert.deepEqual(
    (await client.steps(uuid)).steps.map((s) => s.name),
    ["first", "second"],
  );
  assert.deepEqual((await client.step(uuid, "second")).result, { n: 81 });
});

test("a wait that runs out rejects, and a cancelled task is finished", { timeout: 60_000 }, async () => {
  await client.registerTemplate(UNSERVED);
  const uuid = (await client.createTask("ts_tasks_unserved", "unserved")).task_uuid;
  const ranOut = await client.wait(uuid, { timeoutMs: 1000 }).catch((e: unknown) => e);
  assert.ok(ranOut instanceof TimeoutError, String(ranOut));
  assert.equal(ranOut.timeoutMs, 1000);
  assert.match(ranOut.message, new RegExp(uuid));
  // A wait given up by its signal ends with the signal's reason.
  const giveUp = new AbortController();
  const abandoned = client.wait(uuid, { signal: giveUp.signal }).catch((e: unknown) => e);
  giveUp.abort(new Error("given up"));
  assert.equal(((await abandoned) as Error).message, "given up");
  assert.equal((await client.cancelTask(uuid)).status, "cancelled");
  // Finished now: the wait answers at once, whatever its limit.
  assert.equal((await client.wait(uuid, { timeoutMs: 300_000 })).status, "cancelled");
  await assert.rejects(client.cancelTask(uuid), (e: unknown) => {
    assert.ok(e instanceof WorkflowApiError, String(e));
    assert.deepEqual([e.status, e.code], [409, "task_closed"]);
    return true;
  });
});

test("a failed step completed by hand lets its task complete", { timeout: 90_000 }, async () => {
  await client.registerTemplate(REFUSED);
  await using _worker = await engine.worker(HANDLERS, "ts_tasks");
  const failed = await client.runTask("ts_tasks", "refused", { n: 2 }, { timeoutMs: 60_000 });
  assert.equal(failed.status, "error", JSON.stringify(failed));
  const uuid = failed.task_uuid;
  const dead = (await client.deadLetters()).entries.map((e) => [e.task_uuid, e.step]);
  assert.deepEqual(dead, [[uuid, "refuses"]]);
  const done = await client.completeStep(uuid, "refuses", { n: 5 }, { reason: "by hand", by: "test" });
  assert.equal(done.current_state, "complete", JSON.stringify(done));
  const task = await client.wait(uuid, { timeoutMs: 60_000 });
  assert.equal(task.status, "complete", JSON.stringify(task));
  assert.deepEqual(step(task, "after").result, { n: 25 });
  assert.deepEqual((await client.deadLetters()).entries, []);
});

test("errors carry the API's status and code", { timeout: 60_000 }, async () => {
  const cases: [() => Promise<unknown>, number, string][] = [
    [() => client.task("no-such-task"), 404, "not_found"],
    [() => client.createTask("ts_tasks", "no_such_template"), 404, "template_not_found"],
    [() => client.registerTemplate("name: x\n"), 400, "invalid_template"],
    [() => new TaskClient("127.0.0.1:1").templates(), 0, "unreachable"],
  ];
  for (const [call, status, code] of cases) {
    await assert.rejects(call(), (e: unknown) => {
      assert.ok(e instanceof WorkflowApiError && e instanceof EmbarcaderoError, String(e));
      assert.deepEqual([e.status, e.code, e.kind], [status, code, "WorkflowApi"], e.message);
      return true;
    });
  }
  // An empty id (which would name the task list) and a client that would wait no time
  // at all are refused before anything is sent, as is a misspelt option.
  await assert.rejects(client.wait(""), ConfigError);
  assert.throws(() => new TaskClient(engine.server.control, { timeoutMs: 0 }), ConfigError);
  assert.throws(() => new TaskClient(engine.server.control, { timeoutMS: 5 } as never), ConfigError);
  await assert.rejects(client.createTask("ts_tasks", "squares", {}, { versoin: "1" } as never), ConfigError);
});

test("a cancelled task aborts its running handler's signal", { timeout: 90_000 }, async () => {
  let started!: () => void;
  const running = new Promise<void>((resolve) => (started = resolve));
  let stopped!: (why: string) => void;
  const told = new Promise<string>((resolve) => (stopped = resolve));
  const waits: StepHandler = (ctx) =>
    new Promise((_resolve, reject) => {
      ctx.signal.addEventListener("abort", () => {
        stopped((ctx.signal.reason as DOMException).name);
        reject(ctx.signal.reason);
      });
      started();
    });
  let toldFailure!: (failure: HandlerFailure) => void;
  const failure = new Promise<HandlerFailure>((resolve) => (toldFailure = resolve));
  await client.registerTemplate(CALLED_OFF);
  const handlers = { "ts.tasks_waits": waits };
  await using _worker = await engine.worker(handlers, "ts_tasks", { onHandlerFailure: toldFailure });
  const uuid = (await client.createTask("ts_tasks", "called_off")).task_uuid;
  await running;
  assert.equal((await client.cancelTask(uuid)).status, "cancelled");
  // Called off, not timed out: the deadline is ten minutes away.
  assert.equal(await told, "AbortError");
  assert.equal(step(await client.task(uuid), "waits").current_state, "cancelled");
  // The rejection it ended with is told as called off, which the default does not warn of.
  const f = await failure;
  assert.deepEqual([f.stepName, f.taskUuid, f.calledOff], ["waits", uuid, true]);
  assert.equal(f.message, `ts.tasks_waits (step waits of task ${uuid}, attempt 1) called off`);
});
