// The subscriber: reads a topic in order (the Rust `Subscriber`), one batch of messages
// per crossing into native code, while a native thread reads the next polls ahead
// (read-ahead), so a ready batch is taken without leaving the event loop's thread; while
// reading by `pollBatch`, what a shared-memory feed holds is read on this thread. Each
// delivery arrives as a Buffer over the Rust subscriber's own buffer (no copy at all) and each `Message`'s payload is a view of
// it, made on first use; its fields are read lazily: where its payload lies from one
// typed array (two numbers per message), what a run of messages of one delivery shares
// from another, and the counter and publish time from the message's header in the
// delivery (see src/subscriber.rs for the layout).
import { native, Native } from "./native";
import { Message, MessageBatch, NO_MESSAGES, Polled, polledOf, RUN, runEnd } from "./message";
import { ClosedError, ConfigError, settle, sync } from "./errors";
import { defaultControl, Order } from "./admin";
import { TRANSPORTS, type Transport } from "./publisher";
import * as check from "./options";
import { setImmediate as nextTurn } from "node:timers/promises";
import { Wake, wakerOf } from "./wake";

/** A position: one global position (orders 2 and 5), or one per broker (orders 0 and 1). */
export type Position = number | readonly number[];

/** Where a subscriber starts or seeks to: a position, `"start"` (the first message still retained), or `"end"` (only what is published from then on). */
export type From = Position | bigint | readonly bigint[] | "start" | "end";

/** Options of {@link Subscriber.connect}. */
export interface SubscriberOptions {
  /** The control plane's address (default: `EMBARCADERO_CONTROL`, else `127.0.0.1:12140`). */
  control?: string;
  /** Read from these broker data addresses directly, without the control plane. */
  brokers?: string[];
  /**
   * Where to start (default `"start"`): a global position (orders 2, 5), one position per
   * broker (orders 0, 1; `0` alone also means the start of every broker's log), `"start"`
   * or `"end"`. A position of the wrong form for the topic's order is a `ConfigError`.
   */
  from?: From;
  /** The subscriber's client id (default: a random one). */
  clientId?: bigint;
  /** Reconnections in a row after a lost connection before a poll fails (default 10). */
  maxReconnects?: number;
  /**
   * How long to go on reconnecting once the server is gone, beyond `maxReconnects` (about
   * half a second): a server restarted within it is found again and delivery continues
   * from the position reached, as `embarcadero sub --retry-for` does (default: none).
   */
  retryForMs?: number;
  /**
   * How to reach the brokers (default `"auto"`: a shared-memory feed from a broker on this
   * host that gives one, else TCP; `"shm"` fails to connect where no feed can be had).
   * {@link Subscriber.transport} says what the connection got.
   */
  transport?: Transport;
}

/** Every name {@link SubscriberOptions} has: anything else is refused as a misspelling. */
const SUBSCRIBER_OPTIONS: check.OptionNames<SubscriberOptions> = {
  control: true,
  brokers: true,
  from: true,
  clientId: true,
  maxReconnects: true,
  retryForMs: true,
  transport: true,
};

/**
 * Positions `[from, to)` of an ordered topic (orders 2 and 5) that a subscriber asked to start
 * at the beginning found already reclaimed, and so started after (see {@link Subscriber.skipped}).
 */
export interface Skipped {
  /** The first position skipped: where the subscriber was asked to start. */
  readonly from: number;
  /** The first position delivered: the first one the topic still retained. */
  readonly to: number;
}

function cursorOf(from: From | undefined): Native.NativeCursor | undefined {
  if (from === undefined || from === "start") return undefined;
  if (from === "end") return { end: true };
  const n = (p: number | bigint): number => {
    if (typeof p === "bigint" && p > BigInt(Number.MAX_SAFE_INTEGER)) {
      throw new ConfigError(`position ${p} is beyond any topic's end`);
    }
    return Number(p);
  };
  if (typeof from === "number" || typeof from === "bigint") return { global: n(from) };
  if (Array.isArray(from)) return { perBroker: (from as readonly (number | bigint)[]).map(n) };
  throw new ConfigError(`from ${String(from)}: give a position, one per broker, "start" or "end"`);
}

