// The workflow engine's API as a client: templates, tasks, and an operator's actions on
// them (docs/WORKFLOW.md lists every route). Requests run through the Rust `ApiClient`
// the CLI uses, off the event loop; documents are the API's own (Tasker's snake_case
// field names), and errors are `WorkflowApiError`s with the API's status and code.
import { native, Native } from "./native";
import { ConfigError, settle, TimeoutError } from "./errors";
import { defaultControl } from "./admin";
import type { Json, JsonObject } from "./workflow";
import * as check from "./options";

/** A task's state: the first four are finished (`error` may still be reopened by an operator). */
export type TaskStatus =
  | "complete"
  | "error"
  | "cancelled"
  | "resolved_manually"
  | "pending"
  | "initializing"
  | "enqueuing_steps"
  | "steps_in_process"
  | "evaluating_results"
  | "waiting_for_dependencies"
  | "waiting_for_retry"
  | "blocked_by_failures";

/** One step of a task as the API shows it (more fields than these: see docs/WORKFLOW.md). */
export type TaskStep = JsonObject & {
  /** Unique in its task (batch instances are numbered). */
  name: string;
  /** Its state (`complete`, `error`, `in_progress`...). */
  current_state: string;
  /** Its handler's result once complete, else `null`. */
  result: Json;
  /** Attempts started. */
  attempts: number;
};

/** A task as the API shows it (more fields than these: see docs/WORKFLOW.md). */
export type Task = JsonObject & {
  task_uuid: string;
  namespace: string;
  name: string;
  version: string;
  status: TaskStatus;
  /** The task's input. */
  context: Json;
  steps: TaskStep[];
};

/** One page of {@link TaskClient.tasks}: each task without its steps and context. */
export type TaskList = JsonObject & { tasks: JsonObject[]; pagination: JsonObject };

/** One page of {@link TaskClient.deadLetters}. */
export type DeadLetters = JsonObject & { entries: JsonObject[]; pagination: JsonObject };

/** Options of the {@link TaskClient}. */
export interface TaskClientOptions {
  /** Gives up on a request after this many milliseconds (default 20 s); a wait's long polls take their own. */
  timeoutMs?: number;
}

/** Options of {@link TaskClient.createTask}. */
export interface CreateTaskOptions {
  /** The template's version (default: its newest registered version). */
  version?: string;
  /** A second create with the same key is answered with the first task. */
  idempotencyKey?: string;
}

/** Options of {@link TaskClient.tasks}. */
export interface TaskListOptions {
  namespace?: string;
  name?: string;
  status?: TaskStatus;
  /** From 1 (default 1). */
  page?: number;
  /** At most 100 (default 25). */
  perPage?: number;
}

/** Options of the step actions ({@link TaskClient.resetStep} and the others). */
export interface StepActionOptions {
  /** Why: recorded in the step's audit trail. */
  reason: string;
  /** Who: recorded with the reason. */
  by?: string;
}

const CLIENT_OPTIONS: check.OptionNames<TaskClientOptions> = { timeoutMs: true };
const CREATE_OPTIONS: check.OptionNames<CreateTaskOptions> = { version: true, idempotencyKey: true };
const LIST_OPTIONS: check.OptionNames<TaskListOptions> = {
  namespace: true,
  name: true,
  status: true,
  page: true,
  perPage: true,
};
const ACTION_OPTIONS: check.OptionNames<StepActionOptions> = { reason: true, by: true };

/**
 * One path segment: a uuid, name or version, escaped so it stays one segment; an empty one
 * would name another route (`/v1/tasks/` is the task list).
 */
function part(value: string): string {
  if (typeof value !== "string" || value === "") throw new ConfigError(`an id or name must be a non-empty string, not ${JSON.stringify(value)}`);
  return encodeURIComponent(value);
}

/** The longest one request of a wait waits (a long poll of a second), so that an abort comes through within about that long. */
const WAIT_SLICE_MS = 1000;

/** Options of {@link TaskClient.wait}. */
export interface WaitOptions {
  /** Give up (with a {@link TimeoutError}) after this many milliseconds; default: no limit. The API counts whole seconds, so a wait is at least one. */
  timeoutMs?: number;
  /** Aborting it ends the wait within about a second, rejecting with its reason. */
  signal?: AbortSignal;
}

/**
 * Client of the workflow engine's API: register templates, start tasks and wait for
 * them, act on failed ones. Every method answers a Promise; errors are
 * {@link WorkflowApiError}s carrying the API's `status` and `code`.
 *
 * @example
 * const tasks = new TaskClient(); // the control port, which forwards the API
 * const task = await tasks.runTask("demo", "squares", { n: 3 }, { timeoutMs: 30_000 });
 * console.log(task.status, task.steps.map((s) => [s.name, s.result]));
 */
