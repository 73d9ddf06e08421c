// A subscriber's messages as JavaScript sees them: what one poll of native code brings
// (`Polled`: each delivery as a Buffer over the Rust subscriber's own buffer, no copy; where
// each payload lies, two numbers per message in one typed array; what a run of messages of
// one delivery shares, in another; see src/subscriber.rs for the layout), the `Message`
// read lazily from it, and the `MessageBatch` that hands a poll's messages over whole.
// Owns the reading of that layout; the subscriber (subscriber.ts) owns the polls.
import type { Native } from "./native";
import { native } from "./native";
import type { Order } from "./admin";
import { ClosedError } from "./errors";

export const SPAN = 2; // per message: payload offset, payload length (bytes, in its delivery)
export const RUN = 6; // per run: delivery, first message, first position, broker id, batch seq, first index in batch
/** Where the counter and publish time lie in a message header, from its payload's start. */
const COUNTER_AT = native.COUNTER_FROM_PAYLOAD;
const PUBLISH_TS_AT = native.PUBLISH_TS_FROM_PAYLOAD;

/**
 * One poll's messages as native code packed them, with each delivery's `ArrayBuffer` and
 * offset in it read once per poll: `Buffer.buffer` and `byteOffset` are calls into C++
 * that cost more than the payload view made from them.
 */
export interface Polled {
  readonly count: number;
  readonly data: Buffer[];
  readonly buffers: ArrayBuffer[];
  /** The native owners of `data`, through which `release` gives deliveries back (none for no messages). */
  readonly lease: Native.NativeBatch["lease"] | undefined;
  readonly offsets: number[];
  readonly spans: Uint32Array;
  readonly runs: Float64Array;
  readonly clients: BigUint64Array;
  readonly order: Order;
}

export function polledOf(batch: Native.NativeBatch, order: Order): Polled {
  return {
    count: batch.count,
    data: batch.data,
    buffers: batch.data.map((d) => d.buffer as ArrayBuffer),
    lease: batch.lease,
    offsets: batch.data.map((d) => d.byteOffset),
    spans: batch.spans,
    runs: batch.runs,
    clients: batch.clients,
    order,
  };
}

/** The first message of the run after `run` (the poll's count after the last run). */
export function runEnd(p: Polled, run: number): number {
  const next = (run + 1) * RUN;
  return next < p.runs.length ? p.runs[next + 1]! : p.count;
}

/**
 * The class of payload views: a `Uint8Array` subclass whose prototype chain runs through
 * `Buffer.prototype`, so that each view is a `Buffer` (`instanceof Buffer`, `Buffer.isBuffer`,
 * every `Buffer` method; `subarray` makes another) made by one typed-array construction, as
 * Node makes its own (its internal `FastBuffer`), without `Buffer.from`'s checks of its
 * argument, one of which calls into C++ (scripts/probes/payload-view.mjs).
 */
class PayloadBuffer extends Uint8Array {
  constructor(buffer: ArrayBuffer, offset: number, length: number) {
    super(buffer, offset, length);
  }
}
Object.setPrototypeOf(PayloadBuffer.prototype, Buffer.prototype);
// Printed as a Buffer too (`util.inspect` names the constructor).
Object.defineProperty(PayloadBuffer, "name", { value: "Buffer" });

/** A view of the payload of message `m` of `p`, which lies in delivery `d`. */
function payloadView(p: Polled, d: number, m: number): Buffer {
  // One typed-array construction (see PayloadBuffer); `subarray` would first look up the
  // species constructor, and `Buffer.from` check its argument in C++.
  const at = p.offsets[d]! + p.spans[m * SPAN]!;
  return new PayloadBuffer(p.buffers[d]!, at, p.spans[m * SPAN + 1]!) as unknown as Buffer;
}

/** One delivered message. Its `payload` is a view into the buffer of the delivery it came in. */
export class Message {
  readonly #p: Polled;
  readonly #run: number;
  readonly #i: number;
  #payload: Buffer | undefined;

  /** @internal */
  constructor(polled: Polled, run: number, index: number) {
    this.#p = polled;
    this.#run = run;
    this.#i = index;
  }

