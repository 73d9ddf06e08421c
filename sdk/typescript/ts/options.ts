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
