// A server and a workflow orchestrator on it for the workflow tests (workflow.test.ts,
// tasks.test.ts), with a client of the orchestrator's API over plain `fetch`.
import assert from "node:assert/strict";
import { Json, StepHandler, Worker, WorkerOptions } from "../ts/index";
import { Proc, Server } from "./servers";

export const LEASE_MS = 3000;

export type Task = Record<string, Json> & { task_uuid: string; status: string; steps: Step[] };
export type Step = Record<string, Json> & { name: string; transitions: { to: string }[] };

/** A server, an orchestrator on it (accepting any handler name) and a client of its API. */
export class Engine {
  private constructor(
    readonly server: Server,
    readonly orchestrator: Proc,
    readonly api: string,
  ) {}

  /** On `server` if given (stopped with the engine), else on a server of its own. */
  static async start(given?: Server): Promise<Engine> {
    const server = given ?? (await Server.serve());
    const args = ["orchestrator", "--control", server.control, "--listen", "127.0.0.1:0"];
    const orchestrator = new Proc([...args, "--lease-ms", String(LEASE_MS), "--any-handler"]);
    const line = await orchestrator.waitLine("workflow orchestrator is serving");
    return new Engine(server, orchestrator, "http://" + line.split("http://").pop()!.trim());
  }

  async request(method: string, path: string, body?: string, kind?: string): Promise<unknown> {
    const headers = kind ? { "content-type": kind } : undefined;
    const answer = await fetch(this.api + path, { method, body, headers });
    const text = await answer.text();
    assert.ok(answer.ok, `${method} ${path}: ${answer.status} ${text}`);
    return JSON.parse(text);
  }

  async register(template: string): Promise<void> {
    await this.request("POST", "/v1/templates", template, "application/yaml");
  }

  async create(namespace: string, name: string, context: Json): Promise<string> {
    const body = JSON.stringify({ namespace, name, version: "1.0.0", context });
    return ((await this.request("POST", "/v1/tasks", body, "application/json")) as Task).task_uuid;
  }

  /** The task once finished (the API's long poll, at most `seconds`). */
  async finished(uuid: string, seconds = 60): Promise<Task> {
    return (await this.request("GET", `/v1/tasks/${uuid}?wait=${seconds}`)) as Task;
  }

  /** Creates a task and returns it once finished. */
  async runTask(namespace: string, name: string, context: Json): Promise<Task> {
    return this.finished(await this.create(namespace, name, context));
  }

  worker(handlers: Record<string, StepHandler>, namespace: string, options: WorkerOptions = {}): Promise<Worker> {
    return Worker.start({ control: this.server.control, namespace, handlers, leaseMs: LEASE_MS, ...options });
  }

  async stop(): Promise<void> {
    await this.orchestrator.end("SIGTERM");
    await this.server.stop();
  }
}

export function step<S extends { name: string }>(task: { steps: S[] }, name: string): S {
  const s = task.steps.find((x) => x.name === name);
  assert.ok(s, `no step ${name} in ${JSON.stringify(task)}`);
  return s;
}
