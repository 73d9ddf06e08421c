// Checks of the options and arguments JavaScript hands to the native layer. napi's own
// conversion errors name Rust types ("Failed to convert napi value String into rust type
// u8") and accept what Rust would misread (NaN or a negative number of milliseconds), so
// every value is checked here first, and a bad one is a ConfigError naming the option.
import { ConfigError } from "./errors";

/** Largest value a count option takes (the native side reads a u32). */
const MAX_COUNT = 0xffff_ffff;

function refuse(name: string, v: unknown, want: string): never {
  const shown = typeof v === "string" ? JSON.stringify(v) : String(v);
  throw new ConfigError(`${name} ${shown}: want ${want}`);
}

/** A whole number from `min` to 2^32 - 1, or undefined. */
export function count(name: string, v: unknown, min = 0): number | undefined {
  if (v === undefined) return undefined;
  if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > MAX_COUNT) {
    refuse(name, v, `a whole number from ${min} to ${MAX_COUNT}`);
  }
  return v;
}

/** A finite number of milliseconds, 0 or more, or undefined. */
export function millis(name: string, v: unknown): number | undefined {
  if (v === undefined) return undefined;
  if (typeof v !== "number" || !Number.isFinite(v) || v < 0) {
    refuse(name, v, "a number of milliseconds, 0 or more");
  }
  return v;
}

/** A wait in milliseconds, 0 or more; `Infinity` waits for as long as it takes. */
export function wait(name: string, v: unknown): number | undefined {
  if (v === undefined) return undefined;
  if (typeof v !== "number" || Number.isNaN(v) || v < 0) {
    refuse(name, v, "a number of milliseconds, 0 or more (Infinity: no limit)");
  }
  return v;
}

/**
 * An unsigned 64-bit id as a bigint, or undefined. A whole number that is exactly
 * representable is taken too (`clientId: 7` as well as `7n`).
 */
export function u64(name: string, v: unknown): bigint | undefined {
  if (v === undefined) return undefined;
  const big = typeof v === "number" && Number.isSafeInteger(v) ? BigInt(v) : v;
  if (typeof big !== "bigint" || big < 0n || big > 0xffff_ffff_ffff_ffffn) {
    refuse(name, v, "a bigint from 0 to 2^64 - 1");
  }
  return big;
}

/** A boolean, or undefined. */
export function flag(name: string, v: unknown): boolean | undefined {
  if (v === undefined || typeof v === "boolean") return v;
  refuse(name, v, "true or false");
}

/** One of `allowed`, or undefined. */
export function oneOf<T extends string | number>(name: string, v: unknown, allowed: readonly T[]): T | undefined {
  if (v === undefined) return undefined;
  if (!allowed.includes(v as T)) {
    refuse(name, v, `one of ${allowed.map((a) => JSON.stringify(a)).join(", ")}`);
  }
  return v as T;
}

/** A string, or undefined. */
export function text(name: string, v: unknown): string | undefined {
  if (v === undefined || typeof v === "string") return v;
  refuse(name, v, "a string");
}

/** An array of strings, or undefined. */
export function texts(name: string, v: unknown): string[] | undefined {
  if (v === undefined) return undefined;
  if (!Array.isArray(v) || !v.every((s) => typeof s === "string")) {
    refuse(name, v, "an array of strings");
  }
  return v as string[];
}

/** Bytes (a Uint8Array or Buffer) of exactly `length`, as a Buffer, or undefined. */
export function bytes(name: string, v: unknown, length: number): Buffer | undefined {
  if (v === undefined) return undefined;
  if (!(v instanceof Uint8Array) || v.length !== length) {
    refuse(name, v instanceof Uint8Array ? `${v.length} bytes` : v, `${length} bytes (a Uint8Array or Buffer)`);
  }
  return Buffer.from(v);
}

/**
 * Every option name of an options type, written once: a `Record` over `keyof Required<T>`
 * fails to compile when an option is added to `T` and not here, or named here and not in `T`.
 */
export type OptionNames<T> = Record<keyof Required<T>, true>;

/**
 * Refuses an options object with a key `names` does not list, so that a misspelt option
 * (`ackLvel: 2`) is a ConfigError naming it and the closest known name, never silently
 * ignored. `what` names the call in the message. Not an object (`null`, an array): refused.
 */
export function known<T>(what: string, options: unknown, names: OptionNames<T>): void {
  if (options === undefined) return;
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    refuse(`${what} options`, options, "an object of named options");
  }
  const allowed = Object.keys(names);
  for (const key of Object.keys(options)) {
    if (!Object.hasOwn(names, key)) {
      const near = closest(key, allowed);
      const hint = near === undefined ? "" : ` (did you mean ${JSON.stringify(near)}?)`;
      throw new ConfigError(
        `${what}: unknown option ${JSON.stringify(key)}${hint}; the options are ${allowed.join(", ")}`,
      );
    }
  }
}

/** The name in `names` nearest to `key` (case aside, at most a third of it edited), if any. */
function closest(key: string, names: readonly string[]): string | undefined {
  let best: string | undefined;
  let bestDistance = Math.max(1, Math.floor(key.length / 3)) + 1;
  for (const name of names) {
    const d = editDistance(key.toLowerCase(), name.toLowerCase());
    if (d < bestDistance) [best, bestDistance] = [name, d];
  }
  return best;
}

/**
 * Edit distance counting an insertion, a deletion, a substitution or a swap of two
 * neighbours (`form` for `from`) as one edit (optimal string alignment).
 */
function editDistance(a: string, b: string): number {
  // `rows[i][j]`: the distance from the first i characters of `a` to the first j of `b`.
  const rows = Array.from({ length: a.length + 1 }, (_, i) =>
    Array.from({ length: b.length + 1 }, (_, j) => (i === 0 ? j : j === 0 ? i : 0)),
  );
  const at = (i: number, j: number): number => rows[i]?.[j] ?? 0;
  for (let i = 1; i <= a.length; i++) {
    const row = rows[i] ?? [];
    for (let j = 1; j <= b.length; j++) {
      const same = a[i - 1] === b[j - 1];
      let d = Math.min(at(i - 1, j) + 1, at(i, j - 1) + 1, at(i - 1, j - 1) + (same ? 0 : 1));
      if (i > 1 && j > 1 && a[i - 1] === b[j - 2] && a[i - 2] === b[j - 1]) {
        d = Math.min(d, at(i - 2, j - 2) + 1);
      }
      row[j] = d;
    }
  }
  return at(a.length, b.length);
}
