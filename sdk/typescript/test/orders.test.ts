// Every order level with every ack level it allows, publish and publishMany, read back
// in full by a subscriber; two subscribers see one order; order-5 sessions keep their
// FIFO order across brokers; positions, seek and "end".
import { test } from "node:test";
import assert from "node:assert/strict";
import { setFlagsFromString } from "node:v8";
import { spawnSync } from "node:child_process";
import { inspect } from "node:util";
import { runInNewContext } from "node:vm";
import { randomBytes } from "node:crypto";
import { Admin, BrokerError, Message, Order, Publisher, Subscriber } from "../ts/index";
import { Server, serveForThisFile, topicName } from "./servers";

let server: Server;
let admin: Admin;
serveForThisFile((s, a) => {
  server = s;
  admin = a;
});

/** Reads exactly `count` messages (failing if fewer come within the test's time). */
async function read(sub: Subscriber, count: number): Promise<Message[]> {
  const got: Message[] = [];
  for await (const m of sub) {
    got.push(m);
    if (got.length === count) break;
  }
  return got;
}

/** Publishes "id" payloads 0..count-1: half with publish, half with publishMany. */
async function publishIds(p: Publisher, from: number, count: number): Promise<void> {
  const half = Math.floor(count / 2);
  for (let i = from; i < from + half; i++) await p.publish(`m${i}`);
  const rest: Buffer[] = [];
  for (let i = from + half; i < from + count; i++) rest.push(Buffer.from(`m${i}`));
  await p.publishMany(rest);
}

const COUNT = 2000;
/** More messages than `publishMany` passes as arguments (ts/publisher.ts, MOST_ARGUMENTS). */
const LONG = 5000;

test("every field of a message reads as published: counter, publish time, batch, index and size", { timeout: 60_000 }, async () => {
  const topic = topicName("fields");
  await admin.createTopic(topic, { order: 2 });
  const before = BigInt(Date.now() - 1000) * 1_000_000n;
  const p = await Publisher.connect(topic, { control: server.control, ackLevel: 1, batchBytes: 4096 });
  // Payloads of growing sizes, so that a message read at the wrong offset shows; the
  // second call's array is too long to go as arguments, so it is passed whole.
  const payload = (i: number) => Buffer.from(`m${i}:${"x".repeat(i % 97)}`);
  await p.publishMany(Array.from({ length: COUNT }, (_, i) => payload(i)));
  await p.publishMany(Array.from({ length: LONG }, (_, i) => payload(COUNT + i)));
  await p.close();
  const after = BigInt(Date.now() + 1000) * 1_000_000n;
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got = await read(sub, COUNT + LONG);
  await sub.close();
  const ids = got.map((m) => Number(m.text().split(":")[0]!.slice(1))).sort((a, b) => a - b);
  assert.deepEqual(ids, Array.from({ length: COUNT + LONG }, (_, i) => i), "every message once");
  const firstOfBatch = new Map<string, number>();
  for (const m of got) {
    const id = Number(m.text().split(":")[0]!.slice(1));
    assert.equal(m.counter, id, "the publisher's counter counts its messages from 0");
    assert.ok(m.publishTsNs >= before && m.publishTsNs <= after, `publish time ${m.publishTsNs}`);
    assert.equal(m.size, m.payload.length);
    assert.equal(m.size, `m${id}:`.length + (id % 97));
    // A batch holds consecutive messages of its publisher, numbered from 0 in it.
    const batch = `${m.brokerId}/${m.batchSeq}`;
    if (!firstOfBatch.has(batch)) firstOfBatch.set(batch, id - m.indexInBatch);
    assert.equal(id - m.indexInBatch, firstOfBatch.get(batch), `message ${id} in batch ${batch}`);
  }
  assert.ok(firstOfBatch.size > 10, `${firstOfBatch.size} batches: several runs of several deliveries`);
});

