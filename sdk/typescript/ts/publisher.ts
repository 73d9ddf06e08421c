// The publisher: a Rust `Publisher` behind a staging area (see src/publisher.rs).
// `publish` and `publishMany` append the payloads to the Rust publisher's batches on the
// calling thread and resolve at once while it has room; what it has no room for is copied
// into native memory, and the call resolves once that has been handed to the publisher, so
// `await publish(...)` in a loop is paced by the network without ever blocking the event
// loop.
import { native, Native } from "./native";
import { ClosedError, settle, sync, translate } from "./errors";
import { defaultControl } from "./admin";
import * as check from "./options";
import { Wake, wakerOf } from "./wake";

/**
 * How a client reaches its brokers: `"auto"` (the default) uses a local shared-memory channel
 * to a broker on this host when one opens, else TCP; `"tcp"` always TCP; `"shm"` shared memory
 * or a {@link ConnectError} (or a {@link BrokerError} `ShmRefused`) where none can be had. The Rust
 * client's `Transport`, the CLI's `--transport`.
 */
export type Transport = "auto" | "tcp" | "shm";

/** Every {@link Transport}. */
export const TRANSPORTS: readonly Transport[] = ["auto", "tcp", "shm"];

/** Every option of the Rust client's `PublisherConfig`, in milliseconds where it is a duration. */
export interface PublisherOptions {
  /** The control plane's address (default: `EMBARCADERO_CONTROL`, else `127.0.0.1:12140`). */
  control?: string;
  /** Publish to these broker data addresses directly, without the control plane (no failover). */
  brokers?: string[];
  /**
   * 0: fire and forget; 1: ordered and visible; 2: durable (needs a replicated topic). Default:
   * the topic's `defaultAck` (as `embarcadero pub`), or 1 with `brokers`.
   */
  ackLevel?: 0 | 1 | 2;
  /** A batch is sealed once it holds this many bytes of messages (default 512 KiB). */
  batchBytes?: number;
  /** A non-empty batch is sealed this long after its first message (default 1 ms; 0: as soon as a sender is free). */
  lingerMs?: number;
  /** When the sender that should seal a lingering batch is busy, a backstop seals it this much later (default 5 ms). */
  lingerBackstopMs?: number;
  /** Connections (and queues) per broker (default 1). */
  threadsPerBroker?: number;
  /** Sealed batches each queue holds before the producer deflects to the next (default 4). */
  queueDepth?: number;
  /** Batches a connection may have unacknowledged before its sender waits (default 16). */
  maxInflightBatches?: number;
  /** This publisher's client id (default: a random one). Order 5: the session's id. */
  clientId?: bigint;
  /**
   * Order 5: the session's 16-byte secret key (default: 16 random bytes). A program that
   * resumes a session under the same `clientId` must pass the key it used before.
   */
  sessionKey?: Uint8Array;
  /**
   * Order 5: the least session epoch to open, 1 or more (default: 1 for order-5 topics, else
   * none). A publisher always opens an epoch above the session's current one, so resuming a
   * session supersedes its previous publisher, which then fails with `SessionTakenOver`.
   */
  sessionEpoch?: bigint;
  /** Longest `flush` wait (default 60 s). */
  flushTimeoutMs?: number;
  /** Try the next queue when the round-robin one is full (default true). */
  deflect?: boolean;
  /** Fault injection for experiments: queue `index` sleeps `ms` before each batch it sends. */
  slowQueue?: { index: number; ms: number };
  /** Orders 2 and 5: move a failed broker's unacknowledged batches to live ones (default true). */
  failover?: boolean;
  /** How often to re-read the live brokers and connect to new ones (default 1000 ms; 0: never). */
  membershipRefreshMs?: number;
  /** At most this many brokers are added after connecting (default 64). */
  maxJoinedBrokers?: number;
  /** How the connections reach their brokers (default `"auto"`); each queue's `transport` in {@link Publisher.stats} says what it got. */
  transport?: Transport;
}

/** Every name {@link PublisherOptions} has: anything else is refused as a misspelling. */
const PUBLISHER_OPTIONS: check.OptionNames<PublisherOptions> = {
  control: true,
  brokers: true,
  ackLevel: true,
  batchBytes: true,
  lingerMs: true,
  lingerBackstopMs: true,
  threadsPerBroker: true,
  queueDepth: true,
  maxInflightBatches: true,
  clientId: true,
  sessionKey: true,
  sessionEpoch: true,
  flushTimeoutMs: true,
  deflect: true,
  slowQueue: true,
  failover: true,
  membershipRefreshMs: true,
  maxJoinedBrokers: true,
  transport: true,
};

