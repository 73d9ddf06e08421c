// Bad input rejects with the right typed error, the message the CLI would print, and
// never hangs (each test has a deadline): unknown topic, bad names, a message over the
// maximum, a closed publisher, and a server that is gone (SIGKILLed). Also: waiting on
// the network never blocks the event loop.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  Admin,
  AdminError,
  BrokerError,
  ClosedError,
  ConfigError,
  ConnectError,
  EmbarcaderoError,
  InvalidNameError,
  MessageTooLargeError,
  Publisher,
  StepError,
  Subscriber,
  Worker,
} from "../ts/index";
import type { PublisherOptions, SubscriberOptions } from "../ts/index";
import { Server, serveForThisFile, topicName } from "./servers";

let server: Server;
let admin: Admin;
serveForThisFile((s, a) => {
  server = s;
  admin = a;
});

test("admin: create, list, describe, cluster, status, with the CLI's defaults", { timeout: 30_000 }, async () => {
  const durable = await admin.createTopic(topicName("durable"));
  assert.equal(durable.order, 2);
  assert.equal(durable.replicationFactor, 2);
  assert.equal((await admin.createTopic(topicName("mem"), { memoryOnly: true })).replicationFactor, 1);
  assert.equal((await admin.createTopic(topicName("o0"), { order: 0 })).replicationFactor, 1);
  assert.equal((await admin.createTopic(topicName("rf3"), { order: 5, rf: 3 })).replicationFactor, 3);
  const names = (await admin.listTopics()).map((t) => t.name);
  assert.ok(names.includes(durable.name));
  const d = await admin.describeTopic(durable.name);
  assert.equal(d.nextPosition, 0);
  assert.deepEqual(d.brokers.map((b) => [b.broker, b.messages]), [[0, 0], [1, 0], [2, 0], [3, 0]]);
  assert.deepEqual(d.health, { readers: 0, replicaErrors: [] }, "no subscriber, no failing replica");
  const cluster = await admin.cluster();
  assert.equal(cluster.brokers.length, 4);
  assert.ok(cluster.maxMessageBytes > 0);
  assert.equal(typeof (await admin.status()), "object");
  await assert.rejects(admin.createTopic(topicName("x"), { rf: 2, memoryOnly: true }), ConfigError);
});

test("a misspelt option is refused by name, never silently ignored", { timeout: 30_000 }, async () => {
  const topic = topicName("typo");
  await admin.createTopic(topic, { memoryOnly: true });
  const misspelt = (what: string, key: string, near: string) => (e: unknown) => {
    assert.ok(e instanceof ConfigError, String(e));
    assert.ok(e.message.startsWith(`${what}: unknown option "${key}" (did you mean "${near}"?)`), e.message);
    return true;
  };
  // The durability option misspelt: without the check this publisher acknowledged at ack 1.
  const typo = { control: server.control, ackLvel: 2 } as unknown as PublisherOptions;
  await assert.rejects(Publisher.connect(topic, typo), misspelt("Publisher.connect", "ackLvel", "ackLevel"));
  const slow = { control: server.control, slowQueue: { index: 0, msec: 5 } } as unknown as PublisherOptions;
  await assert.rejects(Publisher.connect(topic, slow), (e: unknown) => e instanceof ConfigError && /"msec"/.test(e.message));
  const form = { control: server.control, form: "end" } as unknown as SubscriberOptions;
  await assert.rejects(Subscriber.connect(topic, form), misspelt("Subscriber.connect", "form", "from"));
  const oder = { oder: 0 } as unknown as Parameters<Admin["createTopic"]>[1];
  const notCreated = topicName("typo2");
  await assert.rejects(admin.createTopic(notCreated, oder), misspelt("createTopic", "oder", "order"));
  assert.throws(() => new Admin(server.control, { timeout: 5 } as never), misspelt("Admin", "timeout", "timeoutMs"));
  // A name unlike any option gets the list of options without a guess.
  await assert.rejects(
    Publisher.connect(topic, { control: server.control, zzzzzz: 1 } as unknown as PublisherOptions),
    (e: unknown) => e instanceof ConfigError && !/did you mean/.test(e.message) && /the options are control, /.test(e.message),
  );
  // Nothing was created by the refused calls, and correct options still work.
  assert.throws(() => new StepError("no", { retriable: false } as never), misspelt("StepError", "retriable", "retryable"));
  const worker = { control: server.control, concurency: 4 } as never;
  await assert.rejects(Worker.start(worker), misspelt("Worker.start", "concurency", "concurrency"));
  assert.ok(!(await admin.listTopics()).some((t) => t.name === notCreated));
  const p = await Publisher.connect(topic, { control: server.control, ackLevel: 1, lingerMs: 0 });
  await p.publish("ok");
  await p.close();
});