for (const [order, acks] of [
  [0, [0, 1]],
  [1, [0, 1]],
  [2, [0, 1, 2]],
  [5, [0, 1, 2]],
] as [Order, (0 | 1 | 2)[]][]) {
  for (const ackLevel of acks) {
    test(`order ${order}, ack ${ackLevel}: every message delivered once, in order`, { timeout: 60_000 }, async () => {
      const topic = topicName(`o${order}a${ackLevel}`);
      const info = await admin.createTopic(topic, { order });
      assert.equal(info.replicationFactor, order >= 2 ? 2 : 1, "the CLI's durable default");
      const p = await Publisher.connect(topic, { control: server.control, ackLevel, batchBytes: 4096 });
      await publishIds(p, 0, COUNT);
      await p.flush();
      const stats = await p.close();
      assert.equal(stats.messages, COUNT);
      assert.equal(stats.clientId, p.clientId);
      if (ackLevel > 0) assert.equal(stats.ackedBatches, stats.batches);

      const sub = await Subscriber.connect(topic, { control: server.control });
      assert.equal(sub.order, order);
      const got = await read(sub, COUNT);
      await sub.close();
      const ids = got.map((m) => Number(m.text().slice(1)));
      assert.equal(new Set(ids).size, COUNT, "each message once");
      for (const [i, m] of got.entries()) {
        assert.equal(m.clientId, p.clientId);
        assert.ok(m.payload.equals(Buffer.from(`m${ids[i]}`)));
      }
      if (order >= 2) {
        assert.deepEqual(got.map((m) => m.globalSeq), [...Array(COUNT).keys()], "positions 0..n-1");
        assert.ok(got.every((m) => m.brokerSeq === undefined));
      } else {
        assert.ok(got.every((m) => m.globalSeq === undefined && m.brokerSeq === m.position));
      }
      if (order === 1 || order === 5) {
        // One publisher: FIFO per broker (order 1), and per session overall (order 5).
        const byBroker = new Map<number, number[]>();
        for (const [i, m] of got.entries()) {
          const key = order === 5 ? 0 : m.brokerId;
          byBroker.set(key, [...(byBroker.get(key) ?? []), ids[i]!]);
        }
        for (const seq of byBroker.values()) {
          assert.deepEqual(seq, [...seq].sort((a, b) => a - b));
        }
      }
    });
  }
}

test("a program that ends without closing its publisher still publishes what it was given", { timeout: 60_000 }, async () => {
  const topic = topicName("noclose");
  await admin.createTopic(topic, { memoryOnly: true });
  // A separate Node process, as a user's script: awaited publishes, then the end of the
  // program, with no close(). The SDK closes it on `beforeExit`.
  const script = `
    const { Publisher } = require(${JSON.stringify(require.resolve("../ts/index"))});
    (async () => {
      const p = await Publisher.connect(${JSON.stringify(topic)}, { control: ${JSON.stringify(server.control)} });
      for (let i = 0; i < 10; i++) await p.publish("m" + i);
      await p.publishMany(["m10", "m11"]);
    })();`;
  const child = spawnSync(process.execPath, ["-e", script], { encoding: "utf8", timeout: 30_000 });
  assert.equal(child.status, 0, child.stderr);
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got: string[] = [];
  while (got.length < 12) {
    const m = await sub.poll(10_000);
    assert.ok(m, `only ${got.length} of 12 messages arrived: ${got.join(" ")}`);
    got.push(m.payload.toString());
  }
  await sub.close();
  assert.deepEqual(got, Array.from({ length: 12 }, (_, i) => `m${i}`));
});

test("two subscribers see one order", { timeout: 60_000 }, async () => {
  const topic = topicName("two");
  await admin.createTopic(topic, { order: 2, memoryOnly: true });
  const subs = await Promise.all([1, 2].map(() => Subscriber.connect(topic, { control: server.control })));
  const publishers = await Promise.all(
    [0, 1, 2].map(() => Publisher.connect(topic, { control: server.control, batchBytes: 2048 })),
  );
  const reading = subs.map((s) => read(s, 3 * COUNT));
  await Promise.all(publishers.map((p, i) => publishIds(p, i * COUNT, COUNT).then(() => p.close())));
  const [a, b] = await Promise.all(reading);
  const key = (m: Message) => `${m.position}:${m.text()}`;
  assert.deepEqual(a!.map(key), b!.map(key));
  assert.equal(new Set(a!.map((m) => m.text())).size, 3 * COUNT);
  await Promise.all(subs.map((s) => s.close()));
});