const SLOW_QUEUE_OPTIONS: check.OptionNames<NonNullable<PublisherOptions["slowQueue"]>> = {
  index: true,
  ms: true,
};

/** Summary of a latency histogram, in microseconds. */
export interface LatencySummary {
  /** Samples. */
  count: number;
  /** Median. */
  p50: number;
  /** 90th percentile. */
  p90: number;
  /** 99th percentile. */
  p99: number;
  /** 99.9th percentile. */
  p999: number;
  /** Largest sample. */
  max: number;
}

/** Counters of one connection's queue. */
export interface QueueStats {
  /** The broker's data address. */
  broker: string;
  /** Which of the broker's connections (0 to threadsPerBroker - 1). */
  connection: number;
  /** How this connection reaches its broker now: `"shm"` or `"tcp"`. */
  transport: "tcp" | "shm";
  /** Batches sent on it. */
  batches: number;
  /** Batches acknowledged on it. */
  ackedBatches: number;
  /** Batches round-robin chose for this queue that went elsewhere because it was full. */
  deflected: number;
  /** Times the producer waited because every queue was full when this one was due. */
  producerWaits: number;
  /** Batches the broker refused with BACKPRESSURE and that were sent again. */
  backpressureRetries: number;
  /** Batches this queue's sender sealed when their linger ran out. */
  lingered: number;
  /**
   * Batches built in place in this connection's shared-memory ring (the others were built
   * in a buffer and copied into the socket or ring).
   */
  inPlace: number;
  /**
   * Of those, batches copied out of the ring before their acknowledgement because a write
   * needed their room (a channel's room never waits for acknowledgements).
   */
  copiedOut: number;
}

/** A publisher's counters. */
export interface PublisherStats {
  /** The publisher's client id. */
  clientId: bigint;
  /** The acknowledgement level the publisher waits for (the topic's `defaultAck` unless chosen). */
  ackLevel: number;
  /** Order 5: the session epoch the publisher opened and publishes in now; 0 for other orders. */
  sessionEpoch: bigint;
  /** Messages published. */
  messages: number;
  /** Payload bytes published. */
  bytes: number;
  /** Batches sealed. */
  batches: number;
  /** Batches acknowledged. */
  ackedBatches: number;
  /** Seal-to-acknowledgement latency of batches. */
  ackLatencyUs: LatencySummary;
  /** Publish-to-acknowledgement latency. */
  appendToAckUs: LatencySummary;
  /** Per connection. */
  queues: QueueStats[];
}

type Json = Record<string, unknown>;

function latency(v: Json): LatencySummary {
  return {
    count: Number(v.count),
    p50: Number(v.p50),
    p90: Number(v.p90),
    p99: Number(v.p99),
    p999: Number(v.p999),
    max: Number(v.max),
  };
}

function stats(v: Json): PublisherStats {
  return {
    clientId: BigInt(v.client_id as string),
    ackLevel: Number(v.ack_level),
    sessionEpoch: BigInt(v.session_epoch as string),
    messages: Number(v.messages),
    bytes: Number(v.bytes),
    batches: Number(v.batches),
    ackedBatches: Number(v.acked_batches),
    ackLatencyUs: latency(v.ack_latency_us as Json),
    appendToAckUs: latency(v.append_to_ack_us as Json),
    queues: (v.queues as Json[]).map((q) => ({
      broker: q.broker as string,
      connection: Number(q.connection),
      transport: q.transport as "tcp" | "shm",
      batches: Number(q.batches),
      ackedBatches: Number(q.acked_batches),
      deflected: Number(q.deflected),
      producerWaits: Number(q.producer_waits),
      backpressureRetries: Number(q.backpressure_retries),
      lingered: Number(q.lingered),
      inPlace: Number(q.in_place),
      copiedOut: Number(q.copied_out),
    })),
  };
}

/** A message payload: bytes, or a string published as UTF-8. */
export type Payload = Uint8Array | string;

/** The payload as a Buffer: strings encoded, other byte arrays viewed in place (no copy). */
function bytes(p: Payload): Buffer {
  if (typeof p === "string") return Buffer.from(p, "utf8");
  if (!(p instanceof Uint8Array)) {
    throw new TypeError(`a message is a string, Buffer or Uint8Array, not ${p === null ? "null" : typeof p}`);
  }
  return Buffer.isBuffer(p) ? p : Buffer.from(p.buffer, p.byteOffset, p.byteLength);
}