test("deleteTopic tells a connected subscriber and frees the name", { timeout: 30_000 }, async () => {
  const topic = topicName("deleted");
  await admin.createTopic(topic);
  const p = await Publisher.connect(topic, { control: server.control });
  await p.publish("old");
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  assert.equal((await sub.poll(10_000))?.payload.toString(), "old");
  const deleted = await admin.deleteTopic(topic);
  assert.equal(deleted.name, topic);
  assert.equal(deleted.deleted, true, "marked deleted, as the admin API answers");
  await assert.rejects(sub.poll(10_000), (e: unknown) => {
    assert.ok(e instanceof BrokerError && e.code === "TopicDeleted", String(e));
    return true;
  });
  await assert.rejects(admin.describeTopic(topic), (e: unknown) => {
    assert.ok(e instanceof AdminError && e.status === 404, String(e));
    return true;
  });
  assert.equal((await admin.createTopic(topic)).nextPosition, 0);
});

test("an existing topic, an unknown topic and a bad name", { timeout: 30_000 }, async () => {
  const topic = topicName("dup");
  await admin.createTopic(topic);
  await assert.rejects(admin.createTopic(topic), (e: unknown) => {
    assert.ok(e instanceof AdminError && e.status === 409, String(e));
    return true;
  });
  await assert.rejects(admin.describeTopic("no-such-topic"), (e: unknown) => {
    assert.ok(e instanceof AdminError, String(e));
    assert.equal(e.status, 404);
    assert.match(e.message, /^admin API error \(404\): /);
    return true;
  });
  for (const connect of [
    () => Publisher.connect("no-such-topic", { control: server.control }),
    () => Subscriber.connect("no-such-topic", { control: server.control }),
  ]) {
    await assert.rejects(connect(), (e: unknown) => {
      assert.ok(e instanceof BrokerError, String(e));
      assert.equal(e.kind, "Broker");
      assert.equal(e.code, "UnknownTopic");
      assert.equal(e.codeNumber, 3);
      assert.match(e.message, /^broker .* refused: .*\(UnknownTopic\)$/);
      return true;
    });
  }
  // A position of the wrong form for the topic's order: a ConfigError that says what to
  // give instead (the CLI's words), from connect and from seek alike.
  const perBroker = topicName("o1");
  await admin.createTopic(perBroker, { order: 1 });
  const wrongForm: Array<[string, () => Promise<unknown>, RegExp]> = [
    [topic, () => Subscriber.connect(topic, { control: server.control, from: [3, 0, 0, 0] }), /positions are global; give one position, e\.g\. from: 3$/],
    [perBroker, () => Subscriber.connect(perBroker, { control: server.control, from: 5 }), /positions are per broker; give one position per broker, e\.g\. from: \[5, 5, 5, 5\]$/],
    [perBroker, () => Subscriber.connect(perBroker, { control: server.control, from: [1, 2] }), /from gives 2 positions; topic .* has 4 brokers/],
  ];
  for (const [name, connect, message] of wrongForm) {
    await assert.rejects(connect(), (e: unknown) => {
      assert.ok(e instanceof ConfigError, String(e));
      assert.match(e.message, new RegExp(`topic ${name}|from gives`));
      assert.match(e.message, message);
      return true;
    });
  }
  const ordered = await Subscriber.connect(topic, { control: server.control });
  await assert.rejects(ordered.seek([0, 0, 0, 0]), ConfigError);
  await ordered.close();
  await assert.rejects(admin.createTopic("../status"), (e: unknown) => {
    assert.ok(e instanceof InvalidNameError && e instanceof EmbarcaderoError);
    assert.match(e.message, /1 to 63 letters/);
    return true;
  });
});

