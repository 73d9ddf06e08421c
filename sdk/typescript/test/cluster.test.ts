// Cluster mode (a head and follower brokers, each its own process; docs/CLUSTER.md): a
// follower is SIGKILLed while a publisher is publishing through it, and every message is
// still delivered exactly once, through the Rust client's failover.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Admin, Publisher, Subscriber } from "../ts/index";
import { Server, topicName } from "./servers";

const COUNT = 60_000;

test("a follower SIGKILLed under load: every message delivered exactly once", { timeout: 120_000 }, async () => {
  const head = await Server.head(3);
  const followers = [await head.follower(1), await head.follower(2)];
  try {
    const admin = new Admin(head.control);
    const topic = topicName("failover");
    await admin.createTopic(topic, { order: 2, memoryOnly: true });
    const victim = (await admin.cluster()).brokers.find((b) => b.id === 2)!.addr;
    const p = await Publisher.connect(topic, { control: head.control, batchBytes: 8192 });
    const payload = Buffer.alloc(100, 7);
    let killed: Promise<void> | undefined;
    for (let id = 0; id < COUNT; id++) {
      payload.writeUInt32LE(id, 0);
      await p.publish(payload);
      // The kill (sent at once, synchronously) lands in the middle of the stream: the
      // publisher's threads are still sending the first third, some of it to broker 2.
      if (id === Math.floor(COUNT / 3)) killed = followers[1]!.end("SIGKILL");
    }
    await killed;
    const stats = await p.close();
    assert.equal(stats.messages, COUNT);
    assert.ok(stats.queues.some((q) => q.broker === victim && q.batches > 0), "broker 2 was published to");

    const sub = await Subscriber.connect(topic, { control: head.control });
    const seen = new Set<number>();
    for await (const m of sub) {
      const id = m.payload.readUInt32LE(0);
      assert.ok(!seen.has(id), `message ${id} delivered twice`);
      seen.add(id);
      if (seen.size === COUNT) break;
    }
    await sub.close();
    // Nothing more was ordered than the messages published: no duplicate past the last one either.
    assert.equal((await admin.describeTopic(topic)).nextPosition, COUNT);
  } finally {
    await Promise.all(followers.map((f) => f.end("SIGKILL")));
    await head.stop();
  }
});
