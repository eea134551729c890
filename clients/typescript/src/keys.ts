/**
 * How keys and request fingerprints are derived from a call's arguments, the same way as the
 * Python client, byte for byte:
 *
 * 1. The arguments are made plain JSON values ({@link toJsonValue}).
 * 2. They are written as **RFC 8785 canonical JSON** ({@link canonicalJson}): object members
 *    sorted by the UTF-16 code units of their names, no whitespace, numbers as ECMAScript
 *    writes them (`1.0` is `1`, `1e21` is `1e+21`), strings with the minimal escapes.
 * 3. The key of a call is `<name>:<version>:<sha256 hex>` of the canonical JSON of
 *    `{"function": name, "version": version, "arguments": arguments}`.
 *
 * The server computes a request's fingerprint the same way: `sha256:` and the hex SHA-256 of
 * its canonical JSON ({@link fingerprint}).
 *
 * @module
 */

const PRINTABLE = /^[\x20-\x7e]+$/;
/** The longest idempotency key the server accepts, in bytes. */
export const MAX_KEY_BYTES = 255;

/** A JSON value as the canonical form knows it. */
export type JsonValue = null | boolean | number | string | JsonValue[] | { [member: string]: JsonValue };

/**
 * The type of a `T` once stored and decoded: what {@link toJsonValue} makes of it, and so what
 * `once` and `guarded` answer every caller, the first included (a `Date` is its ISO string, a
 * `Map` an object, a `Set` an array, bytes their base64, a `bigint` a number; a member whose
 * value may be `undefined` may be missing; a function or a symbol cannot be stored). Give
 * `decode` to get another type back (e.g. a schema's `parse`).
 */
export type JsonOf<T> =
  // `any` stays `any`, `unknown` stays `unknown`: nothing is known of them.
  0 extends 1 & T
    ? any
    : unknown extends T
      ? unknown
      : T extends { toJSON(...args: never[]): infer J }
        ? JsonOf<J>
        : T extends string | number | boolean | null
          ? T
          : T extends bigint
            ? number
            : T extends undefined | void
              ? null
              : T extends ArrayBuffer | ArrayBufferView
                ? string
                : T extends ReadonlyMap<string | number, infer V>
                  ? { [member: string]: JsonOf<Exclude<V, undefined>> }
                  : T extends ReadonlySet<infer V>
                    ? JsonOf<V>[]
                    : T extends readonly unknown[]
                      ? { -readonly [I in keyof T]: JsonOf<T[I]> }
                      : T extends ((...args: never[]) => unknown) | symbol
                        ? never
                        : T extends object
                          ? JsonObject<T>
                          : never;

/** The members of `T` a stored value keeps: not functions or symbols, nor symbol-named ones. */
type StoredKeys<T> = { [K in keyof T]-?: K extends symbol ? never : T[K] extends ((...args: never[]) => unknown) | symbol ? never : K }[keyof T];
/** The members of `T` whose value may be `undefined`: missing once stored. */
type MaybeMissing<T> = { [K in keyof T]-?: undefined extends T[K] ? K : never }[keyof T];
type JsonObject<T> = {
  -readonly [K in Exclude<StoredKeys<T>, MaybeMissing<T>>]: JsonOf<T[K]>;
} & {
  -readonly [K in Extract<StoredKeys<T>, MaybeMissing<T>>]?: JsonOf<Exclude<T[K], undefined>>;
} extends infer O
  ? { [K in keyof O]: O[K] }
  : never;

function isPlainObject(value: object): boolean {
  const proto = Object.getPrototypeOf(value) as unknown;
  return proto === Object.prototype || proto === null;
}

function compareBytes(a: Uint8Array, b: Uint8Array): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    if (a[i] !== b[i]) return (a[i] as number) - (b[i] as number);
  }
  return a.length - b.length;
}

function base64(bytes: Uint8Array): string {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
}

/**
 * `value` as plain JSON values: what the key and the request are made of.
 *
 * Converted as `JSON.stringify` would (a `toJSON()` method is used, so a `Date` becomes its ISO
 * string; an object member whose value is `undefined` is left out, an array element that is
 * `undefined` becomes `null`), and further: a `Map` with string keys becomes an object, a `Set`
 * an array sorted by canonical JSON, bytes (`Uint8Array`, `ArrayBuffer`) their base64, a
 * `bigint` a number when it is exact. Anything else that is not JSON (a function, a symbol, a
 * number that is not finite, an object with a cycle) throws a `TypeError`: give the guard a key
 * (and a request) yourself.
 */
export function toJsonValue(value: unknown): JsonValue {
  return convert(value, new Set<object>());
}