test("a message over the maximum, and a closed publisher", { timeout: 30_000 }, async () => {
  const topic = topicName("limits");
  await admin.createTopic(topic, { memoryOnly: true });
  const p = await Publisher.connect(topic, { control: server.control });
  const max = p.maxMessageBytes;
  assert.equal(max, (await admin.cluster()).maxMessageBytes);
  await assert.rejects(p.publish(Buffer.alloc(max + 1)), (e: unknown) => {
    assert.ok(e instanceof MessageTooLargeError, String(e));
    assert.equal(e.size, max + 1);
    assert.equal(e.max, max);
    assert.equal(e.message, `message of ${max + 1} bytes exceeds the broker's maximum of ${max} bytes`);
    return true;
  });
  // All or none: the good message before the large one is not published either.
  await assert.rejects(p.publishMany(["ok", Buffer.alloc(max + 1)]), MessageTooLargeError);
  // Likewise for an array too long to go as arguments (passed whole).
  const long = Array.from({ length: 5_000 }, () => "ok");
  await assert.rejects(p.publishMany([...long, Buffer.alloc(max + 1)]), MessageTooLargeError);
  await p.publish(Buffer.alloc(max)); // exactly the maximum is fine
  // A caller without types passing one string is told what to call instead.
  await assert.rejects(
    p.publishMany("abc" as unknown as string[]),
    (e: unknown) => e instanceof TypeError && /not one string: use publish\(message\)/.test(e.message),
  );
  const stats = await p.close();
  assert.equal(stats.messages, 1);
  assert.deepEqual(await p.close(), stats, "close again: the same result");
  assert.equal(p.stats().messages, 1);
  for (const call of [() => p.publish("late"), () => p.publishMany(["late"]), () => p.flush()]) {
    await assert.rejects(call(), (e: unknown) => {
      assert.ok(e instanceof ClosedError, String(e));
      assert.equal(e.message, "the publisher is closed");
      return true;
    });
  }
  const sub = await Subscriber.connect(topic, { control: server.control });
  await sub.close();
  await assert.rejects(sub.poll(10), ClosedError);
});

test("bad options are refused with a ConfigError", { timeout: 30_000 }, async () => {
  const topic = topicName("opts");
  await admin.createTopic(topic, { memoryOnly: true });
  await assert.rejects(
    Publisher.connect(topic, { control: server.control, ackLevel: 3 as 0 }),
    (e: unknown) => e instanceof ConfigError && /ack level 3 does not exist/.test(e.message),
  );
  await assert.rejects(
    Publisher.connect(topic, { control: server.control, sessionKey: new Uint8Array(3) }),
    (e: unknown) => e instanceof ConfigError && /16 bytes/.test(e.message),
  );
  await assert.rejects(Subscriber.connect(topic, { control: server.control, from: -1 }), ConfigError);
  // A bad topic name is the same error as from Admin, before any request.
  await assert.rejects(Publisher.connect("bad name", { control: server.control }), InvalidNameError);
  await assert.rejects(Subscriber.connect("", { control: server.control }), InvalidNameError);
  // Numbers native code would wrap or truncate are refused by name.
  for (const bad of [{ lingerMs: -5 }, { batchBytes: -1 }, { threadsPerBroker: 1.5 }, { queueDepth: 2 ** 40 }]) {
    const name = Object.keys(bad)[0]!;
    await assert.rejects(
      Publisher.connect(topic, { control: server.control, ...bad }),
      (e: unknown) => e instanceof ConfigError && e.message.startsWith(`${name} `),
      name,
    );
  }
  // None in flight would never send a batch: flush() waited its whole timeout.
  await assert.rejects(
    Publisher.connect(topic, { control: server.control, maxInflightBatches: 0 }),
    (e: unknown) => e instanceof ConfigError && /maxInflightBatches|max_inflight_batches/.test(e.message),
  );
  // Values of the wrong type (from JavaScript, or `as` casts) are refused by name too, not
  // with napi's conversion errors naming Rust types.
  const wrong: Record<string, unknown>[] = [
    { ackLevel: "1" },
    { clientId: "7" },
    { clientId: -1 },
    { sessionEpoch: 1.5 },
    { deflect: "yes" },
    { transport: "udp" },
    { sessionKey: "0123456789abcdef" },
    { flushTimeoutMs: Number.NaN },
    { brokers: "127.0.0.1:1" },
  ];
  for (const bad of wrong) {
    const name = Object.keys(bad)[0]!;
    await assert.rejects(
      Publisher.connect(topic, { control: server.control, ...bad } as PublisherOptions),
      (e: unknown) => e instanceof ConfigError && e.message.startsWith(`${name} `),
      name,
    );
  }
  await assert.rejects(
    Subscriber.connect(topic, { control: server.control, clientId: "x" } as unknown as SubscriberOptions),
    (e: unknown) => e instanceof ConfigError && e.message.startsWith("clientId "),
  );
  // A whole number is as good as a bigint for an id.
  const p = await Publisher.connect(topic, { control: server.control, clientId: 7 as unknown as bigint });
  assert.equal(p.clientId, 7n);
  await assert.rejects(p.publish(42 as unknown as string), TypeError);
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  for (const ms of [-1, Number.NaN]) {
    await assert.rejects(sub.poll(ms), (e: unknown) => e instanceof ConfigError && e.message.startsWith("timeoutMs "));
    await assert.rejects(sub.pollMany(ms), ConfigError);
  }
  await sub.close();
});

