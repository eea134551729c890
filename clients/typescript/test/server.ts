/**
 * The tests' server: a real `onceguard serve` on a free 127.0.0.1 port, in a temporary working
 * directory, where it writes its admin key (`onceguard-data/admin.key`); tests use an agent key
 * created through the API, and the admin key where a call needs it.
 *
 * The binary is `$ONCEGUARD_BIN`, else `$CARGO_TARGET_DIR/debug/onceguard`, else
 * `<repo>/target/debug/onceguard`.
 */

import { spawn, type ChildProcess } from "node:child_process";
import { closeSync, existsSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before } from "node:test";
import assert from "node:assert/strict";
import { Client, type Acquired, type ClaimAnswer, type Replay } from "onceguard";

/** The repository (this file runs as clients/typescript/dist/test/server.js). */
export const REPO = resolve(fileURLToPath(new URL(".", import.meta.url)), "../../../..");

/** The onceguard binary to test, or an error that says how to build it. */
export function findBinary(): string {
  const explicit = process.env["ONCEGUARD_BIN"];
  if (explicit) {
    if (!existsSync(explicit)) throw new Error(`ONCEGUARD_BIN=${explicit} does not exist; run \`cargo build -p onceguard\``);
    return explicit;
  }
  const candidates: string[] = [];
  if (process.env["CARGO_TARGET_DIR"]) candidates.push(join(process.env["CARGO_TARGET_DIR"], "debug", "onceguard"));
  candidates.push(join(REPO, "target", "debug", "onceguard"));
  const found = candidates.find((path) => existsSync(path));
  if (found === undefined) {
    throw new Error(`no onceguard binary at ${candidates.join(" or ")}: run \`cargo build -p onceguard\` (or set ONCEGUARD_BIN)`);
  }
  return found;
}

/** A free TCP port on 127.0.0.1. */
export function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      server.close(() => (typeof address === "object" && address ? resolvePort(address.port) : reject(new Error("no port"))));
    });
  });
}

/** One `onceguard serve` process on 127.0.0.1 in its own working directory. */
export class Server {
  readonly workdir = mkdtempSync(join(tmpdir(), "onceguard-ts-"));
  port = 0;
  #proc: ChildProcess | undefined;

  constructor(
    readonly binary: string = findBinary(),
    readonly store = "memory://",
  ) {}