function convert(value: unknown, seen: Set<object>): JsonValue {
  switch (typeof value) {
    case "string":
    case "boolean":
      return value;
    case "number":
      if (!Number.isFinite(value)) throw new TypeError(`${value} is not a JSON number`);
      return value;
    case "bigint":
      if (value > BigInt(Number.MAX_SAFE_INTEGER) || value < -BigInt(Number.MAX_SAFE_INTEGER)) {
        throw new TypeError(`${value} is outside the integers JSON numbers hold exactly (±2^53-1)`);
      }
      return Number(value);
    case "undefined":
      return null;
    case "function":
    case "symbol":
      throw new TypeError(`a ${typeof value} is not JSON: give the guard a key (and request) yourself`);
  }
  if (value === null) return null;
  const object = value as object;
  if (seen.has(object)) throw new TypeError("a value with a cycle is not JSON");
  seen.add(object);
  try {
    const toJSON = (object as { toJSON?: unknown }).toJSON;
    if (typeof toJSON === "function") return convert((toJSON as () => unknown).call(object), seen);
    if (object instanceof Uint8Array) return base64(object);
    if (object instanceof ArrayBuffer) return base64(new Uint8Array(object));
    if (ArrayBuffer.isView(object)) {
      return base64(new Uint8Array(object.buffer, object.byteOffset, object.byteLength));
    }
    if (Array.isArray(object)) return object.map((item: unknown) => convert(item, seen));
    if (object instanceof Map) {
      const out: Record<string, JsonValue> = {};
      for (const [k, v] of object as Map<unknown, unknown>) {
        if (typeof k !== "string" && typeof k !== "number") {
          throw new TypeError(`a map key must be a string to be JSON, not ${typeof k}`);
        }
        if (v !== undefined) out[String(k)] = convert(v, seen);
      }
      return out;
    }
    if (object instanceof Set) {
      const items = [...(object as Set<unknown>)].map((item) => convert(item, seen));
      // Sorted by the UTF-8 bytes of their canonical JSON, as the Python client sorts a set.
      const encoder = new TextEncoder();
      return items
        .map((item) => ({ item, bytes: encoder.encode(canonicalJson(item)) }))
        .sort((a, b) => compareBytes(a.bytes, b.bytes))
        .map(({ item }) => item);
    }
    if (object instanceof Number || object instanceof String || object instanceof Boolean) {
      return convert(object.valueOf(), seen);
    }
    if (!isPlainObject(object) && object instanceof Error) {
      throw new TypeError("an Error is not JSON: give the guard a key (and request) yourself");
    }
    const out: Record<string, JsonValue> = {};
    for (const [k, v] of Object.entries(object)) {
      if (v !== undefined) out[k] = convert(v, seen);
    }
    return out;
  } finally {
    seen.delete(object);
  }
}

function writeString(s: string): string {
  // JSON.stringify escapes exactly as RFC 8785 asks (", \, and the control characters as
  // \b \t \n \f \r or \u00xx in lower case), except that it writes a lone surrogate as an
  // escape; such a string has no UTF-8 form, so it is refused.
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdfff) {
      const next = s.charCodeAt(i + 1);
      if (c <= 0xdbff && next >= 0xdc00 && next <= 0xdfff) {
        i++;
        continue;
      }
      throw new TypeError("a string with a lone surrogate has no UTF-8 form and is not canonical JSON");
    }
  }
  return JSON.stringify(s);
}

function write(value: JsonValue): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "boolean":
      return value ? "true" : "false";
    case "number":
      // ECMAScript's Number-to-string is the one RFC 8785 prescribes; JSON.stringify uses it
      // and writes -0 as 0.
      if (!Number.isFinite(value)) throw new TypeError(`${value} is not a JSON number`);
      return JSON.stringify(value);
    case "string":
      return writeString(value);
  }
  if (Array.isArray(value)) return "[" + value.map(write).join(",") + "]";
  // Members sorted by the UTF-16 code units of their names: what the default sort compares.
  const names = Object.keys(value).sort();
  return "{" + names.map((name) => writeString(name) + ":" + write(value[name] as JsonValue)).join(",") + "}";
}

/** The RFC 8785 canonical JSON text of `value` (made {@link toJsonValue} first). */
export function canonicalJson(value: unknown): string {
  return write(toJsonValue(value));
}

const HEX = Array.from({ length: 256 }, (_, i) => i.toString(16).padStart(2, "0"));

/** A synchronous hex SHA-256 of a text's UTF-8 bytes. */
type Sha256 = (text: string) => string;

let nodeSha256: Sha256 | null | undefined;
let loadingSha256: Promise<Sha256 | null> | undefined;