test("waiting on the network leaves the event loop free", { timeout: 30_000 }, async () => {
  const topic = topicName("loop");
  await admin.createTopic(topic, { memoryOnly: true });
  const sub = await Subscriber.connect(topic, { control: server.control });
  // An empty topic: the poll waits its whole timeout, on a worker thread. A timer set
  // after it starts fires first, which a poll blocking this thread would not allow.
  const poll = sub.poll(3_000).then(() => "poll");
  const timer = new Promise((r) => setTimeout(r, 1)).then(() => "timer");
  assert.equal(await Promise.race([poll, timer]), "timer");
  assert.equal(await poll, "poll");
  await sub.close();
});

test("a server that is gone: every call rejects, none hangs", { timeout: 60_000 }, async () => {
  const doomed = await Server.serve();
  const a = new Admin(doomed.control, { timeoutMs: 5_000 });
  const topic = topicName("gone");
  await a.createTopic(topic, { memoryOnly: true });
  const p = await Publisher.connect(topic, { control: doomed.control, flushTimeoutMs: 10_000 });
  const sub = await Subscriber.connect(topic, { control: doomed.control, maxReconnects: 2 });
  await p.publish("before");
  await p.flush();
  assert.equal((await sub.poll(10_000))?.text(), "before");
  await doomed.kill();

  await assert.rejects(a.listTopics(), (e: unknown) => {
    assert.ok(e instanceof ConnectError, String(e));
    assert.match(e.message, /is `embarcadero serve` running\?/);
    return true;
  });
  await assert.rejects(async () => {
    // The publisher learns of the loss on its connections: a publish, or at the latest the flush, fails.
    await p.publish("after");
    await p.flush();
  }, EmbarcaderoError);
  await assert.rejects(sub.poll(10_000), EmbarcaderoError);
  await assert.rejects(Publisher.connect(topic, { control: doomed.control }), ConnectError);
  await p.close().catch(() => undefined);
  await sub.close();
  await doomed.stop();
});

test("a subscriber with retryForMs rides out a server restart and continues where it was", { timeout: 90_000 }, async () => {
  // One without gives up while the server is down (it stays down until then), so the
  // first one's tries outlast the default ones.
  const server = await Server.serveOnFixedPorts();
  try {
    const topic = topicName("ride");
    await new Admin(server.control).createTopic(topic, { rf: 1 });
    const p = await Publisher.connect(topic, { control: server.control });
    await p.publish("before");
    await p.close();
    const riding = await Subscriber.connect(topic, { control: server.control, retryForMs: 60_000 });
    const givingUp = await Subscriber.connect(topic, { control: server.control });
    for (const sub of [riding, givingUp]) assert.equal((await sub.poll(10_000))?.text(), "before");
    await server.kill();
    const after = riding.poll(60_000);
    await assert.rejects(givingUp.poll(30_000), EmbarcaderoError);
    await givingUp.close();
    await server.restart();
    const q = await Publisher.connect(topic, { control: server.control });
    await q.publish("after");
    await q.close();
    assert.equal((await after)?.text(), "after", "continued after the first message");
    await riding.close();
  } finally {
    await server.stop();
  }
});

test("await using closes the publisher and the subscriber at the end of the scope", { timeout: 30_000 }, async () => {
  const topic = topicName("using");
  await admin.createTopic(topic, { memoryOnly: true });
  let kept: Publisher;
  let sub: Subscriber;
  {
    await using p = await Publisher.connect(topic, { control: server.control });
    await using s = await Subscriber.connect(topic, { control: server.control });
    await p.publish("scoped");
    kept = p;
    sub = s;
  }
  assert.equal(kept.stats().messages, 1, "closed: the final statistics");
  await assert.rejects(kept.publish("late"), ClosedError);
  await assert.rejects(sub.poll(10), ClosedError);
});

test("close ends an iteration at once and later polls reject, however much was received", { timeout: 30_000 }, async () => {
  // The subscriber holds whole deliveries; close said "iterations end", yet they went on
  // handing out the thousands of messages already received (found by an exploratory run).
  const topic = topicName("closeiter");
  await admin.createTopic(topic, { memoryOnly: true });
  const p = await Publisher.connect(topic, { control: server.control });
  await p.publishMany(Array.from({ length: 5_000 }, (_, i) => `m${i}`));
  await p.close();
  const sub = await Subscriber.connect(topic, { control: server.control });
  let seen = 0;
  let afterClose = 0;
  let closed = false;
  for await (const m of sub) {
    assert.ok(m.payload.length > 0);
    seen += 1;
    if (closed) afterClose += 1;
    if (seen === 10) {
      await sub.close();
      closed = true;
    }
  }
  assert.equal(afterClose, 0, "no message after close");
  await assert.rejects(sub.poll(10), ClosedError);
  await assert.rejects(sub.pollMany(10), ClosedError);
});
