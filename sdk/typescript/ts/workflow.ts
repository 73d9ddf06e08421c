// Step handlers of the workflow engine written in TypeScript (docs/WORKFLOW.md): what a
// handler is given (`StepContext`) and may throw (`StepError`), the registry of
// `stepHandler`, and the `Worker` that runs handlers. The worker is the engine's own Rust
// loop (src/workflow.rs): claims, heartbeats, leases, timeouts, retries and checkpoints are
// the code `embarcadero worker` runs, and so is the supervisor that replaces a worker whose
// log was lost (a server restart). This module only turns a call from that loop (a step's
// context as JSON, queued on the event loop) into a handler call, the handler's settled
// value or thrown error back into the outcome the loop publishes, and the supervisor's
// reports into `onRestart` calls.
import { defaultControl } from "./admin";
import { ConfigError, EmbarcaderoError, settle, translate } from "./errors";
import { native, Native } from "./native";
import * as check from "./options";

/** A JSON value: what task inputs, initializations, results and cursors are. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** A JSON object (a task's input is one). */
export type JsonObject = { [key: string]: Json };

/** A batch worker instance's last saved progress. */
export interface Checkpoint {
  /** Where to go on from. */
  readonly cursor: Json;
  /** Items done up to `cursor`. */
  readonly itemsDone: number;
  /** What the instance had gathered so far (`null` when none was saved). */
  readonly partial: Json;
}

/** What an instance of a `batch_worker` step is given besides its context. */
export interface BatchInput {
  /** The cursor the batchable step gave this instance. */
  readonly cursor: Json;
  /** This instance's number, 1-based, of {@link BatchInput.count}. */
  readonly index: number;
  /** How many instances the batchable step created. */
  readonly count: number;
  /** The last checkpoint an earlier attempt of this instance saved, or `null`. */
  readonly resume: Checkpoint | null;
  /**
   * Saves a checkpoint for the next attempt of this instance to resume from, should this
   * one fail or its worker die. It is an event in the log, applied only while this attempt
   * still holds the step. Resolves once handed to the log; rejects after the handler has
   * settled (the attempt is over).
   */
  checkpoint(cursor: Json, itemsDone: number, partial?: Json): Promise<void>;
}

/**
 * What a handler is given: the same as a Rust handler's `StepContext`.
 * @typeParam Input - the type of the task's input (`context`), as the template's
 *   `input_schema` guarantees it; a JSON object unless said.
 */
export interface StepContext<Input = JsonObject> {
  /** The task's id. */
  readonly taskUuid: string;
  /** This step's name (a batch worker instance's: `process_001`, ...). */
  readonly stepName: string;
  /** 1 for the first attempt. */
  readonly attempt: number;
  /** The task's input. */
  readonly context: Input;
  /** The step's `handler.initialization` from the template (`null` when absent). */
  readonly initialization: Json;
  /** The results of every ancestor step, direct and indirect, by step name. */
  readonly ancestors: Readonly<Record<string, Json>>;
  /** The step's direct dependencies that exist, in the template's order. */
  readonly dependencies: readonly string[];
  /** The results of the direct dependencies, by step name, in that order. */
  readonly dependencyResults: Readonly<Record<string, Json>>;
  /** For an instance of a batch worker step, its cursor and checkpoints; else `null`. */
  readonly batch: BatchInput | null;
  /**
   * When the worker reports this attempt timed out (the step's `timeout_seconds` from when
   * the attempt started); its outcome is dropped from then on.
   */
  readonly deadline: Date;
  /**
   * Aborted once the attempt's outcome is no longer wanted: at {@link StepContext.deadline}
   * (`signal.reason` a `DOMException` named `"TimeoutError"`), or when the attempt is called
   * off before it (its task cancelled or resolved by hand, or the attempt taken back; a
   * `DOMException` named `"AbortError"`). Pass it to `fetch` and other cancellable calls, or
   * check `signal.aborted` in a long loop, so that the handler stops working.
   */
  readonly signal: AbortSignal;
}

/**
 * A step handler: a function of the context returning (or resolving to) the step's result,
 * a JSON-able value (`undefined` is `null`). Throwing fails the attempt (see {@link StepError}).
 * A decision step returns `{ step_names: [...] }`, a batchable step `{ cursors: [...] }`.
 */
// `any` for the input: a handler declares the input type it expects, and a registry holds
// handlers of different inputs.
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type StepHandler<Input = any> = (ctx: StepContext<Input>) => unknown;

