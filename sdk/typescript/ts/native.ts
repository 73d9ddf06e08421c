// Loads the native addon built by `napi build` (native/embarcadero.node) with the types
// napi-rs generated for it (native/native.d.ts). Only this library's modules use it.
import type * as Native from "../native/native";

// eslint-disable-next-line @typescript-eslint/no-require-imports
export const native: typeof Native = require("../../native/embarcadero.node") as typeof Native;
export type { Native };

// `await using` needs `Symbol.asyncDispose`: Node has it from 18.18 and 20.4; before that,
// the name TypeScript's own helper falls back to.
(Symbol as { asyncDispose?: symbol }).asyncDispose ??= Symbol.for("Symbol.asyncDispose");
