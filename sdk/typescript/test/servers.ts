// Real `embarcadero` processes for the suite: the binary named by EMBARCADERO_BIN (the
// cargo-built one; test.sh sets it), on ephemeral ports, with a temporary data directory.
// Every wait is for a line the process prints or a condition, with a deadline.
import { ChildProcess, spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { AddressInfo, createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { after, before } from "node:test";
import { Admin } from "../ts/index";

const BIN = process.env.EMBARCADERO_BIN ?? "embarcadero";

/** Fast failure detection for cluster tests: dead after 3 x 100 ms. */
export const FAST_CLUSTER = {
  EMBARCADERO_CLUSTER_HEARTBEAT_INTERVAL_MS: "100",
  EMBARCADERO_CLUSTER_SEQUENCER_LEASE_MS: "400",
};

/**
 * The region settings of every test server: 64 topic slots instead of 256, so a
 * server's region is about 1.3 GiB instead of 2.8 GiB. `serve` refuses a region its
 * filesystem could not hold whole, and a CI host's disk can be nearly full. The logs
 * keep their default size: a module's tests share a server and fill them. Not applied
 * to a server started with a config file of the test's own.
 */
export const TEST_REGION = {
  EMBARCADERO_REGION_MAX_TOPICS: "64",
};

/** A running `embarcadero` process whose stderr lines can be waited for. */
export class Proc {
  readonly child: ChildProcess;
  readonly #lines: string[] = [];
  #waiters: (() => void)[] = [];
  #exited = false;

  constructor(args: string[], env: Record<string, string> = {}) {
    this.child = spawn(BIN, args, {
      env: { ...process.env, ...env, NO_COLOR: "1" },
      stdio: ["ignore", "ignore", "pipe"],
    });
    createInterface({ input: this.child.stderr! }).on("line", (line) => {
      this.#lines.push(line);
      if (process.env.EMBARCADERO_TEST_ECHO) process.stderr.write(`[${args[0]}] ${line}\n`);
      this.#wake();
    });
    this.child.on("exit", () => {
      this.#exited = true;
      this.#wake();
    });
  }

  #wake(): void {
    const w = this.#waiters;
    this.#waiters = [];
    for (const f of w) f();
  }

  /** Waits (at most `ms`) for a stderr line containing `marker`; returns it. */
  async waitLine(marker: string, ms = 30_000): Promise<string> {
    const deadline = Date.now() + ms;
    for (let seen = 0; ; ) {
      for (; seen < this.#lines.length; seen++) {
        if (this.#lines[seen]!.includes(marker)) return this.#lines[seen]!;
      }
      if (this.#exited) throw new Error(`${BIN} exited before printing ${marker}:\n${this.#lines.join("\n")}`);
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`no line with ${marker} within ${ms} ms:\n${this.#lines.join("\n")}`);
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, left);
        this.#waiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
  }

  /** Sends `signal` and waits for the process to exit. */
  async end(signal: NodeJS.Signals = "SIGKILL"): Promise<void> {
    if (this.#exited) return;
    const exited = new Promise<void>((resolve) => this.child.once("exit", () => resolve()));
    this.child.kill(signal);
    await exited;
  }
}

/** The control API address in a serving line ("... control API http://ADDR ..."). */
function controlAddress(line: string): string {
  const m = /control API http:\/\/(\S+)/.exec(line);
  if (!m) throw new Error(`no control address in ${line}`);
  return m[1]!;
}

/** A port free now (the kernel's choice), for a server that must come back on it. */
async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  await new Promise<void>((resolve) => server.close(() => resolve()));
  return port;
}

/** `embarcadero serve` (or a cluster head) with its data directory; `stop` cleans up. */
export class Server {
  /** The process's arguments and environment, for `restart`. */
  #args: string[] = [];
  #env: Record<string, string> = {};

  constructor(
    public proc: Proc,
    readonly control: string,
    readonly dataDir: string,
  ) {}

  /** Starts `embarcadero serve` on ephemeral ports and waits until it serves. */
  static async serve(extra: string[] = []): Promise<Server> {
    return Server.#start(["serve"], extra, {});
  }

  /**
   * Starts `embarcadero serve` with one broker on ports chosen now (the ports after the base
   * one are not known to be free), so that {@link Server.restart} comes back on them.
   */
  static async serveOnFixedPorts(): Promise<Server> {
    const [base, control] = [await freePort(), await freePort()];
    const ports = ["--base-port", String(base), "--control-port", String(control)];
    return Server.#start(["serve"], ["--brokers", "1"], {}, ports);
  }

  /** Starts the server again after `kill`, on the same data directory and arguments. */
  async restart(): Promise<void> {
    this.proc = new Proc(this.#args, this.#env);
    const again = controlAddress(await this.proc.waitLine("embarcadero is serving"));
    if (again !== this.control) throw new Error(`restarted at ${again}, not ${this.control}`);
  }

  /**
   * Starts `embarcadero serve` with `toml` as its configuration file (e.g. `[broker]\nshm = false`),
   * written into the server's data directory.
   */
  static async serveConfig(toml: string, extra: string[] = []): Promise<Server> {
    const dir = mkdtempSync(join(tmpdir(), "embarcadero-ts-config-"));
    const file = join(dir, "serve.toml");
    writeFileSync(file, toml);
    try {
      return await Server.serve(["--config", file, ...extra]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }

  /** Starts a cluster head (`broker --head`) with `brokers` broker ids, fast failure detection. */
  static async head(brokers: number): Promise<Server> {
    return Server.#start(["broker", "--head"], ["--brokers", String(brokers)], FAST_CLUSTER);
  }

  static async #start(
    cmd: string[],
    extra: string[],
    env: Record<string, string>,
    ports = ["--base-port", "0", "--control-port", "0"],
  ): Promise<Server> {
    const dataDir = mkdtempSync(join(tmpdir(), "embarcadero-ts-"));
    const args = [...cmd, ...ports, "--data-dir", dataDir, ...extra];
    // A test's own config file is taken as it is (the environment would override it).
    const region = extra.includes("--config") ? {} : TEST_REGION;
    const proc = new Proc(args, { ...region, ...env });
    const line = await proc.waitLine("embarcadero is serving");
    const server = new Server(proc, controlAddress(line), dataDir);
    [server.#args, server.#env] = [args, { ...region, ...env }];
    return server;
  }

  /** A follower broker process for broker `id` of this head. */
  async follower(id: number): Promise<Proc> {
    const p = new Proc(["broker", "--follower", "--head-addr", this.control, "--broker-id", String(id)]);
    await p.waitLine("is serving at");
    return p;
  }

  /** SIGKILL, as a crash would; the data directory stays until `cleanup`. */
  async kill(): Promise<void> {
    await this.proc.end("SIGKILL");
  }

  /** Stops the server and removes its data. */
  async stop(): Promise<void> {
    await this.proc.end("SIGKILL");
    rmSync(this.dataDir, { recursive: true, force: true });
  }
}

/** Polls `cond` until it holds, failing after `ms`. */
export async function waitFor(what: string, cond: () => boolean | Promise<boolean>, ms = 30_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

/** A unique topic name for one test. */
let topics = 0;
export function topicName(prefix: string): string {
  topics += 1;
  return `${prefix}-${process.pid}-${topics}`;
}

/**
 * One server for the tests of the calling file: started before them, stopped after; `set`
 * receives it and an `Admin` of it once it is up.
 */
export function serveForThisFile(set: (server: Server, admin: Admin) => void): void {
  let server: Server | undefined;
  before(async () => {
    server = await Server.serve();
    set(server, new Admin(server.control));
  });
  after(async () => {
    await server?.stop();
  });
}
