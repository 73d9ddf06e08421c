// The transport choice (`transport: "auto" | "tcp" | "shm"`, the Rust client's `Transport`)
// for publishers and subscribers against real servers: "shm" publishes and reads over
// shared memory where the server offers it, "tcp" never does, "auto" takes shared memory
// when offered and falls back to TCP when not (where "shm" is refused); and a subscriber
// from the beginning of a topic whose start was reclaimed is told what it skipped.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Admin, BrokerError, ConfigError, ConnectError, Message, Publisher, Subscriber, Transport } from "../ts/index";
import { Server, serveForThisFile, topicName } from "./servers";

// Shared-memory channels need Linux (memfd, futex); elsewhere the server offers none.
const SHM = process.platform === "linux";

let server: Server;
let admin: Admin;
serveForThisFile((s, a) => {
  server = s;
  admin = a;
});

async function read(sub: Subscriber, count: number): Promise<Message[]> {
  const got: Message[] = [];
  for await (const m of sub) {
    got.push(m);
    if (got.length === count) break;
  }
  return got;
}

/** Publishes `count` numbered messages over `transport`; the transports its queues got. */
async function publishOver(control: string, topic: string, transport: Transport, count: number): Promise<string[]> {
  const p = await Publisher.connect(topic, { control, transport, batchBytes: 4096 });
  const used = p.stats().queues.map((q) => q.transport);
  await p.publishMany(Array.from({ length: count }, (_, i) => `m${i}`));
  const stats = await p.close();
  assert.equal(stats.messages, count);
  if (transport === "shm") {
    const inPlace = stats.queues.reduce((n, q) => n + q.inPlace, 0);
    assert.ok(inPlace > 0 && inPlace <= stats.batches, `${inPlace} of ${stats.batches} batches built in the rings`);
  }
  return used;
}

/**
 * Reads `count` messages over `transport`: m0..m{count-1} each once (order 2 keeps each
 * connection's order, not the publisher's across brokers), at positions 0..count-1. The
 * transport the connection used, and the payloads in the order read.
 */
async function readOver(control: string, topic: string, transport: Transport, count: number): Promise<[string, string[]]> {
  const sub = await Subscriber.connect(topic, { control, transport });
  const over = sub.transport;
  const got = await read(sub, count);
  await sub.close();
  const texts = got.map((m) => m.text());
  assert.deepEqual([...texts].sort(), Array.from({ length: count }, (_, i) => `m${i}`).sort(), "each message once");
  assert.deepEqual(got.map((m) => m.globalSeq), [...Array(count).keys()]);
  return [over, texts];
}

test("shm: published and read over shared memory, in order, exactly once", { skip: !SHM && "no shm here", timeout: 60_000 }, async () => {
  const topic = topicName("shm");
  await admin.createTopic(topic, { order: 2, memoryOnly: true });
  const used = await publishOver(server.control, topic, "shm", 3000);
  assert.ok(used.length > 0 && used.every((t) => t === "shm"), `queues over ${used}`);
  const [over, order] = await readOver(server.control, topic, "shm", 3000);
  assert.equal(over, "shm");
  // The same topic over TCP reads the same order.
  const [overTcp, orderTcp] = await readOver(server.control, topic, "tcp", 3000);
  assert.equal(overTcp, "tcp");
  assert.deepEqual(orderTcp, order, "one order whatever the transport");
});

test("auto takes shared memory where the server offers it; tcp never does", { skip: !SHM && "no shm here", timeout: 60_000 }, async () => {
  const topic = topicName("auto");
  await admin.createTopic(topic, { order: 2, memoryOnly: true });
  assert.ok((await publishOver(server.control, topic, "auto", 10)).every((t) => t === "shm"));
  assert.ok((await publishOver(server.control, topic, "tcp", 10)).every((t) => t === "tcp"));
  const sub = await Subscriber.connect(topic, { control: server.control });
  assert.equal(sub.transport, "shm", "auto is the default");
  await sub.close();
});

