// `Subscriber.pollBatch`: a poll's messages handed over whole, against a real server.
import { test } from "node:test";
import assert from "node:assert/strict";
import { setFlagsFromString } from "node:v8";
import { runInNewContext } from "node:vm";
import { Admin, ClosedError, Message, MessageBatch, Order, Publisher, Subscriber } from "../ts/index";
import { Server, serveForThisFile, topicName } from "./servers";

let server: Server;
let admin: Admin;
serveForThisFile((s, a) => {
  server = s;
  admin = a;
});

/** Payload `i`: its number, then filler of a length that changes from message to message. */
function numbered(i: number): Buffer {
  return Buffer.from(`m${i}:${"x".repeat(100 + (i % 900))}`);
}

function numberOf(payload: Buffer): number {
  return Number(payload.toString("latin1", 1, payload.indexOf(":")));
}

async function publishNumbered(topic: string, count: number): Promise<void> {
  const p = await Publisher.connect(topic, { control: server.control });
  await p.publishMany(Array.from({ length: count }, (_, i) => numbered(i)));
  await p.close();
}

/** Batches until they hold `count` messages; fails if one poll brings nothing in 30 s. */
async function batches(sub: Subscriber, count: number): Promise<MessageBatch[]> {
  const got: MessageBatch[] = [];
  let n = 0;
  while (n < count) {
    const b = await sub.pollBatch(30_000);
    assert.ok(b.length > 0, `no batch within 30 s after ${n} messages`);
    got.push(b);
    n += b.length;
  }
  return got;
}

const fields = (m: Message) => [m.position, m.brokerId, m.clientId, m.batchSeq, m.indexInBatch, m.payload.toString("latin1")];

for (const order of [0, 2] as Order[]) {
  test(`order ${order}: batches hold every message once, in the order poll gives, with the same fields`, { timeout: 60_000 }, async () => {
    const topic = topicName(`batch${order}`);
    await admin.createTopic(topic, { order });
    const count = 5000;
    await publishNumbered(topic, count);
    const one = await Subscriber.connect(topic, { control: server.control });
    const oneByOne: Message[] = [];
    while (oneByOne.length < count) oneByOne.push(...(await one.pollMany(30_000)));
    await one.close();
    const sub = await Subscriber.connect(topic, { control: server.control });
    const got = await batches(sub, count);
    await sub.close();
    assert.ok(got.length > 1, "5000 messages of up to 1 KiB come in more than one poll");
    const messages = got.flatMap((b) => [...b]);
    assert.deepEqual(messages.map(fields), oneByOne.map(fields));
    for (const b of got) {
      const listed = [...b];
      assert.deepEqual(Array.from({ length: b.length }, (_, i) => b.size(i)), listed.map((m) => m.payload.length));
      assert.deepEqual(Array.from({ length: b.length }, (_, i) => b.payload(i)), listed.map((m) => m.payload));
      assert.deepEqual(Array.from({ length: b.length }, (_, i) => fields(b.at(i)!)), listed.map(fields));
      assert.equal(b.payloadBytes, listed.reduce((t, m) => t + m.size, 0));
      assert.deepEqual(fields(b.at(-1)!), fields(listed[listed.length - 1]!));
    }
    const numbers = messages.map((m) => numberOf(m.payload)).sort((a, b) => a - b);
    assert.deepEqual(numbers, Array.from({ length: count }, (_, i) => i));
  });
}

test("a batch is the rest of a poll partly taken, and the position is past it at once", { timeout: 60_000 }, async () => {
  const topic = topicName("batchrest");
  await admin.createTopic(topic, { order: 2 });
  await publishNumbered(topic, 300);
  const sub = await Subscriber.connect(topic, { control: server.control });
  for (let i = 0; i < 3; i++) assert.equal((await sub.poll(30_000))!.globalSeq, i);
  let seen = 3;
  while (seen < 300) {
    const b = await sub.pollBatch(30_000);
    assert.deepEqual([...b].map((m) => m.globalSeq), Array.from({ length: b.length }, (_, i) => seen + i));
    seen += b.length;
    assert.equal(sub.position(), seen);
  }
  assert.equal(await sub.poll(100), null);
  await sub.close();
});

test("an empty batch when the time runs out; indexes outside a batch are refused; a closed subscriber rejects", { timeout: 60_000 }, async () => {
  const topic = topicName("batchedge");
  await admin.createTopic(topic, { order: 2 });
  const sub = await Subscriber.connect(topic, { control: server.control });
  const empty = await sub.pollBatch(50);
  assert.equal(empty.length, 0);
  assert.deepEqual([...empty], []);
  assert.equal(empty.payloadBytes, 0);
  assert.equal(empty.at(0), undefined);
  await publishNumbered(topic, 5);
  const got = await batches(sub, 5);
  const last = got[got.length - 1]!;
  for (const bad of [last.length, -1, 0.5, Number.NaN]) {
    assert.throws(() => last.size(bad), RangeError);
    assert.throws(() => last.payload(bad), /of a batch of/);
  }
  assert.equal(last.at(last.length), undefined);
  assert.equal(last.at(-last.length - 1), undefined);
  await sub.close();
  await assert.rejects(sub.pollBatch(100), ClosedError);
});