/**
 * `node:crypto`'s SHA-256 where the runtime has it (Node, Bun, Deno), else `null`; loaded once.
 * It hashes a key's few hundred bytes in about a microsecond on the calling thread, where Web
 * Crypto's `digest` hands each one to a worker thread and back: about 100 µs a call on a busy
 * 2-core machine, most of a replay's work in the client.
 */
function loadNodeSha256(): Promise<Sha256 | null> {
  loadingSha256 ??= (async (): Promise<Sha256 | null> => {
    type NodeCrypto = { createHash(algorithm: "sha256"): { update(text: string, encoding: "utf8"): { digest(encoding: "hex"): string } } };
    const specifier = "node:crypto";
    try {
      const { createHash } = (await import(specifier)) as NodeCrypto;
      nodeSha256 = typeof createHash === "function" ? (text) => createHash("sha256").update(text, "utf8").digest("hex") : null;
    } catch {
      nodeSha256 = null;
    }
    return nodeSha256;
  })();
  return loadingSha256;
}

/**
 * The hex SHA-256 of the UTF-8 bytes of `text`: `node:crypto`'s where the runtime has it, else
 * Web Crypto's (every runtime has that). A string with a lone surrogate has no UTF-8 form: the
 * canonical JSON refuses it before it is hashed.
 */
export async function sha256Hex(text: string): Promise<string> {
  const hash = nodeSha256 === undefined ? await loadNodeSha256() : nodeSha256;
  if (hash !== null) return hash(text);
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text)));
  let out = "";
  for (const byte of digest) out += HEX[byte];
  return out;
}

/** The hex SHA-256 of the canonical JSON of `value`. */
export async function digest(value: unknown): Promise<string> {
  return sha256Hex(canonicalJson(value));
}

/** The fingerprint the server computes for a claim's `request`: `sha256:<hex>`. */
export async function fingerprint(request: unknown): Promise<string> {
  return "sha256:" + (await digest(request));
}

/** `key` if it is a valid idempotency key (1 to 255 bytes of printable ASCII), else throws. */
export function checkKey(key: string): string {
  if (typeof key !== "string" || !PRINTABLE.test(key) || key.length > MAX_KEY_BYTES) {
    throw new RangeError(`an idempotency key is 1 to 255 bytes of printable ASCII, not ${JSON.stringify(key)}`);
  }
  return key;
}

/** `name` if it is a valid compensation name (1 to 128 printable ASCII characters), else throws. */
export function checkCompensationName(name: string): string {
  if (typeof name !== "string" || !PRINTABLE.test(name) || name.length > 128) {
    throw new RangeError(`a compensation's name is 1 to 128 printable ASCII characters, not ${JSON.stringify(name)}`);
  }
  return name;
}

/** `label` (a function name or a version) if it can stand in a key: printable ASCII, no ':'. */
export function checkLabel(what: string, label: string, maxLength: number): string {
  if (typeof label !== "string" || !PRINTABLE.test(label) || label.includes(":") || label.length > maxLength) {
    throw new RangeError(
      `${what} must be 1 to ${maxLength} printable ASCII characters without ':', not ${JSON.stringify(label)}`,
    );
  }
  return label;
}

/**
 * The key of a call: `<name>:<version>:<sha256 of the canonical call>`, where the call is
 * `{"function": name, "version": version, "arguments": arguments}`. The same as the Python
 * client's `derive_key(name, version, arguments)` for the same JSON arguments.
 */
export async function deriveKey(name: string, version: string, args: unknown): Promise<string> {
  checkLabel("name", name, 128);
  checkLabel("version", version, 32);
  return `${name}:${version}:${await digest({ function: name, version, arguments: args })}`;
}

/** A tool call as a key function sees it (the framework helpers). */
export interface ToolCall {
  /** The tool's name. */
  readonly tool: string;
  /** The call's arguments, as JSON values. */
  readonly arguments: JsonValue;
  /** The run (conversation, thread) the call belongs to; `null` if none was given. */
  readonly run: string | null;
  /** The framework's id of this call, when it has one: it differs between repeats of a call. */
  readonly callId?: string | undefined;
}

const TOOL_NAME = /^[\x21-\x39\x3b-\x7e]{1,128}$/;

/**
 * The default key of a tool call: `<tool>:<sha256 of the canonical {"run", "tool",
 * "arguments"}>`: the same tool called with the same arguments in the same run is one effect,
 * whichever call id the model gave it. The same as the Python client's.
 */
export async function toolKey(call: ToolCall): Promise<string> {
  const prefix = TOOL_NAME.test(call.tool) ? call.tool : "tool";
  return `${prefix}:${await digest({ run: call.run, tool: call.tool, arguments: call.arguments })}`;
}