test("order 5: each session's messages keep their order across brokers", { timeout: 60_000 }, async () => {
  const topic = topicName("o5fifo");
  await admin.createTopic(topic, { order: 5 });
  const sessions = await Promise.all(
    [0, 1, 2].map(() => Publisher.connect(topic, { control: server.control, batchBytes: 1024, lingerMs: 0 })),
  );
  await Promise.all(sessions.map((p, i) => publishIds(p, i * COUNT, COUNT).then(() => p.close())));
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got = await read(sub, 3 * COUNT);
  await sub.close();
  for (const p of sessions) {
    const mine = got.filter((m) => m.clientId === p.clientId);
    assert.equal(mine.length, COUNT);
    const ids = mine.map((m) => Number(m.text().slice(1)));
    assert.deepEqual(ids, [...ids].sort((x, y) => x - y), "publish order within the session");
    assert.ok(new Set(mine.map((m) => m.brokerId)).size > 1, "the session's batches went through several brokers");
  }
});

test("order 5: a second publisher of a session takes it over and the first stops", { timeout: 60_000 }, async () => {
  // One client id and session key in two live publishers (a restarted program whose first
  // run still lives): the second opens the next epoch; the first fails with SessionTakenOver
  // instead of publishing beside it. Every acknowledged message is read once.
  const topic = topicName("o5takeover");
  await admin.createTopic(topic, { order: 5 });
  const options = { control: server.control, clientId: 78n, sessionKey: randomBytes(16) };
  const first = await Publisher.connect(topic, options);
  await first.publishMany(["first 0", "first 1"]);
  await first.flush();
  const second = await Publisher.connect(topic, options);
  assert.deepEqual([first.stats().sessionEpoch, second.stats().sessionEpoch], [1n, 2n]);
  await second.publish("second 0");
  await second.flush();
  await assert.rejects(
    first.publish("late").then(() => first.flush()),
    (e: unknown) =>
      e instanceof BrokerError &&
      e.code === "SessionTakenOver" &&
      /took this order-5 session over/.test(e.message),
  );
  await second.publish("second 1");
  await second.close();
  await first.close().catch(() => undefined);
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got = await read(sub, 4);
  await sub.close();
  assert.deepEqual(got.map((m) => m.text()), ["first 0", "first 1", "second 0", "second 1"]);
});

test("publishers use the topic's default ack unless they choose one", { timeout: 30_000 }, async () => {
  const topic = topicName("defack");
  await admin.createTopic(topic, { defaultAck: 2 });
  const durable = await Publisher.connect(topic, { control: server.control });
  assert.equal(durable.stats().ackLevel, 2, "as `embarcadero pub` does");
  await durable.close();
  const chosen = await Publisher.connect(topic, { control: server.control, ackLevel: 1 });
  assert.equal(chosen.stats().ackLevel, 1);
  await chosen.close();
});

test("order 5: calls made without awaiting keep their order through the stage and its drain", { timeout: 120_000 }, async () => {
  // Each call appends what the publisher has room for and stages the rest, which a drain
  // hands on (src/publisher.rs); 30 MB of calls that are not awaited one by one stage
  // behind each other again and again, so drains start, linger, stop and start while
  // calls go on.
  const topic = topicName("o5mixed");
  await admin.createTopic(topic, { order: 5 });
  const p = await Publisher.connect(topic, { control: server.control });
  const message = (i: number): Buffer => {
    const b = Buffer.alloc(1024, 0x2e);
    b.write(`m${i} `);
    return b;
  };
  let next = 0;
  while (next < 30_000) {
    const calls: Promise<void>[] = [];
    for (let k = 0; k < 1000; k++) {
      if (k % 4 === 0) {
        calls.push(p.publishMany(Array.from({ length: 7 }, (_, j) => message(next + j))));
        next += 7;
      } else {
        calls.push(p.publish(message(next++)));
      }
    }
    await Promise.all(calls);
  }
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got = await read(sub, next);
  await sub.close();
  const ids = got.map((m) => Number(m.text().split(" ")[0]!.slice(1)));
  assert.equal(ids.length, next);
  assert.ok(ids.every((id, i) => id === i), "every message once, in the order of the calls");
});