function positionOf(c: Native.NativeCursor): Position {
  return c.perBroker ?? c.global ?? 0;
}

/** Slices of a long poll: a closing subscriber waits at most this long for a poll under way. */
const SLICE_MS = 250;

/**
 * Longest a `pollBatch` reader reads on the event loop's thread before it lets the loop turn
 * once (timers, I/O, other subscribers' and publishers' callbacks, the finalizers that give
 * deliveries back): reading what a feed already holds never waits, so a loop of `pollBatch`
 * calls over a backlog would otherwise hold the event loop until the backlog ran out.
 */
const TURN_EVERY_MS = 4;

/**
 * Reads a topic in order. Iterate it with `for await (const m of sub)`, or call
 * {@link Subscriber.poll}; start from any position or the end, and {@link Subscriber.seek}.
 */
export class Subscriber implements AsyncIterable<Message>, AsyncDisposable {
  readonly #native: Native.NativeSubscriber;
  readonly #control: string;
  readonly #topic: string;
  readonly #order: Order;
  /** Messages delivered by native code, from `#index` on not yet handed out. */
  #batch: Polled | undefined;
  #index = 0;
  /** The run of `#batch` that message `#index` is in, and the first message after that run. */
  #run = 0;
  #runEnd = 0;
  /** The position after `#batch` (or the subscriber's position when there is none). */
  #next: Position;
  /** Calls run one at a time, in the order they were made. */
  #tail: Promise<unknown> = Promise.resolve();
  #closed = false;
  /** The wait for a poll under way, which the native reading thread ends. */
  readonly #wake = new Wake();
  /** Whether the native polls are sized for `pollBatch` (the last read was one). */
  #readBatches = false;
  /** When this subscriber last let the event loop turn (`performance.now()`), for `TURN_EVERY_MS`. */
  #turnedAt = performance.now();

