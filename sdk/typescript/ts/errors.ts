// Errors: one class per variant of the Rust client's `embarcadero_client::Error`, all
// subclasses of `EmbarcaderoError`, with the same message text the `embarcadero` CLI
// prints. The native addon raises errors whose message is a marker and a JSON document
// (see src/error.rs); `translate` rebuilds the typed error from it.

/** The variants of the Rust client's error type, one per subclass of {@link EmbarcaderoError}. */
export type ErrorKind =
  | "Connect"
  | "Admin"
  | "Broker"
  | "ConnectionLost"
  | "Protocol"
  | "MessageTooLarge"
  | "Config"
  | "InvalidName"
  | "Timeout"
  | "Closed"
  | "NoLiveBroker"
  | "WorkflowApi";

/** Every error this library raises for a failed operation. Check `kind` or use `instanceof` on a subclass. */
export class EmbarcaderoError extends Error {
  /** Which variant of the Rust client's error this is. */
  readonly kind: ErrorKind;

  /** @internal */
  constructor(kind: ErrorKind, message: string) {
    super(message);
    this.kind = kind;
    this.name = new.target.name;
  }
}

/** The control plane (or a broker) could not be reached. */
export class ConnectError extends EmbarcaderoError {
  /** What was being reached, e.g. "the control plane". */
  readonly what: string;
  /** The address tried. */
  readonly addr: string;
  /** @internal */
  constructor(message: string, what: string, addr: string) {
    super("Connect", message);
    this.what = what;
    this.addr = addr;
  }
}

/** The admin API answered with an error status (e.g. 404 for an unknown topic, 409 for one that exists). */
export class AdminError extends EmbarcaderoError {
  /** The HTTP status of the answer. */
  readonly status: number;
  /** @internal */
  constructor(message: string, status: number) {
    super("Admin", message);
    this.status = status;
  }
}

/** A broker refused a request with one of the protocol's error codes. */
export class BrokerError extends EmbarcaderoError {
  /** The broker's address. */
  readonly broker: string;
  /**
   * The error code's name (e.g. "UnknownTopic"): a string, as Node's own `error.code` is, and
   * the same as Python's `BrokerError.code`.
   */
  readonly code: string;
  /** The error code's number on the wire (e.g. 3). */
  readonly codeNumber: number;
  /** @internal */
  constructor(message: string, broker: string, code: string, codeNumber: number) {
    super("Broker", message);
    this.broker = broker;
    this.code = code;
    this.codeNumber = codeNumber;
  }
}

/** The connection to a broker broke (the client retried where it could). */
export class ConnectionLostError extends EmbarcaderoError {
  /** The broker's address. */
  readonly broker: string;
  /** @internal */
  constructor(message: string, broker: string) {
    super("ConnectionLost", message);
    this.broker = broker;
  }
}

/** A peer broke the protocol. */
export class ProtocolError extends EmbarcaderoError {
  /** The peer's address. */
  readonly broker: string;
  /** @internal */
  constructor(message: string, broker: string) {
    super("Protocol", message);
    this.broker = broker;
  }
}

/** A message above the brokers' maximum size, refused before it was sent. */
export class MessageTooLargeError extends EmbarcaderoError {
  /** The message's size in bytes. */
  readonly size: number;
  /** The largest payload the brokers accept, in bytes. */
  readonly max: number;
  /** @internal */
  constructor(message: string, size: number, max: number) {
    super("MessageTooLarge", message);
    this.size = size;
    this.max = max;
  }
}

/** An invalid option or argument. */
export class ConfigError extends EmbarcaderoError {
  /** @internal */
  constructor(message: string) {
    super("Config", message);
  }
}

/** A topic name the server would refuse, caught before any request was sent. */
export class InvalidNameError extends EmbarcaderoError {
  /** @internal */
  constructor(message: string) {
    super("InvalidName", message);
  }
}

/** An operation (such as `flush`) did not finish in its time limit. */
export class TimeoutError extends EmbarcaderoError {
  /** The limit that passed, in milliseconds. */
  readonly timeoutMs: number;
  /** @internal */
  constructor(message: string, timeoutMs: number) {
    super("Timeout", message);
    this.timeoutMs = timeoutMs;
  }
}

/** The publisher or subscriber is closed. */
export class ClosedError extends EmbarcaderoError {
  /** @internal */
  constructor(message = "the publisher is closed") {
    super("Closed", message);
  }
}

/** Every broker a publisher used has failed. */
export class NoLiveBrokerError extends EmbarcaderoError {
  /** @internal */
  constructor(message: string) {
    super("NoLiveBroker", message);
  }
}

/**
 * The workflow engine's API answered with an error, or nothing answered: `status` is the HTTP
 * status (0 when nothing answered), `code` the API's error code (`"not_found"`,
 * `"template_not_found"`, `"task_closed"`, `"backpressure"`, `"invalid_template"`...;
 * `"unreachable"` when nothing answered). docs/WORKFLOW.md lists each route's codes.
 */
export class WorkflowApiError extends EmbarcaderoError {
  /** The HTTP status of the answer, 0 when nothing answered. */
  readonly status: number;
  /** The API's error code. */
  readonly code: string;
  /** @internal */
  constructor(message: string, status: number, code: string) {
    super("WorkflowApi", message);
    this.status = status;
    this.code = code;
  }
}

const MARKER = "embarcadero-error:";

type Fields = Record<string, unknown> & { kind: ErrorKind; message: string };

function str(v: unknown): string {
  return typeof v === "string" ? v : String(v);
}

function num(v: unknown): number {
  return typeof v === "number" ? v : Number(v);
}

function build(f: Fields): EmbarcaderoError {
  const m = f.message;
  switch (f.kind) {
    case "Connect":
      return new ConnectError(m, str(f.what), str(f.addr));
    case "Admin":
      return new AdminError(m, num(f.status));
    case "Broker":
      return new BrokerError(m, str(f.broker), str(f.codeName), num(f.code));
    case "ConnectionLost":
      return new ConnectionLostError(m, str(f.broker));
    case "Protocol":
      return new ProtocolError(m, str(f.broker));
    case "MessageTooLarge":
      return new MessageTooLargeError(m, num(f.size), num(f.max));
    case "Config":
      return new ConfigError(m);
    case "InvalidName":
      return new InvalidNameError(m);
    case "Timeout":
      return new TimeoutError(m, num(f.timeoutMs));
    case "Closed":
      return new ClosedError(m);
    case "NoLiveBroker":
      return new NoLiveBrokerError(m);
    case "WorkflowApi":
      return new WorkflowApiError(m, num(f.status), str(f.code));
  }
}

/**
 * The typed error for an error thrown by the native addon; any other value (a
 * JavaScript TypeError for a wrong argument, say) is returned unchanged.
 * @internal
 */
export function translate(e: unknown): unknown {
  if (!(e instanceof Error) || !e.message.startsWith(MARKER)) {
    return e;
  }
  try {
    return build(JSON.parse(e.message.slice(MARKER.length)) as Fields);
  } catch {
    return e;
  }
}

/** Runs a synchronous native call, rethrowing its error as a typed one. @internal */
export function sync<T>(f: () => T): T {
  try {
    return f();
  } catch (e) {
    throw translate(e);
  }
}

/** Awaits a native Promise, rejecting with a typed error. @internal */
export async function settle<T>(p: Promise<T> | (() => Promise<T>)): Promise<T> {
  try {
    return await (typeof p === "function" ? p() : p);
  } catch (e) {
    throw translate(e);
  }
}