  get url(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  get adminKey(): string {
    return readFileSync(join(this.workdir, "onceguard-data", "admin.key"), "utf8").trim();
  }

  async start(timeoutSeconds = 20): Promise<void> {
    this.port ||= await freePort();
    const env = Object.fromEntries(Object.entries(process.env).filter(([name]) => !name.startsWith("ONCEGUARD_")));
    const log = openSync(join(this.workdir, "serve.log"), "a");
    const proc = spawn(this.binary, ["serve", "--store", this.store, "--listen", `127.0.0.1:${this.port}`, "--log-format", "json"], {
      cwd: this.workdir,
      env,
      stdio: ["ignore", log, log],
    });
    closeSync(log);
    this.#proc = proc;
    let exited = false;
    proc.once("exit", () => (exited = true));
    const deadline = Date.now() + timeoutSeconds * 1000;
    while (Date.now() < deadline) {
      if (exited) throw new Error(`onceguard serve exited with ${proc.exitCode}:\n${this.logTail()}`);
      try {
        if ((await fetch(`${this.url}/readyz`, { signal: AbortSignal.timeout(1000) })).status === 200) return;
      } catch {
        // not listening yet
      }
      await new Promise((r) => setTimeout(r, 50));
    }
    await this.stop();
    throw new Error(`onceguard serve was not ready within ${timeoutSeconds}s:\n${this.logTail()}`);
  }

  /**
   * Pause the process (SIGSTOP): it accepts connections but answers nothing. Returns once every
   * thread of it is stopped: one thread takes the signal and stops the others when it next runs,
   * after the signal is sent, and until then they go on answering.
   */
  async pause(): Promise<void> {
    const pid = this.#proc?.pid;
    if (pid === undefined) throw new Error("the server is not running");
    this.#proc?.kill("SIGSTOP");
    const tasks = `/proc/${pid}/task`;
    if (!existsSync(tasks)) {
      await new Promise((r) => setTimeout(r, 100)); // no /proc here: a short wait in its place
      return;
    }
    for (let i = 0; i < 1000; i++) {
      if (readdirSync(tasks).every((tid) => threadStopped(join(tasks, tid, "stat")))) return;
      await new Promise((r) => setTimeout(r, 5));
    }
    throw new Error("the server did not stop within 5 s of SIGSTOP");
  }

  resume(): void {
    this.#proc?.kill("SIGCONT");
  }

  async stop(): Promise<void> {
    const proc = this.#proc;
    this.#proc = undefined;
    if (proc === undefined || proc.exitCode !== null || proc.signalCode !== null) return;
    const exited = new Promise<void>((r) => proc.once("exit", () => r()));
    proc.kill("SIGCONT");
    proc.kill("SIGTERM");
    const timer = setTimeout(() => proc.kill("SIGKILL"), 10_000);
    await exited;
    clearTimeout(timer);
  }

  logTail(lines = 30): string {
    try {
      return readFileSync(join(this.workdir, "serve.log"), "utf8").split("\n").slice(-lines).join("\n");
    } catch {
      return "";
    }
  }

  async cleanup(): Promise<void> {
    await this.stop();
    rmSync(this.workdir, { recursive: true, force: true });
  }
}

/** What a test file gets: the server, an admin client and an agent client. */
export interface Fixture {
  readonly server: Server;
  readonly admin: Client;
  readonly client: Client;
  readonly agentKey: string;
}

/**
 * Start a server for this test file (before its tests, stopped after them); the fixture is
 * filled in once it runs.
 */
export function useServer(): Fixture {
  const fixture = {} as { server: Server; admin: Client; client: Client; agentKey: string };
  before(async () => {
    fixture.server = new Server();
    await fixture.server.start();
    fixture.admin = new Client({ baseUrl: fixture.server.url, apiKey: fixture.server.adminKey });
    const key = await fixture.admin.createApiKey("agent", { label: "typescript-client-tests" });
    if (!key.token) throw new Error("the created API key has no token");
    fixture.agentKey = key.token;
    fixture.client = new Client({ baseUrl: fixture.server.url, apiKey: key.token });
  });
  after(async () => {
    await fixture.server?.cleanup();
  });
  return fixture;
}

let counter = 0;

/** A namespace of this test's own. */
export function ns(name: string): string {
  counter += 1;
  const slug = name.replace(/[^A-Za-z0-9._-]+/g, "-").slice(0, 40).replace(/^-+|-+$/g, "");
  return `ts/${slug}-${process.pid}-${counter}-${Math.random().toString(36).slice(2, 8)}`;
}

/** A promise with its resolve, to hold a function until the test lets it go. */
export function gate<T = void>(): { promise: Promise<T>; open: (value: T) => void } {
  let open!: (value: T) => void;
  const promise = new Promise<T>((r) => (open = r));
  return { promise, open };
}

/** `answer`, asserted to be `acquired`. */
export function acquired(answer: ClaimAnswer): Acquired {
  assert.equal(answer.outcome, "acquired", JSON.stringify(answer));
  return answer as Acquired;
}

/** `answer`, asserted to be a `replay`. */
export function replay(answer: ClaimAnswer): Replay {
  assert.equal(answer.outcome, "replay", JSON.stringify(answer));
  return answer as Replay;
}

/** Whether the thread of this `/proc/<pid>/task/<tid>/stat` is stopped (or gone: exited, a zombie, dead). */
function threadStopped(stat: string): boolean {
  let text: string;
  try {
    text = readFileSync(stat, "utf8");
  } catch {
    return true; // the thread has exited
  }
  const end = text.lastIndexOf(")");
  return end < 0 || ["T", "t", "Z", "X", ""].includes(text.slice(end + 2, end + 3));
}
