// Probe (issue 24): the per-message cost of a payload view in the TypeScript subscriber, reading
// Buffer.buffer/byteOffset for each view against once per delivery. Usage: node scripts/probes/payload-view.mjs
const deliveries = Array.from({ length: 4 }, () => Buffer.allocUnsafeSlow(1 << 20));
const N = 2_000_000;
function each() {
  let s = 0;
  for (let i = 0; i < N; i++) {
    const d = deliveries[i & 3];
    s += Buffer.from(d.buffer, d.byteOffset + ((i * 1024) & 0xfffff), 1000).length;
  }
  return s;
}
function once() {
  const bufs = deliveries.map((d) => d.buffer), offs = deliveries.map((d) => d.byteOffset);
  let s = 0;
  for (let i = 0; i < N; i++) {
    const k = i & 3;
    s += Buffer.from(bufs[k], offs[k] + ((i * 1024) & 0xfffff), 1000).length;
  }
  return s;
}
for (let r = 0; r < 3; r++) for (const [name, f] of [["each", each], ["once", once]]) {
  const t = process.hrtime.bigint(); f(); const ns = Number(process.hrtime.bigint() - t) / N;
  console.log(name, ns.toFixed(1), "ns/message");
}
