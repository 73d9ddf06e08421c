// Probe (issue 24): does a `pollBatch` reader over a backlog let the event loop turn? A 1 ms
// interval counts its ticks and the longest gap between two while one subscriber reads a
// topic of --mb MiB (published first) by `pollBatch` + `release()`; prints MB/s, ticks and
// the longest gap. Reading what a shared-memory feed holds never waits, so without the
// reader's own turns (`TURN_EVERY_MS` in ts/subscriber.ts) the interval would tick only
// when the feed ran dry. Needs a running server and the built package:
//   node scripts/probes/batch-turns.mjs --control HOST:PORT [--mb 1024] [--reads 3]
import { Admin, Publisher, Subscriber } from "../../sdk/typescript/build/ts/index.js";

const arg = (name, fallback) => {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
};
const control = arg("control", "127.0.0.1:12140");
const count = Math.floor((Number(arg("mb", "1024")) * 1048576) / 1024);
const reads = Number(arg("reads", "3"));
const topic = `turns-${process.pid}`;
await new Admin(control).createTopic(topic, { order: 2, memoryOnly: true });
const p = await Publisher.connect(topic, { control });
const chunk = Array.from({ length: 256 }, (_, i) => Buffer.alloc(1024, i));
for (let sent = 0; sent < count; sent += 256) await p.publishMany(chunk);
await p.close();
for (let r = 0; r < reads; r++) {
  const sub = await Subscriber.connect(topic, { control });
  let ticks = 0;
  let last = performance.now();
  let longest = 0;
  const timer = setInterval(() => {
    const now = performance.now();
    longest = Math.max(longest, now - last);
    last = now;
    ticks++;
  }, 1);
  const start = performance.now();
  let n = 0;
  let bytes = 0;
  while (n < count) {
    const b = await sub.pollBatch(30_000);
    bytes += b.payloadBytes;
    n += b.length;
    b.release();
  }
  const ms = performance.now() - start;
  clearInterval(timer);
  await sub.close();
  const mbs = bytes / ms / 1e3;
  console.log(`read ${r + 1}: ${mbs.toFixed(0)} MB/s in ${ms.toFixed(0)} ms, ${ticks} ticks, longest gap ${longest.toFixed(1)} ms`);
}