const DONE: Promise<void> = Promise.resolve();

/**
 * The most payloads `publishMany` passes to the native side as arguments (each takes a slot
 * of the JavaScript stack: 32 KiB at most); a longer array goes as one array, whose elements
 * napi reads one property lookup at a time (about twice the cost per message).
 */
const MOST_ARGUMENTS = 4096;

/** How long a wait for the drain lasts before it looks again (a wake is never missed; this bounds one that would be). */
const LOOK_AGAIN_MS = 250;

/**
 * Publishers not closed yet. Node ends a process once its event loop is empty, and the
 * native drain that hands staged messages to the brokers does not keep the loop alive:
 * a program that published and returned without `close()` lost what was still staged or
 * unacknowledged, in silence. On `beforeExit` (a natural end; not `process.exit()` or a
 * signal) every open publisher is closed, which publishes and awaits what is pending,
 * as the Python SDK does at interpreter exit.
 */
const unclosed = new Set<Publisher>();

function closeUnclosedAtExit(): void {
  const closing = [...unclosed].map((p) =>
    p.close().catch((e: unknown) => {
      console.error(`embarcadero: a publisher left open failed to flush at exit: ${String(e)}`);
    }),
  );
  // The promises keep the loop alive; once settled, `beforeExit` comes again and finds none.
  void Promise.all(closing);
}

let exitHookInstalled = false;

function track(p: Publisher): Publisher {
  if (!exitHookInstalled) {
    process.on("beforeExit", closeUnclosedAtExit);
    exitHookInstalled = true;
  }
  unclosed.add(p);
  return p;
}

/**
 * Publishes to one topic through every broker of a cluster. Create it with {@link Publisher.connect};
 * end it with {@link Publisher.close} (or `await using`).
 *
 * Messages are published in the order of the calls. `publish` resolves once the message is
 * accepted (copied into the publisher); `flush` waits until everything so far is acknowledged
 * at the publisher's ack level. Errors of the network side (a lost broker with no failover
 * left, say) are reported by the next call. A publisher still open when the process ends by
 * itself is closed on `beforeExit`, so what it accepted is published first; `process.exit()`
 * and signals skip that: close it yourself there.
 */
export class Publisher implements AsyncDisposable {
  readonly #native: Native.NativePublisher;
  /** Stages its arguments natively; true: some are left staged, wait until handed over (src/publisher.rs). */
  readonly #stage: (...payloads: Buffer[]) => boolean;
  /** `#stage` for an array longer than {@link MOST_ARGUMENTS}. */
  readonly #stageArray: (payloads: Buffer[]) => boolean;
  /** Woken by the native drain (through the waker) once it has handed the staged messages over. */
  readonly #handed = new Wake();
  /** The wait for the staged messages under way, if any (`#waitHanded`). */
  #handing: Promise<void> | undefined;
  #closing: Promise<PublisherStats> | undefined;