/** Options of {@link StepError}. */
export interface StepErrorOptions {
  /** `false` fails the step for good, whatever the template's `retry` policy (default `true`). */
  retryable?: boolean;
  /** Milliseconds before the next attempt, instead of the policy's backoff. */
  retryAfterMs?: number;
  /** The error that caused this one. */
  cause?: unknown;
}

const STEP_ERROR_OPTIONS: check.OptionNames<StepErrorOptions> = {
  retryable: true,
  retryAfterMs: true,
  cause: true,
};

/**
 * Thrown by a handler to fail its attempt on its own terms: whether to retry, and after how
 * long. Any other thrown value is a retryable failure with the message `Name: message`
 * (`TypeError: ...`); whether and when a retryable failure is retried is the template's
 * `retry` policy (`max_attempts`, backoff).
 */
export class StepError extends Error {
  /** Whether the step may be retried (still subject to `max_attempts`). */
  readonly retryable: boolean;
  /** The delay before the next attempt, replacing the policy's backoff; `undefined`: the policy's. */
  readonly retryAfterMs: number | undefined;

  constructor(message: string, options: StepErrorOptions = {}) {
    check.known("StepError", options, STEP_ERROR_OPTIONS);
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    const { retryable = true, retryAfterMs } = options;
    if (retryAfterMs !== undefined && !(Number.isSafeInteger(retryAfterMs) && retryAfterMs >= 0)) {
      throw new RangeError(`retryAfterMs must be a non-negative integer, not ${retryAfterMs}`);
    }
    this.name = "StepError";
    this.retryable = retryable;
    this.retryAfterMs = retryAfterMs;
  }
}

// Handlers registered by `stepHandler`, by callable name: what a Worker runs when it is
// not given handlers of its own.
const registered = new Map<string, StepHandler>();

/**
 * Registers `handler` under `callable` (a template step's `handler.callable`) for every
 * {@link Worker} started without handlers of its own, and returns it unchanged (so it can
 * still be called directly, in tests). Registering another function under a taken name
 * throws.
 */
export function stepHandler<H extends StepHandler>(callable: string, handler: H): H {
  if (typeof handler !== "function") throw new TypeError(`the handler of ${callable} is not a function`);
  const existing = registered.get(callable);
  if (existing !== undefined && existing !== handler) {
    throw new ConfigError(`a handler is already registered for ${callable}`);
  }
  registered.set(callable, handler);
  return handler;
}

/** The handlers registered with {@link stepHandler}, by callable name (a copy). */
export function registeredHandlers(): Map<string, StepHandler> {
  return new Map(registered);
}

/** Options of {@link Worker.start}. */
export interface WorkerOptions {
  /** The control plane's address (default {@link defaultControl}). */
  control?: string;
  /** The namespace or namespaces served (default: every namespace). */
  namespace?: string | readonly string[];
  /** Handlers by callable name (default: those registered with {@link stepHandler}). */
  handlers?: Readonly<Record<string, StepHandler>> | ReadonlyMap<string, StepHandler>;
  /** Attempts run at once (default 32, as `embarcadero worker --concurrency`). */
  concurrency?: number;
  /** The orchestrator's `--lease-ms` (default 3000); heartbeats go out three times per lease. */
  leaseMs?: number;
  /** The orchestrator's `--topic` (default `workflow.events`). */
  topic?: string;
  /**
   * Acknowledgement level of the worker's events (claims, heartbeats, results), as
   * `embarcadero worker --ack`: 1 ordered, 2 durable (the default; needs a topic of rf 2).
   */
  ack?: number;
  /** Replication factor of the topic if the worker creates it (default 2, on disk), `--rf`. */
  rf?: number;
  /**
   * How long, in milliseconds, a lost log (the server gone or restarting) is waited for
   * before the worker ends: {@link Worker.run} then rejects with the last error (a
   * `ConnectError`, say). Default: for as long as the worker is open, as `embarcadero worker`.
   */
  retryForMs?: number;
  /**
   * Called (on the event loop) each time the worker loses its log, a new worker cannot start
   * yet, a new worker runs, or it gives up (see {@link WorkerRestart}). Default: the event's
   * `message` through `console.warn`. It must not throw: what it throws is logged with
   * `console.error` and dropped.
   */
  onRestart?: (event: WorkerRestart) => void;
  /**
   * Called (on the event loop) when a handler throws or rejects, before the failure is
   * published: the task's record keeps only the last attempt's error text, so this is where
   * each attempt's error, with its stack, can be seen. Default: `console.warn` of the
   * failure's `message` and, but for a {@link StepError} (which says what it means), the
   * error itself; nothing for an attempt that was called off. It must not throw: what it
   * throws is logged with `console.error` and dropped.
   */
  onHandlerFailure?: (failure: HandlerFailure) => void;
}