  /** Field `k` of this message's run. */
  #runField(k: number): number {
    return this.#p.runs[this.#run * RUN + k]!;
  }

  /** How far this message is into its run. */
  #step(): number {
    return this.#i - this.#runField(1);
  }

  /** Global position (orders 2 and 5) or position in its broker's log (orders 0 and 1). */
  get position(): number {
    return this.#runField(2) + this.#step();
  }

  /** Orders 2 and 5: the global position (the message's sequence number in the total order). */
  get globalSeq(): number | undefined {
    return this.#p.order >= 2 ? this.position : undefined;
  }

  /** Orders 0 and 1: the position within its broker's log. */
  get brokerSeq(): number | undefined {
    return this.#p.order < 2 ? this.position : undefined;
  }

  /** The broker whose log the message was written to. */
  get brokerId(): number {
    return this.#runField(3);
  }

  /** The publisher's client id (order 5: its session). */
  get clientId(): bigint {
    return this.#p.clients[this.#run]!;
  }

  /** The sequence number of its batch among the publisher's batches to that broker. */
  get batchSeq(): number {
    return this.#runField(4);
  }

  /** Its index within its batch. */
  get indexInBatch(): number {
    return this.#runField(5) + this.#step();
  }

  /** The publisher's per-client message counter. */
  get counter(): number {
    const at = this.#offset() + COUNTER_AT;
    const d = this.#delivery();
    return d.readUInt32LE(at) + d.readUInt32LE(at + 4) * 2 ** 32;
  }

  /** When its batch was opened by the publisher, in nanoseconds since the Unix epoch. */
  get publishTsNs(): bigint {
    return this.#delivery().readBigUInt64LE(this.#offset() + PUBLISH_TS_AT);
  }

  /**
   * The payload: a view into the buffer of the delivery it came in (made on first use,
   * the same `Buffer` after), which stays valid (and the delivery's memory in use) as long
   * as any of its messages' payloads is referenced; copy it (`Buffer.from(m.payload)`) to
   * keep it without the rest of the delivery. Treat it as read-only: writing it changes
   * only this message's bytes, but they are the subscriber's, not a copy.
   */
  get payload(): Buffer {
    if (this.#payload === undefined) this.#payload = payloadView(this.#p, this.#runField(0), this.#i);
    return this.#payload;
  }

  /** The payload's length in bytes (without making the payload's view). */
  get size(): number {
    return this.#p.spans[this.#i * SPAN + 1]!;
  }

  /** The payload decoded as UTF-8. */
  text(): string {
    const offset = this.#offset();
    return this.#delivery().toString("utf8", offset, offset + this.size);
  }

  /** Where the payload starts in its delivery. */
  #offset(): number {
    return this.#p.spans[this.#i * SPAN]!;
  }

  #delivery(): Buffer {
    return this.#p.data[this.#runField(0)]!;
  }
}


/** A poll of nothing: the batch {@link MessageBatch} is when a poll's time runs out. */
export const NO_MESSAGES: Polled = {
  count: 0,
  data: [],
  buffers: [],
  lease: undefined,
  offsets: [],
  spans: new Uint32Array(0),
  runs: new Float64Array(0),
  clients: new BigUint64Array(0),
  order: 2,
};

/**
 * Messages delivered together, in order ({@link Subscriber.pollBatch}): `batch.length`,
 * `batch.at(i)` (a {@link Message}; negative indexes count from the end), `for (const m of
 * batch)`, and without making a `Message`: {@link MessageBatch.size},
 * {@link MessageBatch.payload} and {@link MessageBatch.payloadBytes}. The subscriber's
 * position is already past every message of it. A payload view keeps its delivery's memory
 * in use, as a {@link Message}'s does, until a garbage collection finds it unreferenced;
 * {@link MessageBatch.release} (or `using batch = await sub.pollBatch()`) gives back at once
 * the deliveries of a batch from which no view or `Message` was taken.
 */
export class MessageBatch implements Iterable<Message>, Disposable {
  readonly #p: Polled;
  /** The batch's first message, as an index into its poll's messages. */
  readonly #first: number;
  /** How many messages: the poll's from `#first` to its end. */
  readonly length: number;
  /** Set by `release`: the batch is done with. */
  #released = false;
  /** Set once a payload view or a `Message` was taken from the batch: code outside may then
   * hold views of its deliveries, which only the garbage collector can see go. */
  #handedOut = false;

  /** @internal */
  constructor(polled: Polled, first: number) {
    if (!(first >= 0 && first <= polled.count)) throw new RangeError(`a batch from message ${first} of ${polled.count}`);
    this.#p = polled;
    this.#first = first;
    this.length = polled.count - first;
  }