  private constructor(n: Native.NativePublisher) {
    this.#native = n;
    this.#stage = n.stage;
    this.#stageArray = n.stageArray;
    n.setWaker(wakerOf(this, (p) => p.#handed));
  }

  /**
   * Connects to the brokers of `topic` (found through the control plane unless `options.brokers` names them).
   * @throws {@link BrokerError} (`UnknownTopic`) for a topic that does not exist; {@link ConnectError} when nothing answers.
   */
  static async connect(topic: string, options: PublisherOptions = {}): Promise<Publisher> {
    check.known("Publisher.connect", options, PUBLISHER_OPTIONS);
    check.known("Publisher.connect slowQueue", options.slowQueue, SLOW_QUEUE_OPTIONS);
    const o = options;
    const config: Native.NativePublisherConfig = {
      // Range checked by the native side, whose message names the levels that exist.
      ackLevel: check.count("ackLevel", o.ackLevel),
      batchBytes: check.count("batchBytes", o.batchBytes),
      lingerMs: check.millis("lingerMs", o.lingerMs),
      lingerBackstopMs: check.millis("lingerBackstopMs", o.lingerBackstopMs),
      threadsPerBroker: check.count("threadsPerBroker", o.threadsPerBroker),
      queueDepth: check.count("queueDepth", o.queueDepth),
      maxInflightBatches: check.count("maxInflightBatches", o.maxInflightBatches),
      clientId: check.u64("clientId", o.clientId),
      sessionKey: check.bytes("sessionKey", o.sessionKey, 16),
      flushTimeoutMs: check.millis("flushTimeoutMs", o.flushTimeoutMs),
      sessionEpoch: check.u64("sessionEpoch", o.sessionEpoch),
      deflect: check.flag("deflect", o.deflect),
      slowQueueIndex: check.count("slowQueue.index", o.slowQueue?.index),
      slowQueueMs: check.millis("slowQueue.ms", o.slowQueue?.ms),
      failover: check.flag("failover", o.failover),
      membershipRefreshMs: check.millis("membershipRefreshMs", o.membershipRefreshMs),
      maxJoinedBrokers: check.count("maxJoinedBrokers", o.maxJoinedBrokers),
      brokers: check.texts("brokers", o.brokers),
      transport: check.oneOf("transport", o.transport, TRANSPORTS),
    };
    const control = check.text("control", o.control) ?? defaultControl();
    return track(new Publisher(await settle(() => native.connectPublisher(control, topic, config))));
  }

  /** This publisher's client id (order 5: its session's id). */
  get clientId(): bigint {
    return this.#native.clientId;
  }

  /** The largest payload the brokers accept, in bytes. */
  get maxMessageBytes(): number {
    return this.#native.maxMessageBytes;
  }

  /**
   * Publishes one message. Resolves once it is accepted (at once, unless the publisher is
   * behind, when it resolves as it catches up); see {@link Publisher.flush} for acknowledgement.
   * @throws {@link MessageTooLargeError}, {@link ClosedError}, or the error that failed an earlier publish.
   */
  publish(payload: Payload): Promise<void> {
    try {
      return this.#stage(bytes(payload)) ? this.#waitHanded() : DONE;
    } catch (e) {
      return Promise.reject(translate(e));
    }
  }

  /**
   * Publishes many messages, in order, with one crossing into native code: the fastest way
   * to publish. All or none are accepted (a too-large one refuses the whole call).
   */
  publishMany(payloads: readonly Payload[]): Promise<void> {
    try {
      if (!Array.isArray(payloads)) {
        // Untyped callers: a string here was `payloads.map is not a function`.
        throw new TypeError(
          `publishMany takes an array of messages, not ${typeof payloads === "string" ? "one string" : typeof payloads}: use publish(message), or publishMany([message])`,
        );
      }
      const all = payloads.map(bytes);
      const more = all.length <= MOST_ARGUMENTS ? this.#stage(...all) : this.#stageArray(all);
      return more ? this.#waitHanded() : DONE;
    } catch (e) {
      return Promise.reject(translate(e));
    }
  }

  /**
   * Resolves once everything staged is in the Rust publisher (or rejects with the error its
   * drain met). One wait at a time, shared by every call that asks meanwhile; it holds no
   * thread: the drain calls the waker (`#handed`) once it has handed the staged messages over.
   */
  #waitHanded(): Promise<void> {
    if (this.#handing === undefined) {
      if (!sync(() => this.#native.wakeWhenHanded())) return DONE;
      this.#handing = this.#untilHanded();
    }
    return this.#handing;
  }

  /**
   * The wait `#waitHanded` starts. It begins with an await, so its `finally` never runs before
   * `#handing` is set, and clears it in the turn of the look that ends the wait: a call made
   * after that look starts a wait of its own.
   */
  async #untilHanded(): Promise<void> {
    try {
      do await this.#handed.until(LOOK_AGAIN_MS);
      while (sync(() => this.#native.wakeWhenHanded()));
    } finally {
      this.#handing = undefined;
    }
  }

  /** Waits until everything published so far is acknowledged at the ack level (ack 0: written to the sockets). */
  flush(): Promise<void> {
    return settle(() => this.#native.flush());
  }

  /** Counters and latencies so far (after `close`: the final ones). */
  stats(): PublisherStats {
    const v = sync(() => this.#native.stats()) as Json | null;
    if (v === null) throw new ClosedError("the publisher is closing");
    return stats(v);
  }

  /**
   * Publishes what is pending, waits for its acknowledgements, disconnects and returns the
   * final statistics. Calling it again returns the same result. On an order-5 topic it also
   * ends the session, so that the server gives its slot to a new session at once (a
   * publisher never closed holds it until idle for `sequencer.session_idle_evict_secs`).
   */
  close(): Promise<PublisherStats> {
    this.#closing ??= settle(() => this.#native.close())
      .then((v) => stats(v as Json))
      .finally(() => unclosed.delete(this));
    return this.#closing;
  }

  /** `await using p = await Publisher.connect(...)` closes it at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}