/** A handler's failure, as {@link WorkerOptions.onHandlerFailure} is told it. */
export interface HandlerFailure {
  /** The step's callable (the handler's name). */
  readonly callable: string;
  readonly taskUuid: string;
  readonly stepName: string;
  readonly attempt: number;
  /** What the handler threw or rejected with. */
  readonly error: unknown;
  /**
   * The attempt was called off (its task cancelled or resolved, the attempt taken back) and
   * the handler ended on it, throwing its `signal`'s reason or an `AbortError`: what was
   * asked for, not a failure; nothing of it is published.
   */
  readonly calledOff: boolean;
  /** A sentence saying which attempt failed and why. */
  readonly message: string;
}

/** The default {@link WorkerOptions.onHandlerFailure}, as the Python worker logs. */
function warnOfFailure(failure: HandlerFailure): void {
  if (failure.calledOff) return;
  if (failure.error instanceof StepError) console.warn(failure.message);
  else console.warn(failure.message, failure.error);
}

/** The failure `failure` makes, handed to `onFailure`, which must not throw. Never throws. */
function tell(onFailure: (failure: HandlerFailure) => void, failure: () => HandlerFailure): void {
  try {
    onFailure(failure());
  } catch (e) {
    console.error("embarcadero: the worker's onHandlerFailure threw", e);
  }
}

/** The failure of the attempt `raw` describes, for `onHandlerFailure`. */
function handlerFailure(raw: RawContext, error: unknown, calledOff: boolean): HandlerFailure {
  const { callable, taskUuid, stepName, attempt } = raw;
  const which = `${callable} (step ${stepName} of task ${taskUuid}, attempt ${attempt})`;
  const why = error instanceof StepError ? error.message : describe(error);
  const message = calledOff ? `${which} called off` : `${which} failed: ${why}`;
  return { callable, taskUuid, stepName, attempt, error, calledOff, message };
}

const WORKER_OPTIONS: check.OptionNames<WorkerOptions> = {
  control: true,
  namespace: true,
  handlers: true,
  concurrency: true,
  leaseMs: true,
  topic: true,
  ack: true,
  rf: true,
  retryForMs: true,
  onRestart: true,
  onHandlerFailure: true,
};

/**
 * What a worker reports as it rides out a server restart: its log lost, the worker is
 * replaced by a new one (with a new {@link Worker.id}) with the same handlers, after 250 ms
 * doubling to 10 s between tries.
 */
export interface WorkerRestart {
  /**
   * `failed`: the worker's loop ended because its log was lost (its attempts go back to the
   * orchestrator a lease later); `startFailed`: a new worker could not start yet;
   * `restarted`: a new worker runs; `gaveUp`: the log stayed lost for `retryForMs`, and
   * {@link Worker.run} rejects with `error`.
   */
  readonly kind: "failed" | "startFailed" | "restarted" | "gaveUp";
  /** The failed worker's id (`failed`) or the new one's (`restarted`). */
  readonly workerId: string | undefined;
  /** What went wrong (`failed`, `startFailed`, `gaveUp`). */
  readonly error: EmbarcaderoError | undefined;
  /** When the next try comes (`failed`, `startFailed`). */
  readonly retryInMs: number | undefined;
  /** How long after the loss of the log (`restarted`, `gaveUp`). */
  readonly afterMs: number | undefined;
  /** A sentence saying all this, as logged by default. */
  readonly message: string;
}

/** A report as src/workflow.rs sends it. */
interface RawRestart {
  kind: WorkerRestart["kind"];
  worker: string | null;
  message: string;
  error: string | null;
  retryInMs: number | null;
  afterMs: number | null;
}

/** The native report function: hands each report to `onRestart`. Never throws. */
function reporter(onRestart: (event: WorkerRestart) => void): (text: string) => void {
  return (text) => {
    try {
      const raw = JSON.parse(text) as RawRestart;
      const error = raw.error === null ? undefined : translate(new Error(raw.error));
      onRestart({
        kind: raw.kind,
        workerId: raw.worker ?? undefined,
        error: error instanceof EmbarcaderoError ? error : undefined,
        retryInMs: raw.retryInMs ?? undefined,
        afterMs: raw.afterMs ?? undefined,
        message: raw.message,
      });
    } catch (e) {
      // A throw from a threadsafe call would end the process.
      console.error("embarcadero: the worker's onRestart threw", e);
    }
  };
}