export class TaskClient {
  readonly #native: Native.NativeTaskClient;

  /**
   * @param control - The control port's `host:port` or `http://` URL, which forwards the API
   * (default: `EMBARCADERO_CONTROL`, else `127.0.0.1:12140`), or an orchestrator's own address.
   * @param options - See {@link TaskClientOptions}; an unknown option is a {@link ConfigError}.
   */
  constructor(control: string = defaultControl(), options: TaskClientOptions = {}) {
    check.known("TaskClient", options, CLIENT_OPTIONS);
    const timeoutMs = check.millis("timeoutMs", options.timeoutMs) ?? 20_000;
    if (timeoutMs < 1) throw new ConfigError(`timeoutMs ${timeoutMs}: want at least 1 (each request's longest wait for its answer)`);
    this.#native = new native.NativeTaskClient(control, timeoutMs);
  }

  /** The API's base URL (`http://host:port`). */
  get url(): string {
    return this.#native.url;
  }

  /**
   * Registers a template (its YAML text); resolves it as the engine holds it. The same
   * template again is accepted; other content under a registered version is code
   * `template_conflict`, an invalid template `invalid_template`.
   */
  async registerTemplate(yaml: string): Promise<JsonObject> {
    return (await settle(() => this.#native.registerTemplate(yaml))) as JsonObject;
  }

  /** Every registered template: `{ templates: [...] }`, each its name, version and steps. */
  async templates(): Promise<JsonObject> {
    return this.#request("GET", "/v1/templates");
  }

  /** Template `namespace/name` at `version`, or its newest version, whole. */
  async template(namespace: string, name: string, version?: string): Promise<JsonObject> {
    const at = version === undefined ? "" : `/${part(version)}`;
    return this.#request("GET", `/v1/templates/${part(namespace)}/${part(name)}${at}`);
  }

  /**
   * Starts a task of template `namespace/name` with `context` as its input; resolves it
   * (`task_uuid`, `status`...). A second call with the same `idempotencyKey` (or, without
   * one, the same context, per the template's `identity_strategy`) resolves the first
   * task instead of a new one. Code `backpressure` (status 503): the engine holds its
   * maximum of open tasks; try again later.
   */
  async createTask(namespace: string, name: string, context: JsonObject = {}, options: CreateTaskOptions = {}): Promise<Task> {
    check.known("createTask", options, CREATE_OPTIONS);
    const version = check.text("version", options.version) ?? (await settle(() => this.#native.newestVersion(namespace, name)));
    const key = check.text("idempotencyKey", options.idempotencyKey);
    const answer = await settle(() => this.#native.createTask(namespace, name, version, context, key));
    return answer.task as Task;
  }

  /** Task `uuid` as it stands, with its steps and their results. */
  async task(uuid: string): Promise<Task> {
    return (await this.#request("GET", `/v1/tasks/${part(uuid)}`)) as Task;
  }

  /**
   * Task `uuid` once it is finished: `complete`, `error`, `cancelled` or `resolved_manually`
   * (check `status`). Waits by long polls of a second each, which cost the engine nothing
   * meanwhile. Rejects with {@link TimeoutError} once `timeoutMs` (default: no limit) has
   * passed with the task unfinished, or with the `signal`'s reason once it aborts; a task
   * `blocked_by_failures` is not finished (it waits for an operator or a retry).
   */
  async wait(uuid: string, options: WaitOptions = {}): Promise<Task> {
    check.known("wait", options, { timeoutMs: true, signal: true });
    part(uuid);
    const limit = check.wait("timeoutMs", options.timeoutMs);
    const deadline = limit === undefined || limit === Infinity ? Infinity : Date.now() + limit;
    const { signal } = options;
    let task: Task | undefined;
    for (let first = true; first || Date.now() < deadline; first = false) {
      signal?.throwIfAborted();
      const slice = Math.min(WAIT_SLICE_MS, Math.max(0, deadline - Date.now()));
      const answer = await settle(() => this.#native.waitTask(uuid, slice));
      task = answer.task as Task;
      if (answer.flag) return task;
    }
    signal?.throwIfAborted();
    const what = `task ${uuid} is still ${task?.status} after ${limit} ms`;
    throw new TimeoutError(`${what} (wait again, or see which step it waits for with steps())`, limit ?? 0);
  }

  /** {@link createTask}, then {@link wait}: the finished task. */
  async runTask(
    namespace: string,
    name: string,
    context: JsonObject = {},
    options: CreateTaskOptions & WaitOptions = {},
  ): Promise<Task> {
    const { timeoutMs, signal, ...create } = options;
    const task = await this.createTask(namespace, name, context, create);
    return this.wait(task.task_uuid, { timeoutMs, signal });
  }

  /** One page of tasks, oldest first, filtered by template and status. */
  async tasks(options: TaskListOptions = {}): Promise<TaskList> {
    check.known("tasks", options, LIST_OPTIONS);
    const query = new URLSearchParams({
      page: String(check.count("page", options.page, 1) ?? 1),
      per_page: String(check.count("perPage", options.perPage, 1) ?? 25),
    });
    for (const key of ["namespace", "name", "status"] as const) {
      const value = check.text(key, options[key]);
      if (value !== undefined) query.set(key, value);
    }
    return (await this.#request("GET", `/v1/tasks?${query}`)) as TaskList;
  }

  /** Cancels an unfinished task (and its unfinished steps); code `task_closed` if it had finished. */
  async cancelTask(uuid: string): Promise<Task> {
    return (await this.#request("DELETE", `/v1/tasks/${part(uuid)}`)) as Task;
  }

  /** Ends a task by hand (`resolved_manually`), its unfinished steps cancelled. */
  async resolveTask(uuid: string, options: { reason?: string; by?: string } = {}): Promise<Task> {
    check.known("resolveTask", options, { reason: true, by: true });
    const body = { reason: options.reason ?? null, resolved_by: options.by ?? null };
    return (await this.#request("POST", `/v1/tasks/${part(uuid)}/resolve`, body)) as Task;
  }

  /** Reopens a failed task: each failed step runs again with a fresh retry budget. */
  async rerunTask(uuid: string, options: { reason?: string } = {}): Promise<Task> {
    check.known("rerunTask", options, { reason: true });
    return (await this.#request("POST", `/v1/tasks/${part(uuid)}/rerun`, { reason: options.reason ?? null })) as Task;
  }

  /** Every step of task `uuid`: `{ task_uuid, steps: [...] }`. */
  async steps(uuid: string): Promise<JsonObject & { steps: TaskStep[] }> {
    return (await this.#request("GET", `/v1/tasks/${part(uuid)}/workflow_steps`)) as JsonObject & { steps: TaskStep[] };
  }

  /** Step `step` of task `uuid`. */
  async step(uuid: string, step: string): Promise<TaskStep> {
    return (await this.#request("GET", `/v1/tasks/${part(uuid)}/workflow_steps/${part(step)}`)) as TaskStep;
  }

  /** Runs a failed step again (`error -> pending`) with a fresh retry budget. */
  async resetStep(uuid: string, step: string, options: StepActionOptions): Promise<TaskStep> {
    return this.#stepAction(uuid, step, "reset_for_retry", options, null);
  }

  /** Marks a failed step `resolved_manually`, which lets its dependents run. */
  async resolveStep(uuid: string, step: string, options: StepActionOptions): Promise<TaskStep> {
    return this.#stepAction(uuid, step, "resolve_manually", options, null);
  }

  /** Completes a failed step by hand with `result` as its result. */
  async completeStep(uuid: string, step: string, result: Json, options: StepActionOptions): Promise<TaskStep> {
    return this.#stepAction(uuid, step, "complete_manually", options, result);
  }

  /** One page of the dead-letter list: every failed step of a blocked or failed task, with why. */
  async deadLetters(options: { page?: number; perPage?: number } = {}): Promise<DeadLetters> {
    check.known("deadLetters", options, { page: true, perPage: true });
    const page = check.count("page", options.page, 1) ?? 1;
    const perPage = check.count("perPage", options.perPage, 1) ?? 25;
    return (await this.#request("GET", `/v1/dlq?page=${page}&per_page=${perPage}`)) as DeadLetters;
  }

  async #stepAction(uuid: string, step: string, action: string, options: StepActionOptions, result: Json): Promise<TaskStep> {
    check.known(action, options, ACTION_OPTIONS);
    const reason = check.text("reason", options.reason) ?? "";
    const body = { action_type: action, reason, by: options.by ?? null, completion_data: result };
    return (await this.#request("PATCH", `/v1/tasks/${part(uuid)}/workflow_steps/${part(step)}`, body)) as TaskStep;
  }

  async #request(method: string, path: string, body?: JsonObject): Promise<JsonObject> {
    return (await settle(() => this.#native.request(method, path, body))) as JsonObject;
  }
}