  /** Message `i` of the poll, after checking that `i` is a whole number within the batch. */
  #index(i: number): number {
    if (!Number.isInteger(i) || i < 0 || i >= this.length) {
      throw new RangeError(`message ${i} of a batch of ${this.length} messages`);
    }
    return this.#first + i;
  }

  /** Before a view or a `Message` is taken: refused once released, and noted. */
  #handOut(): void {
    if (this.#released) throw new ClosedError("the batch was released: its payloads and messages are no longer handed out");
    this.#handedOut = true;
  }

  /** Message `i` (negative: from the end), or `undefined` outside the batch, as `Array.at`. */
  at(i: number): Message | undefined {
    const whole = Math.trunc(i) || 0; // as Array.at: NaN is 0, fractions are cut
    const k = whole < 0 ? this.length + whole : whole;
    const inside = k >= 0 && k < this.length;
    // Refused once released, even outside; noted only when a message is handed out.
    if (inside || this.#released) this.#handOut();
    if (!inside) return undefined;
    const m = this.#first + k;
    return new Message(this.#p, runOf(this.#p, m), m);
  }

  /** The payload length of message `i`, in bytes (no view made). Throws a RangeError outside the batch. */
  size(i: number): number {
    return this.#p.spans[this.#index(i) * SPAN + 1]!;
  }

  /**
   * The payload of message `i`: a view into its delivery, as {@link Message.payload} (no
   * copy; treat it as read-only). Throws a RangeError outside the batch.
   */
  payload(i: number): Buffer {
    const m = this.#index(i);
    this.#handOut();
    return payloadView(this.#p, this.#p.runs[runOf(this.#p, m) * RUN]!, m);
  }

  /** The payload bytes of all the messages together. */
  get payloadBytes(): number {
    const spans = this.#p.spans;
    let total = 0;
    for (let m = this.#first; m < this.#p.count; m++) total += spans[m * SPAN + 1]!;
    return total;
  }

  /**
   * Says the batch is done with. If no payload view and no `Message` was taken from it (a
   * reader of `size`, `payloadBytes` and `length` only), nothing outside can reach its
   * deliveries, so they go back to the subscriber now (Node frees them and the subscriber
   * reuses them, still in the cache) rather than at a later garbage collection: a reader
   * that makes no objects gives V8 no reason to collect, and the subscriber would read
   * meanwhile into fresh memory. Deliveries a view was taken from are left to the
   * collector, since a view may still be in use (a stream still writing it); so is one that
   * also holds messages taken one at a time before the batch. Afterwards `payload`, `at`
   * and a new iteration throw a {@link ClosedError} (an iterator made before goes on: its
   * batch had handed out, so nothing was detached); `length`, `size` and `payloadBytes`
   * still answer. Calling it again does nothing.
   */
  release(): void {
    if (this.#released) return;
    this.#released = true;
    const lease = this.#p.lease;
    if (!this.#handedOut && lease !== undefined) native.detachDeliveries(deliveriesFrom(this.#p, this.#first), lease);
  }

  /** `using batch = await sub.pollBatch()` releases it at the end of the scope. */
  [Symbol.dispose](): void {
    this.release();
  }

  /** The messages in order. */
  [Symbol.iterator](): IterableIterator<Message> {
    this.#handOut();
    return messagesOf(this.#p, this.#first);
  }
}

/** The messages of `p` from `first` on. */
function* messagesOf(p: Polled, first: number): IterableIterator<Message> {
  if (first >= p.count) return;
  let run = runOf(p, first);
  let end = runEnd(p, run);
  for (let m = first; m < p.count; m++) {
    while (m >= end) end = runEnd(p, ++run);
    yield new Message(p, run, m);
  }
}

/**
 * The deliveries of `p` that hold only messages from `first` on: those a batch from `first`
 * may release (the others also hold messages taken one at a time before it).
 */
function deliveriesFrom(p: Polled, first: number): ArrayBuffer[] {
  const shared = new Set<number>();
  for (let r = 0; r * RUN < p.runs.length; r++) {
    if (p.runs[r * RUN + 1]! < first) shared.add(p.runs[r * RUN]!);
  }
  return p.buffers.filter((_, d) => !shared.has(d));
}

/** The run that message `m` of the poll is in (runs are in order of their first message). */
function runOf(p: Polled, m: number): number {
  let lo = 0;
  let hi = p.runs.length / RUN - 1;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (p.runs[mid * RUN + 1]! <= m) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}