/** The context as src/workflow.rs sends it. */
interface RawContext {
  callable: string;
  taskUuid: string;
  stepName: string;
  attempt: number;
  context: JsonObject;
  initialization: Json;
  ancestors: Record<string, Json>;
  dependencies: string[];
  batch: { cursor: Json; index: number; count: number; resume: Checkpoint | null } | null;
  deadlineUnixMs: number;
}

/** `value` as JSON text, or a non-retryable StepError: retrying cannot fix a bug in the handler. */
function resultJson(value: unknown): string {
  let text: string | undefined;
  try {
    text = JSON.stringify(value === undefined ? null : value);
  } catch (e) {
    throw new StepError(`the handler's result is not JSON: ${e instanceof Error ? e.message : String(e)}`, {
      retryable: false,
    });
  }
  if (text === undefined) {
    throw new StepError(`the handler's result is not JSON: a ${typeof value}`, { retryable: false });
  }
  return text;
}

/** An argument of `checkpoint` as JSON text. */
function argJson(what: string, value: Json): string {
  const text = JSON.stringify(value);
  if (text === undefined) throw new TypeError(`the checkpoint's ${what} is not JSON`);
  return text;
}

/** A thrown value as the failure the worker loop publishes. Never throws. */
function failureOf(e: unknown): Native.NativeStepError {
  if (e instanceof StepError) {
    return { message: e.message, retryable: e.retryable, retryAfterMs: e.retryAfterMs };
  }
  return { message: describe(e), retryable: true };
}

/**
 * A thrown value in words: `Name: message` for an `Error`. Never throws, whatever was thrown
 * (`String(Object.create(null))` does, and so may a `message` getter).
 */
function describe(e: unknown): string {
  try {
    return e instanceof Error ? `${e.name}: ${e.message}` : String(e);
  } catch {
    return Object.prototype.toString.call(e);
  }
}

/**
 * The handler's context for call `id`. Checkpoints it starts are added to `checkpoints`,
 * which the call awaits before reporting its outcome: a checkpoint the handler did not
 * await still reaches the log before the result, while the attempt holds the step.
 */
function contextOf(
  raw: RawContext,
  id: number,
  started: Promise<Native.NativeWorker>,
  checkpoints: Promise<void>[],
  signal: AbortSignal,
): StepContext {
  const dependencyResults: Record<string, Json> = {};
  for (const name of raw.dependencies) dependencyResults[name] = raw.ancestors[name] ?? null;
  const b = raw.batch;
  const batch: BatchInput | null =
    b === null
      ? null
      : {
          cursor: b.cursor,
          index: b.index,
          count: b.count,
          resume: b.resume,
          checkpoint(cursor: Json, itemsDone: number, partial?: Json): Promise<void> {
            const saved = (async () => {
              const partialText = partial === undefined ? undefined : argJson("partial result", partial);
              const worker = await started;
              await settle(worker.checkpoint(id, argJson("cursor", cursor), itemsDone, partialText));
            })();
            checkpoints.push(saved);
            // Marked handled, so that a handler that does not await it cannot crash Node with
            // an unhandled rejection; one that awaits it still sees the rejection.
            saved.catch(() => {});
            return saved;
          },
        };
  return {
    taskUuid: raw.taskUuid,
    stepName: raw.stepName,
    attempt: raw.attempt,
    context: raw.context,
    initialization: raw.initialization,
    ancestors: raw.ancestors,
    dependencies: raw.dependencies,
    dependencyResults,
    batch,
    deadline: new Date(raw.deadlineUnixMs),
    signal,
  };
}

/** The calls whose handler runs, by call id: what aborts each one's `signal`. */
type Running = Map<number, AbortController>;

/**
 * The `signal` of a call: aborted at `deadlineUnixMs` or when the native worker calls the
 * attempt off ({@link callOffOf}). Its timer keeps Node alive no more than
 * `AbortSignal.timeout`'s does, and is cleared once the signal aborts or the call ends.
 *
 * Never before the deadline: a Node timer counts from the event loop's cached time, so it
 * can fire early by however long the loop had been busy; one that fires early is set again
 * for what is left. (A handler that rejected at an early abort was reported with its own
 * error instead of the worker's "timed out after N s".)
 */