/**
 * A publisher on a new order-2 topic whose queue 0 sends a batch every 10 ms and holds one
 * more (no deflection): a call appends little before it has to stage the rest.
 */
async function publisherThatStages(name: string): Promise<{ topic: string; p: Publisher }> {
  const topic = topicName(name);
  await admin.createTopic(topic, { order: 2 });
  const p = await Publisher.connect(topic, {
    control: server.control,
    batchBytes: 65536,
    queueDepth: 1,
    deflect: false,
    slowQueue: { index: 0, ms: 10 },
  });
  return { topic, p };
}

/** `count` payloads of 8 KiB, each filled with its index. */
function payloadsOf8KiB(count: number): Buffer[] {
  return Array.from({ length: count }, (_, i) => Buffer.alloc(8192, i));
}

test("calls made without awaiting while messages are staged share one wait, and every message arrives", { timeout: 120_000 }, async () => {
  // A call that leaves messages staged waits until the drain has handed them over; calls
  // made without awaiting meanwhile get the same wait, not one each, and stage everything
  // behind it.
  const { topic, p } = await publisherThatStages("room");
  const chunk = payloadsOf8KiB(576); // 4.5 MiB
  const calls = Array.from({ length: 10 }, () => p.publishMany(chunk));
  assert.ok(calls.every((call) => call === calls[0]), "one wait, shared by every call that waits");
  await Promise.all(calls);
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got = await read(sub, 5760);
  await sub.close();
  assert.equal(got.length, 5760);
  assert.ok(got.every((m) => m.payload.length === 8192));
});

test("a call that leaves messages staged resolves once they are in the publisher, the event loop turning meanwhile", { timeout: 120_000 }, async () => {
  // Without the wait the call would resolve at once and the next would stage behind it
  // (a drain copying every message twice, PERFORMANCE.md "Session 37").
  const { topic, p } = await publisherThatStages("handed");
  const chunk = payloadsOf8KiB(64); // 512 KiB
  let ticks = 0;
  const ticker = setInterval(() => (ticks += 1), 1);
  let sent = 0;
  let turnedWhileWaiting = 0;
  for (let call = 0; call < 20; call++) {
    const before = ticks;
    await p.publishMany(chunk);
    sent += chunk.length;
    if (ticks > before) turnedWhileWaiting += 1;
    assert.equal(p.stats().messages, sent, `call ${call} resolved with all its messages in the publisher`);
  }
  clearInterval(ticker);
  // A queue that sends every 10 ms makes calls stage: some waited, and timers ran meanwhile.
  assert.ok(turnedWhileWaiting > 0, "no call waited: nothing was staged, the test saw nothing");
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got = await read(sub, sent);
  await sub.close();
  assert.equal(got.length, sent);
});

test("position, seek and starting from a position or the end", { timeout: 60_000 }, async () => {
  const topic = topicName("seek");
  await admin.createTopic(topic, { order: 2, memoryOnly: true });
  const p = await Publisher.connect(topic, { control: server.control });
  await publishIds(p, 0, 100);
  await p.flush();

  const sub = await Subscriber.connect(topic, { control: server.control, from: 40 });
  assert.equal(sub.position(), 40);
  const first = await sub.poll(10_000);
  assert.equal(first?.position, 40);
  assert.equal(first?.text(), "m40");
  assert.equal(sub.position(), 41);
  await sub.seek(7);
  assert.equal(sub.position(), 7);
  assert.equal((await sub.poll(10_000))?.text(), "m7");

  const tail = await Subscriber.connect(topic, { control: server.control, from: "end" });
  assert.equal(tail.position(), 100);
  await p.publish("after");
  await p.flush();
  const next = await tail.poll(10_000);
  assert.equal(next?.position, 100);
  assert.equal(next?.text(), "after");
  await Promise.all([sub.close(), tail.close(), p.close()]);
});

