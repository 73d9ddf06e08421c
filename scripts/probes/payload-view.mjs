// Probe (issue 24): the per-message cost of a payload view in the TypeScript subscriber:
// `Buffer.from(arrayBuffer, offset, length)` reading Buffer.buffer/byteOffset for each view
// ("each") or once per delivery ("once"), against constructing a subclass of Uint8Array whose
// prototype chain runs through Buffer.prototype ("subclass": an instance of Buffer to
// `instanceof` and `Buffer.isBuffer`, with every Buffer method, made without `Buffer.from`'s
// checks), and a plain Uint8Array ("uint8", the floor). Usage: node scripts/probes/payload-view.mjs
const deliveries = Array.from({ length: 4 }, () => Buffer.allocUnsafeSlow(1 << 20));
const N = 2_000_000;
class PayloadBuffer extends Uint8Array {
  constructor(buffer, offset, length) {
    super(buffer, offset, length);
  }
}
Object.setPrototypeOf(PayloadBuffer.prototype, Buffer.prototype);
function each() {
  let s = 0;
  for (let i = 0; i < N; i++) {
    const d = deliveries[i & 3];
    s += Buffer.from(d.buffer, d.byteOffset + ((i * 1024) & 0xfffff), 1000).length;
  }
  return s;
}
const bufs = deliveries.map((d) => d.buffer), offs = deliveries.map((d) => d.byteOffset);
function once() {
  let s = 0;
  for (let i = 0; i < N; i++) {
    const k = i & 3;
    s += Buffer.from(bufs[k], offs[k] + ((i * 1024) & 0xfffff), 1000).length;
  }
  return s;
}
function subclass() {
  let s = 0;
  for (let i = 0; i < N; i++) {
    const k = i & 3;
    s += new PayloadBuffer(bufs[k], offs[k] + ((i * 1024) & 0xfffff), 1000).length;
  }
  return s;
}
function uint8() {
  let s = 0;
  for (let i = 0; i < N; i++) {
    const k = i & 3;
    s += new Uint8Array(bufs[k], offs[k] + ((i * 1024) & 0xfffff), 1000).length;
  }
  return s;
}
const v = new PayloadBuffer(bufs[0], 0, 4);
if (!Buffer.isBuffer(v) || !(v instanceof Buffer) || v.toString("hex").length !== 8) throw new Error("not a Buffer");
for (let r = 0; r < 3; r++) {
  for (const [name, f] of [["each", each], ["once", once], ["subclass", subclass], ["uint8", uint8]]) {
    const t = process.hrtime.bigint(); f(); const ns = Number(process.hrtime.bigint() - t) / N;
    console.log(name.padEnd(8), ns.toFixed(1), "ns/message");
  }
}