function attemptSignal(deadlineUnixMs: number, controller: AbortController): () => void {
  let timer: NodeJS.Timeout;
  const arm = (): void => {
    const left = deadlineUnixMs - Date.now();
    if (left > 0) {
      timer = setTimeout(arm, left);
      timer.unref();
      return;
    }
    controller.abort(new DOMException("the step's deadline passed", "TimeoutError"));
  };
  timer = setTimeout(arm, Math.max(0, deadlineUnixMs - Date.now()));
  timer.unref();
  return () => clearTimeout(timer);
}

/**
 * Whether the handler ended with `error` because the worker called the attempt off: `signal`
 * was aborted for that (not at its deadline) and the handler threw its reason or an
 * `AbortError` (what `fetch` and friends throw on it). Any other error is a failure.
 */
function calledOff(signal: AbortSignal, error: unknown): boolean {
  const reason: unknown = signal.reason;
  if (!(signal.aborted && reason instanceof DOMException && reason.name === "AbortError")) return false;
  return error === reason || (error instanceof Error && error.name === "AbortError");
}

/** The native worker's word that call `id` was called off: aborts its signal. Never throws. */
function callOffOf(running: Running): (id: number) => void {
  return (id) => {
    const why = "the attempt was called off: its task was cancelled or resolved, or the attempt was taken back";
    running.get(id)?.abort(new DOMException(why, "AbortError"));
  };
}

/** Runs the handler of one call from the loop and reports its outcome. Never rejects. */
async function runCall(
  handlers: ReadonlyMap<string, StepHandler>,
  running: Running,
  id: number,
  text: string,
  started: Promise<Native.NativeWorker>,
  onFailure: (failure: HandlerFailure) => void,
): Promise<void> {
  let result: string | undefined;
  let failure: Native.NativeStepError | undefined;
  const checkpoints: Promise<void>[] = [];
  const controller = new AbortController();
  running.set(id, controller);
  let clearTimer = (): void => {};
  let raw: RawContext | undefined;
  try {
    raw = JSON.parse(text) as RawContext;
    clearTimer = attemptSignal(raw.deadlineUnixMs, controller);
    const handler = handlers.get(raw.callable);
    if (handler === undefined) throw new StepError(`no handler for ${raw.callable}`, { retryable: false });
    result = resultJson(await handler(contextOf(raw, id, started, checkpoints, controller.signal)));
  } catch (e) {
    failure = failureOf(e);
    const context = raw;
    if (context !== undefined) tell(onFailure, () => handlerFailure(context, e, calledOff(controller.signal, e)));
  } finally {
    clearTimer();
    running.delete(id);
  }
  // A checkpoint's own failure is the handler's to see (its Promise rejects); here it only
  // has to be out of the way before the result.
  await Promise.allSettled(checkpoints);
  try {
    const worker = await started;
    try {
      worker.complete(id, result, failure);
    } catch (e) {
      // Only a bug of this module gets here; the attempt must still end, or it would hold
      // its attempt thread until the step's timeout.
      worker.complete(id, undefined, { message: `cannot report the outcome: ${String(e)}`, retryable: true });
    }
  } catch {
    // The worker never started (no call can come then) or is closed: nothing to report to.
  }
}

/** Options of {@link Worker.run}. */
export interface RunOptions {
  /** Aborting it closes the worker, and `run` resolves once closed. */
  signal?: AbortSignal;
}

const RUN_OPTIONS: check.OptionNames<RunOptions> = { signal: true };

/**
 * Runs step handlers for the engine: claims enqueued attempts of its namespaces whose
 * handler it has, runs them (at most `concurrency` at once) and publishes their results.
 * The loop runs on threads of its own; a handler is called on the event loop, and an async
 * handler is awaited there, so handlers may await anything. Nothing blocks the event loop.
 *
 * It works from `start` until {@link Worker.close} (or the end of an `await using` scope).
 * An open worker keeps Node running, as a server does. It rides out a server restart: when
 * its log is lost, it is replaced by a new worker (a new {@link Worker.id}) with the same
 * handlers, with backoff, for as long as it is open or up to `retryForMs`; each failure and
 * restart goes to `onRestart` (default: `console.warn`). An error no new worker would mend
 * ends it at once. `start` itself rejects if the first worker cannot start.
 *
 * ```ts
 * await using worker = await Worker.start({ namespace: "demo" });
 * await worker.run({ signal }); // until `signal` aborts
 * ```
 */
export class Worker {
  readonly #native: Native.NativeWorker;
  #closing: Promise<void> | undefined;

  private constructor(nativeWorker: Native.NativeWorker) {
    this.#native = nativeWorker;
  }