test("a seek after the native reader filled its read-ahead goes on from the new position", { timeout: 60_000 }, async () => {
  // Rounds flushed one at a time while the native thread reads: each lands in a poll of
  // its own, so the thread fills its queue and waits for room; the seek empties the queue.
  const topic = topicName("seekahead");
  await admin.createTopic(topic, { order: 2, memoryOnly: true });
  const p = await Publisher.connect(topic, { control: server.control });
  const sub = await Subscriber.connect(topic, { control: server.control });
  await p.publish("m0");
  await p.flush();
  assert.equal((await sub.poll(30_000))?.text(), "m0");
  for (let i = 1; i < 200; i++) {
    await p.publish(`m${i}`);
    if (i % 10 === 0) await p.flush();
  }
  await p.flush();
  await sub.seek(150);
  const got: string[] = [];
  while (got.length < 50) {
    const m = await sub.poll(20_000);
    assert.ok(m !== null, `message ${150 + got.length} came`);
    got.push(m.text());
  }
  assert.deepEqual(got, Array.from({ length: 50 }, (_, i) => `m${150 + i}`));
  await sub.seek("end");
  assert.equal(sub.position(), 200);
  assert.equal(await sub.poll(200), null);
  await Promise.all([sub.close(), p.close()]);
});

test("per-broker positions for orders 0 and 1", { timeout: 60_000 }, async () => {
  const topic = topicName("perbroker");
  await admin.createTopic(topic, { order: 1 });
  const p = await Publisher.connect(topic, { control: server.control, batchBytes: 512 });
  await publishIds(p, 0, 400);
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  const all = await read(sub, 400);
  const end = sub.position() as readonly number[];
  assert.ok(Array.isArray(end));
  const perBroker = new Map<number, number>();
  for (const m of all) perBroker.set(m.brokerId, (perBroker.get(m.brokerId) ?? 0) + 1);
  for (const [broker, n] of perBroker) assert.equal(end[broker], n);
  const tail = await Subscriber.connect(topic, { control: server.control, from: "end" });
  assert.deepEqual(tail.position(), end);
  await sub.seek("start");
  assert.deepEqual(sub.position(), end.map(() => 0));
  assert.equal((await read(sub, 400)).length, 400, "from the start again");
  await Promise.all([sub.close(), tail.close()]);
});

test("a payload is a Buffer: instanceof, Buffer.isBuffer, its methods, subarray, printing", { timeout: 60_000 }, async () => {
  const topic = topicName("buf");
  await admin.createTopic(topic, { order: 2, memoryOnly: true });
  const p = await Publisher.connect(topic, { control: server.control });
  await p.publish("hello, world");
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  const [m] = await read(sub, 1);
  await sub.close();
  const b = m!.payload;
  assert.ok(Buffer.isBuffer(b) && b instanceof Buffer && b instanceof Uint8Array);
  assert.equal(b.toString("utf8"), "hello, world");
  assert.ok(b.equals(Buffer.from("hello, world")));
  assert.equal(b.readUInt8(0), 104);
  assert.equal(b.indexOf("world"), 7);
  const tail = b.subarray(7);
  assert.ok(Buffer.isBuffer(tail) && tail.toString() === "world");
  assert.equal(Buffer.concat([b.subarray(0, 5), Buffer.from("!")]).toString(), "hello!");
  assert.deepEqual(JSON.parse(JSON.stringify(b)), JSON.parse(JSON.stringify(Buffer.from("hello, world"))));
  assert.equal(inspect(b), inspect(Buffer.from("hello, world")));
});