test("a batch's payloads outlive later polls and the subscriber", { timeout: 60_000 }, async () => {
  const topic = topicName("batchkeep");
  await admin.createTopic(topic, { order: 2 });
  const count = 20_000;
  await publishNumbered(topic, count);
  const sub = await Subscriber.connect(topic, { control: server.control });
  const first = await sub.pollBatch(30_000);
  // Copies of what the batch read when it came (the total order interleaves the
  // publisher's batches to different brokers, so its numbers are not 0, 1, 2...).
  const numbers = Array.from({ length: first.length }, (_, i) => numberOf(first.payload(i)));
  const rest = await batches(sub, count - first.length);
  await sub.close();
  assert.equal(rest.reduce((t, b) => t + b.length, 0), count - first.length);
  const text = (b: Buffer) => b.toString("latin1");
  assert.deepEqual(Array.from({ length: first.length }, (_, i) => text(first.payload(i))), numbers.map((n) => text(numbered(n))));
});

test("release gives back only deliveries nothing was taken from: views taken stay whole, earlier messages untouched", { timeout: 60_000 }, async () => {
  const topic = topicName("batchrelease");
  await admin.createTopic(topic, { order: 2 });
  await publishNumbered(topic, 2000);
  const sub = await Subscriber.connect(topic, { control: server.control });
  // One message taken alone: the batch after it shares that message's delivery.
  const alone = (await sub.poll(30_000))!;
  const aloneText = alone.payload.toString("latin1");
  // A batch a view was taken from: release keeps its deliveries (the view may be in use,
  // as by a stream still writing it); the batch itself hands nothing more out.
  const viewed = await sub.pollBatch(30_000);
  assert.ok(viewed.length > 0);
  const view = viewed.payload(viewed.length - 1);
  const viewText = view.toString("latin1");
  const sizes = Array.from({ length: viewed.length }, (_, i) => viewed.size(i));
  const total = viewed.payloadBytes;
  viewed.release();
  viewed.release(); // again: nothing more
  assert.equal(view.toString("latin1"), viewText);
  assert.equal(alone.payload.toString("latin1"), aloneText);
  assert.throws(() => viewed.payload(0), ClosedError);
  assert.throws(() => viewed.at(0), ClosedError);
  assert.throws(() => [...viewed], ClosedError);
  assert.deepEqual(Array.from({ length: viewed.length }, (_, i) => viewed.size(i)), sizes);
  assert.equal(viewed.payloadBytes, total);
  // Batches only sized, released (by `using` for the first): reading goes on, every message
  // once, and the message taken alone still reads as published.
  let seen = 1 + viewed.length;
  {
    using sized = await sub.pollBatch(30_000);
    seen += sized.length;
    assert.ok(sized.payloadBytes > 0);
  }
  while (seen < 2000) {
    const b = await sub.pollBatch(30_000);
    assert.ok(b.length > 0, `no batch within 30 s after ${seen} messages`);
    seen += b.length;
    b.release();
  }
  assert.equal(seen, 2000);
  // The released batches' deliveries were read into again: the view and the message kept
  // from before still read as published.
  assert.equal(view.toString("latin1"), viewText);
  assert.equal(alone.payload.toString("latin1"), aloneText);
  assert.equal((await sub.pollBatch(100)).length, 0);
  await sub.close();
});

test("at() takes indexes as Array.at does", { timeout: 60_000 }, async () => {
  const topic = topicName("batchat");
  await admin.createTopic(topic, { order: 2 });
  await publishNumbered(topic, 10);
  const sub = await Subscriber.connect(topic, { control: server.control });
  const got = await batches(sub, 10);
  await sub.close();
  const b = got[0]!;
  const pos = (m: Message | undefined) => m?.position;
  assert.equal(pos(b.at(0.7)), pos(b.at(0)));
  assert.equal(pos(b.at(Number.NaN)), pos(b.at(0)));
  assert.equal(pos(b.at(-1.2)), pos(b.at(b.length - 1)));
  assert.equal(b.at(b.length), undefined);
  assert.equal(b.at(-b.length - 1), undefined);
});

test("a subscriber that waited for a poll and was dropped without close() is still collected", { timeout: 60_000 }, async () => {
  // The native reading thread wakes a waiting subscriber through a function the native side
  // holds as a root; were that function to hold the subscriber, an unclosed subscriber (its
  // connection and its thread) would live for ever.
  setFlagsFromString("--expose-gc");
  const gc = runInNewContext("gc") as () => void;
  const topic = topicName("batchgc");
  await admin.createTopic(topic, { order: 2 });
  let collected = false;
  const registry = new FinalizationRegistry(() => {
    collected = true;
  });
  await (async () => {
    const sub = await Subscriber.connect(topic, { control: server.control });
    // Nothing published: the poll waits on the native wake for its whole timeout.
    assert.equal((await sub.pollBatch(50)).length, 0);
    registry.register(sub, "sub");
  })();
  // A hang guard, not a timing: collection is what is waited for.
  for (let i = 0; i < 500 && !collected; i++) {
    gc();
    await new Promise((resolve) => setImmediate(resolve));
  }
  assert.ok(collected, "the subscriber was never collected");
});