  /** Connects to the log and starts working; resolves once connected (rejects if it cannot). */
  static async start(options: WorkerOptions = {}): Promise<Worker> {
    check.known("Worker.start", options, WORKER_OPTIONS);
    const given = options.handlers;
    const handlers: Map<string, StepHandler> =
      given === undefined
        ? registeredHandlers()
        : new Map(given instanceof Map ? given : Object.entries(given as Record<string, StepHandler>));
    if (handlers.size === 0) {
      throw new ConfigError("no handlers: register some with stepHandler or pass handlers");
    }
    for (const [name, h] of handlers) {
      if (typeof h !== "function") throw new TypeError(`the handler of ${name} is not a function`);
    }
    const { concurrency = 32, leaseMs = 3000 } = options;
    if (!(Number.isSafeInteger(concurrency) && concurrency >= 1 && concurrency < 2 ** 32)) {
      throw new ConfigError(`concurrency must be a positive integer, not ${concurrency}`);
    }
    if (!(Number.isFinite(leaseMs) && leaseMs >= 1)) {
      throw new ConfigError(`leaseMs must be at least 1, not ${leaseMs}`);
    }
    const { ack = 2, rf = 2, retryForMs } = options;
    if (!((ack === 1 || ack === 2) && Number.isSafeInteger(rf) && rf >= 1 && rf < 256)) {
      throw new ConfigError(`ack must be 1 or 2 and rf at least 1, not ack ${ack}, rf ${rf}`);
    }
    if (retryForMs !== undefined && !(Number.isSafeInteger(retryForMs) && retryForMs >= 0)) {
      throw new ConfigError(`retryForMs must be a non-negative integer, not ${retryForMs}`);
    }
    const ns = options.namespace;
    const config: Native.NativeWorkerConfig = {
      namespaces: ns === undefined ? [] : typeof ns === "string" ? [ns] : [...ns],
      concurrency,
      leaseMs,
      topic: options.topic ?? "workflow.events",
      ack,
      rf,
      retryForMs,
    };
    const report = reporter(options.onRestart ?? ((event) => console.warn(event.message)));
    // Calls can only come once `startWorker` has resolved (the loop claims after its
    // replay), so `started` is assigned by the time `dispatch` runs; it awaits it anyway.
    // `dispatch` must not throw: a throw from a threadsafe call ends the process.
    const running: Running = new Map();
    const onFailure = options.onHandlerFailure ?? warnOfFailure;
    const dispatch = (id: number, text: string): void => {
      void runCall(handlers, running, id, text, started, onFailure);
    };
    const control = options.control ?? defaultControl();
    const callOff = callOffOf(running);
    const started = settle(native.startWorker(dispatch, report, callOff, [...handlers.keys()], control, config));
    return new Worker(await started);
  }

  /**
   * The current worker's id, as its claims and results name it in the log. It changes each
   * time the worker is replaced after losing its log.
   */
  get id(): string {
    return this.#native.id;
  }

  /**
   * Waits while the worker works, riding out server restarts: resolves once it is closed
   * (by {@link Worker.close} or `signal`), rejects with the error that ended it for good:
   * one no new worker mends (a topic of the wrong order, say), or the last one once the log
   * stayed lost for `retryForMs`.
   */
  async run(options: RunOptions = {}): Promise<void> {
    check.known("Worker.run", options, RUN_OPTIONS);
    const { signal } = options;
    const abort = (): void => {
      this.close().catch(() => {}); // `run` reports the error below
    };
    signal?.addEventListener("abort", abort, { once: true });
    try {
      if (signal?.aborted) abort();
      while (!(await settle(this.#native.wait(250)))) {
        // The loop runs on its own thread; this only waits for its end, in slices.
      }
    } finally {
      signal?.removeEventListener("abort", abort);
    }
    await this.close();
  }

  /**
   * Stops claiming, waits until every attempt already running has finished and its result
   * is acknowledged by the log (a handler that does not settle is given up at its step's
   * `timeout_seconds`), heartbeating meanwhile so that no running attempt loses its lease,
   * then releases the handlers, so Node may exit. Between a lost log and its new worker it
   * resolves at once, starting none. Rejects with the error that ended the worker for good,
   * if one did. Idempotent: later calls return the same Promise. Not from inside a
   * handler that awaits it: the close waits for that handler.
   */
  close(): Promise<void> {
    this.#closing ??= settle(this.#native.stop());
    return this.#closing;
  }

  /** `await using worker = await Worker.start(...)` closes it at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}