test("payloads kept from early polls survive later polls and collections", { timeout: 60_000 }, async () => {
  // Each payload is a view of the Rust subscriber's delivery buffer, which it reuses once
  // JavaScript has collected every view of it: collecting between polls makes it reuse the
  // buffers of the dropped messages, and the kept views must still read as published.
  setFlagsFromString("--expose-gc");
  const gc = runInNewContext("gc") as () => void;
  const topic = topicName("kept");
  // Replicated: 20 MB is read from position 0 after it is all published, and a
  // memory-only topic nobody reads may lose its older segments to the module's other
  // topics meanwhile (the broker's pool is shared).
  await admin.createTopic(topic, { order: 2 });
  const total = 20_000;
  const body = (i: number): Buffer => Buffer.from(`m${i}:`.padEnd(1024, "x"));
  const p = await Publisher.connect(topic, { control: server.control });
  for (let i = 0; i < total; i += 1000) {
    await p.publishMany(Array.from({ length: 1000 }, (_, k) => body(i + k)));
  }
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  const kept = (await read(sub, 100)).map((m) => m.payload);
  let seen = 100;
  while (seen < total) {
    const more = await read(sub, Math.min(2000, total - seen));
    seen += more.length;
    gc();
    await new Promise((resolve) => setImmediate(resolve)); // finalizers run after the collection
  }
  const ids = kept.map((b) => Number(b.toString("utf8", 1, b.indexOf(":"))));
  assert.equal(new Set(ids).size, 100);
  for (const [k, b] of kept.entries()) assert.ok(b.equals(body(ids[k]!)), `kept payload ${k} changed`);
  await sub.close();
});

test("payloads written by JavaScript change only their own bytes, and later deliveries read as published", { timeout: 60_000 }, async () => {
  // JavaScript can write into any Buffer, so into a payload, which is the Rust subscriber's
  // own memory (its bytes sit in UnsafeCells for this reason). A write must stay in that
  // payload: the neighbours in its delivery, the kept written payloads, and the buffers
  // reused after collection must all read as they should, and the stream goes on in order.
  setFlagsFromString("--expose-gc");
  const gc = runInNewContext("gc") as () => void;
  const topic = topicName("written");
  // Replicated: 20 MB is read from position 0 after it is all published, and a
  // memory-only topic nobody reads may lose its older segments to the module's other
  // topics meanwhile (the broker's pool is shared).
  await admin.createTopic(topic, { order: 2 });
  const total = 20_000;
  const body = (i: number): Buffer => Buffer.from(`m${i}:`.padEnd(1024, "x"));
  const p = await Publisher.connect(topic, { control: server.control });
  for (let i = 0; i < total; i += 1000) {
    await p.publishMany(Array.from({ length: 1000 }, (_, k) => body(i + k)));
  }
  await p.close();
  // The total order interleaves the publisher's batches to different brokers, so each
  // payload is checked against the body its own id names.
  const idOf = (b: Buffer): number => Number(b.toString("utf8", 1, b.indexOf(":")));
  const ids = new Set<number>();
  const check = (m: Message, position: number): void => {
    assert.equal(m.position, position, "in order");
    const id = idOf(m.payload);
    assert.ok(m.payload.equals(body(id)), `message at ${position} (id ${id}) reads as published`);
    ids.add(id);
  };
  const sub = await Subscriber.connect(topic, { control: server.control });
  const first = await read(sub, 100);
  first.forEach((m, k) => check(m, k));
  // Every other payload overwritten and kept; the ones between must not change.
  const written = first.filter((_, k) => k % 2 === 0).map((m) => m.payload.fill(0x21));
  for (const [k, m] of first.entries()) {
    if (k % 2 === 1) assert.ok(m.payload.equals(body(idOf(m.payload))), `neighbour ${k} changed by a write`);
  }
  assert.equal(first[0]!.payload, first[0]!.payload, "the payload view is made once");
  let seen = 100;
  while (seen < total) {
    for (const m of await read(sub, Math.min(2000, total - seen))) {
      check(m, seen);
      m.payload.fill(0x3f); // dropped right after: its buffer is reused, written
      seen += 1;
    }
    gc();
    await new Promise((resolve) => setImmediate(resolve)); // finalizers run after the collection
  }
  assert.equal(ids.size, total, "every message once");
  for (const b of written) assert.ok(b.every((x) => x === 0x21), "a kept written payload was reused");
  await sub.close();
});