  private constructor(n: Native.NativeSubscriber, control: string, topic: string) {
    this.#native = n;
    this.#control = control;
    this.#topic = topic;
    this.#order = n.order as Order;
    this.#next = positionOf(n.start);
    // Called on this thread by the native reading thread when a poll waited for is ready.
    n.setWaker(wakerOf(this, (sub) => sub.#wake));
  }

  /**
   * Connects to `topic` and places the subscriber at `options.from`.
   * @throws {@link BrokerError} (`UnknownTopic`) for a topic that does not exist.
   */
  static async connect(topic: string, options: SubscriberOptions = {}): Promise<Subscriber> {
    check.known("Subscriber.connect", options, SUBSCRIBER_OPTIONS);
    const control = check.text("control", options.control) ?? defaultControl();
    const config: Native.NativeSubscriberConfig = {
      start: cursorOf(options.from),
      clientId: check.u64("clientId", options.clientId),
      maxReconnects: check.count("maxReconnects", options.maxReconnects),
      retryForMs: check.millis("retryForMs", options.retryForMs),
      brokers: check.texts("brokers", options.brokers),
      transport: check.oneOf("transport", options.transport, TRANSPORTS),
    };
    const n = await settle(() => native.connectSubscriber(control, topic, config));
    return new Subscriber(n, control, topic);
  }

  /** The topic's order level. */
  get order(): Order {
    return this.#order;
  }

  /**
   * Orders 2 and 5, a subscriber from the beginning (`from: "start"`, the default): the
   * positions that were reclaimed before it started (a memory-only topic drops what every
   * reader has passed once its memory fills) and that it therefore skipped; `undefined` when
   * nothing was. Known on connecting, before any message; also logged once by the Rust
   * client. A subscriber given an explicit position never skips: its first poll rejects with
   * a {@link BrokerError} (`PositionNotRetained`) instead. The Rust `Subscriber::skipped`.
   */
  skipped(): Skipped | undefined {
    const s = this.#native.skipped();
    return s === null || s === undefined ? undefined : { from: s.from, to: s.to };
  }

  /** How the current connection reaches its broker: `"tcp"`, `"shm"`, or `"none"` between connections. */
  get transport(): "tcp" | "shm" | "none" {
    return this.#native.transport as "tcp" | "shm" | "none";
  }

  /** The position of the next message this subscriber will deliver. */
  position(): Position {
    const b = this.#batch;
    if (b === undefined || this.#index >= b.count) return this.#next;
    this.#seekRun(b);
    const runs = b.runs;
    const here = runs[this.#run * RUN + 2]! + (this.#index - runs[this.#run * RUN + 1]!);
    if (typeof this.#next === "number") return here;
    // Per broker: the first message still held of each broker, else the position after the batch.
    const at = [...this.#next];
    const seen = new Set<number>();
    for (let r = this.#run; r * RUN < runs.length; r++) {
      const broker = runs[r * RUN + 3]!;
      if (!seen.has(broker)) {
        seen.add(broker);
        at[broker] = r === this.#run ? here : runs[r * RUN + 2]!;
      }
    }
    return at;
  }

  /** Moves `#run` on to the run that holds message `#index`. */
  #seekRun(b: Polled): void {
    while (this.#index >= this.#runEnd) this.#runEnd = runEnd(b, ++this.#run);
  }

  #serial<T>(f: () => Promise<T>): Promise<T> {
    const run = this.#tail.then(f, f);
    this.#tail = run.catch(() => undefined);
    return run;
  }

  /**
   * Fetches the next batch from native code, waiting at most `timeoutMs`; false if none came
   * (`batches`: for `pollBatch`, which the native polls are then sized for).
   * A thread of the native subscriber reads ahead while JavaScript handles the messages
   * already here, so a batch is usually ready: taken then without leaving this thread (no
   * promise, no thread hand-off); only when none is does it wait, on a promise that the
   * reading thread resolves once it has queued one (`wakeWhenReady`) or a timer ends. All
   * takes run one at a time (`#serial`), so batches are taken in the order they were read.
   */
  async #fill(timeoutMs: number, batches: boolean): Promise<boolean> {
    if (batches !== this.#readBatches) {
      // Polls sized for what this caller reads by (src/subscriber.rs, `read_batches`).
      this.#native.readBatches(batches);
      this.#readBatches = batches;
    }
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      if (batches && performance.now() - this.#turnedAt >= TURN_EVERY_MS) {
        await nextTurn();
        this.#turnedAt = performance.now();
      }
      if (this.#closed) throw new ClosedError("the subscriber is closed");
      const batch = sync(() => this.#native.takeBatch());
      if (batch === null) {
        const wait = Math.min(SLICE_MS, deadline - Date.now());
        if (wait <= 0) return false;
        // Woken by the reading thread once a poll is queued (false: one already is).
        if (this.#native.wakeWhenReady()) {
          await this.#wake.until(wait);
          this.#turnedAt = performance.now();
        }
        continue;
      }
      if (batch) {
        // Closed while waiting: the poll is not kept (its deliveries go with it).
        if (this.#closed) throw new ClosedError("the subscriber is closed");
        const b = polledOf(batch, this.#order);
        this.#batch = b;
        this.#index = 0;
        this.#run = 0;
        this.#runEnd = runEnd(b, 0);
        this.#next = positionOf(batch.next);
        return true;
      }
      if (Date.now() >= deadline) return false;
    }
  }

  #take(): Message | null {
    // Nothing more once closed, not even what was already received (`close` says so).
    if (this.#closed) return null;
    const b = this.#batch;
    if (b === undefined || this.#index >= b.count) return null;
    if (this.#index >= this.#runEnd) this.#seekRun(b);
    return new Message(b, this.#run, this.#index++);
  }

  /** The next message, waiting at most `timeoutMs` (default 1000; `Infinity`: no limit); `null` if none came. */
  poll(timeoutMs = 1000): Promise<Message | null> {
    return this.#serial(async () => {
      const ms = check.wait("timeoutMs", timeoutMs) ?? 1000;
      return this.#take() ?? ((await this.#fill(ms, false)) ? this.#take() : null);
    });
  }

  /**
   * Every message already received, or else those of the next delivery, waiting at most
   * `timeoutMs` (default 1000); empty if none came. Fewer awaits than `poll` per message.
   */
  pollMany(timeoutMs = 1000): Promise<Message[]> {
    return this.#serial(async () => {
      const ms = check.wait("timeoutMs", timeoutMs) ?? 1000;
      const b = this.#batch;
      if (b === undefined || this.#index >= b.count) {
        if (!(await this.#fill(ms, false))) return [];
      }
      const out: Message[] = [];
      for (let m = this.#take(); m !== null; m = this.#take()) out.push(m);
      return out;
    });
  }

  /**
   * The messages of the next poll as one {@link MessageBatch} (about 1 MiB of them;
   * those left of a poll that {@link Subscriber.poll} or `for await` took from, if any),
   * waiting at most `timeoutMs` (default 1000); empty if none came. Nothing is made per
   * message until asked for: the cheapest way to read a stream. Over a shared-memory feed
   * what has arrived is read on this thread (a copy, never a wait for the network); release
   * each batch ({@link MessageBatch.release}, or `using`) so that its memory is reused at once.
   */
  pollBatch(timeoutMs = 1000): Promise<MessageBatch> {
    return this.#serial(async () => {
      const ms = check.wait("timeoutMs", timeoutMs) ?? 1000;
      const b = this.#batch;
      if (b === undefined || this.#index >= b.count) {
        if (!(await this.#fill(ms, true))) return new MessageBatch(NO_MESSAGES, 0);
      }
      const polled = this.#batch!;
      if (this.#closed) throw new ClosedError("the subscriber is closed");
      const batch = new MessageBatch(polled, this.#index);
      this.#index = polled.count;
      return batch;
    });
  }

  /**
   * Continues from `from` (a position; `"start"`, the first message still retained; or `"end"`),
   * discarding anything received and not yet handed out. A position past the topic's end is not
   * an error: delivery starts with the message published there, once it is.
   */
  seek(from: From): Promise<void> {
    // No position ("start"): the native side goes to the first message still retained.
    const cursor = cursorOf(from) ?? {};
    return this.#serial(async () => {
      if (this.#closed) throw new ClosedError("the subscriber is closed");
      // After every take (`#serial`); the native seek drops what was read ahead.
      const at = await settle(() => this.#native.seek(this.#control, this.#topic, cursor));
      this.#batch = undefined;
      this.#index = 0;
      this.#next = positionOf(at);
    });
  }

  /** Disconnects. Iterations end; later calls reject with {@link ClosedError}. */
  async close(): Promise<void> {
    this.#closed = true;
    this.#batch = undefined;
    await settle(() => this.#native.close());
  }

  /** `await using sub = await Subscriber.connect(...)` closes it at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  /**
   * Messages in order, waiting for more as they come; ends when the subscriber is closed.
   * Messages already received are handed out without a round trip into native code, and
   * without an async generator: each costs one resolved promise, not a generator's yield
   * and await (a third of the time per message, docs/PERFORMANCE.md).
   */
  [Symbol.asyncIterator](): AsyncIterableIterator<Message> {
    let finished = false;
    const done: IteratorResult<Message> = { value: undefined, done: true };
    const wait = async (): Promise<IteratorResult<Message>> => {
      for (;;) {
        const m = this.#take();
        if (m !== null) return { value: m, done: false };
        if (this.#closed) return done;
        try {
          await this.#serial(() => this.#fill(SLICE_MS * 4, false));
        } catch (e) {
          if (this.#closed && e instanceof ClosedError) return done;
          throw e;
        }
      }
    };
    const iterator: AsyncIterableIterator<Message> = {
      next: (): Promise<IteratorResult<Message>> => {
        if (finished) return Promise.resolve(done);
        const m = this.#take();
        return m !== null ? Promise.resolve({ value: m, done: false }) : wait();
      },
      return: (): Promise<IteratorResult<Message>> => {
        finished = true;
        return Promise.resolve(done);
      },
      [Symbol.asyncIterator]: () => iterator,
    };
    return iterator;
  }
}