test("auto falls back to TCP when the server serves no shared memory, and shm is refused", { timeout: 60_000 }, async () => {
  const noShm = await Server.serveConfig("[broker]\nshm = false\n");
  try {
    const control = noShm.control;
    const topic = topicName("noshm");
    await new Admin(control).createTopic(topic, { order: 2, memoryOnly: true });
    const used = await publishOver(control, topic, "auto", 500);
    assert.ok(used.length > 0 && used.every((t) => t === "tcp"), `queues over ${used}`);
    assert.equal((await readOver(control, topic, "auto", 500))[0], "tcp");
    await assert.rejects(Publisher.connect(topic, { control, transport: "shm" }), ConnectError);
    await assert.rejects(Subscriber.connect(topic, { control, transport: "shm" }), ConnectError);
  } finally {
    await noShm.stop();
  }
});

test("an unknown transport is a ConfigError naming the choices", async () => {
  const topic = topicName("bad");
  await admin.createTopic(topic, { order: 2, memoryOnly: true });
  const bad = "udp" as Transport;
  const naming = (e: unknown): boolean => e instanceof ConfigError && /^transport "udp": want one of "auto", "tcp", "shm"$/.test(e.message);
  await assert.rejects(Publisher.connect(topic, { control: server.control, transport: bad }), naming);
  await assert.rejects(Subscriber.connect(topic, { control: server.control, transport: bad }), naming);
});

// The Rust test's tiny region (crates/server/tests/memory.rs): 1 MiB of log memory per broker.
const TINY = `[region]
max_topics = 8
segment_bytes = 262144
segments_per_broker = 4

[broker]
max_batch_bytes = 131072
max_message_bytes = 16384
`;

test("a subscriber from the beginning is told the reclaimed positions it skipped", { timeout: 120_000 }, async () => {
  const tiny = await Server.serveConfig(TINY);
  try {
    const control = tiny.control;
    const topic = topicName("gone");
    const tinyAdmin = new Admin(control);
    await tinyAdmin.createTopic(topic, { order: 2, memoryOnly: true });
    const N = 12_000; // ~12 MB through 4 MiB of log memory
    const p = await Publisher.connect(topic, { control, batchBytes: 32 * 1024 });
    const payload = Buffer.alloc(1000, 4);
    for (let i = 0; i < N; i += 500) await p.publishMany(Array.from({ length: 500 }, () => payload));
    await p.close();
    assert.equal((await tinyAdmin.describeTopic(topic)).nextPosition, N);

    // An explicit position that is gone is refused, not waited for.
    const fromZero = await Subscriber.connect(topic, { control, from: 0 });
    await assert.rejects(fromZero.poll(10_000), (e: unknown) => e instanceof BrokerError && e.code === "PositionNotRetained");
    assert.equal(fromZero.skipped(), undefined, "a given start skips nothing: it is refused");
    await fromZero.close();

    // From the beginning: told on connecting, before any message.
    const sub = await Subscriber.connect(topic, { control });
    const skipped = sub.skipped();
    assert.ok(skipped !== undefined, "the skipped range is told");
    assert.ok(skipped.from === 0 && skipped.to > 0 && skipped.to < N, `skipped ${skipped.from}..${skipped.to}`);
    const rest = await read(sub, N - skipped.to);
    assert.deepEqual(rest.map((m) => m.globalSeq), Array.from({ length: N - skipped.to }, (_, i) => skipped.to + i), "every retained message");
    assert.equal(await sub.poll(200), null);
    assert.deepEqual(sub.skipped(), skipped);
    // Back to the start: the first message still retained, not the gone position 0.
    await sub.seek("start");
    const again = await read(sub, N - skipped.to);
    assert.deepEqual(again.map((m) => m.globalSeq), Array.from({ length: N - skipped.to }, (_, i) => skipped.to + i), "from the start again");
    await sub.close();

    // Nothing reclaimed: nothing skipped.
    const whole = topicName("whole");
    await tinyAdmin.createTopic(whole, { order: 2, memoryOnly: true });
    const q = await Publisher.connect(whole, { control });
    await q.publish("one");
    await q.close();
    const fresh = await Subscriber.connect(whole, { control });
    assert.equal((await read(fresh, 1))[0]!.text(), "one");
    assert.equal(fresh.skipped(), undefined);
    await fresh.close();
  } finally {
    await tiny.stop();
  }
});
