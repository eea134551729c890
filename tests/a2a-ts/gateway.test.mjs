// End-to-end tests of `onceguard a2a` with the official A2A JavaScript SDK (@a2a-js/sdk 1.x,
// A2A v1.0): its client (ClientFactory, the JSON-RPC transport) through the gateway to an agent
// made with its server parts (agent.mjs), and the TypeScript client's `onceguard/a2a` helper.
// Run by scripts/a2a-tests, which installs the pinned packages, builds the TypeScript client
// (dist/, which `onceguard` links to) and the binary ($ONCEGUARD_BIN, or
// $CARGO_TARGET_DIR/debug/onceguard).
//
// The agent appends a line to an effects file for every execution of its executor, so every test
// checks how often the agent really ran, whatever the clients were told. Two agent API keys of one
// tenant are two callers.
//
// What the SDK does that these tests rely on: it speaks v1.0 (`SendMessage`, `GetTask`, …, not
// the v0.3 `message/send`) and sends `A2A-Version: 1.0` on every call; a call's
// `serviceParameters` are that request's HTTP headers (the API key goes in a `fetchImpl` of the
// transport instead, as it goes on every request); a JSON-RPC error is thrown as an error whose
// `envelopeCode` is the code and `data` the error's data (a known A2A code as its own class,
// e.g. `TaskNotFoundError` for -32001, any other as `JsonRpcTransportError`).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { randomUUID } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import { Role, TaskState } from '@a2a-js/sdk';
import { ClientFactory, ClientFactoryOptions, DefaultAgentCardResolver, JsonRpcTransportFactory } from '@a2a-js/sdk/client';
import { a2aKey, guardA2A, replayed } from 'onceguard/a2a';
import { startAgent, textPart } from './agent.mjs';

const here = path.dirname(new URL(import.meta.url).pathname);
const target = process.env.CARGO_TARGET_DIR ?? path.join(here, '..', '..', 'target');
const binary = process.env.ONCEGUARD_BIN ?? path.join(target, 'debug', 'onceguard');
const UPSTREAM_NAME = 'agent';
const TENANT = 'acme';

const { TASK_STATE_COMPLETED: COMPLETED, TASK_STATE_CANCELED: CANCELED, TASK_STATE_INPUT_REQUIRED: INPUT_REQUIRED } = TaskState;
const TERMINAL = [COMPLETED, CANCELED, TaskState.TASK_STATE_FAILED, TaskState.TASK_STATE_REJECTED];

let dir, effects, agent, store, token, otherToken, gateway;
const gateways = [];

function onceguard(store, ...args) {
  return execFileSync(binary, ['--log-format', 'json', '--store', store, ...args], { encoding: 'utf8' });
}

function createKey(store, label) {
  return JSON.parse(onceguard(store, 'api-keys', 'create', '--tenant', TENANT, '--role', 'agent', '--label', label)).token;
}

/** A gateway process on `store` in front of the agent (lease 5 s, duplicates waiting 10 s); its
 * `url` is where it logged it listens, with the JSON-RPC endpoint's path `/`. */
async function startGateway(store) {
  const child = spawn(binary, ['--log-format', 'json', '--store', store, 'a2a', '--listen', '127.0.0.1:0',
    '--upstream', agent.url, '--upstream-name', UPSTREAM_NAME, '--lease', '5s', '--wait', '10s'],
  { cwd: dir, stdio: ['ignore', 'ignore', 'pipe'] });
  gateways.push(child);
  const logs = [];
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`the gateway did not start:\n${logs.join('\n')}`)), 60_000);
    let rest = '';
    // Read to the end (a full pipe would stall the gateway); keep the last lines to tell a failure.
    child.stderr.on('data', (chunk) => {
      const lines = (rest + chunk).split('\n');
      rest = lines.pop();
      for (const line of lines) {
        logs.push(line);
        if (logs.length > 200) logs.shift();
        try {
          const { addr } = JSON.parse(line);
          if (addr) {
            clearTimeout(timer);
            resolve(`http://${addr}/`);
          }
        } catch {}
      }
    });
    child.once('exit', (code) => reject(new Error(`the gateway exited (${code}):\n${logs.join('\n')}`)));
  });
  return {
    url,
    stop: () => new Promise((resolve) => {
      if (child.exitCode !== null) return resolve();
      child.once('exit', resolve);
      child.kill('SIGTERM');
    }),
  };
}

before(async () => {
  assert.ok(existsSync(binary), `no onceguard binary at ${binary}: build it (cargo build -p onceguard) or set ONCEGUARD_BIN`);
  dir = mkdtempSync(path.join(os.tmpdir(), 'onceguard-a2a-ts-'));
  effects = path.join(dir, 'effects.log');
  agent = await startAgent({ effects });
  store = `sqlite://${dir}/onceguard.db`;
  onceguard(store, 'tenants', 'create', TENANT);
  token = createKey(store, 'ts caller one');
  otherToken = createKey(store, 'ts caller two');
  gateway = await startGateway(store);
});

after(async () => {
  for (const child of gateways) child.kill('SIGKILL');
  await agent?.close();
  rmSync(dir, { recursive: true, force: true });
});

/** The agent's log rows with these fields (executions and cancels). */
function rows(match) {
  if (!existsSync(effects)) return [];
  return readFileSync(effects, 'utf8').split('\n').filter(Boolean).map((line) => JSON.parse(line))
    .filter((row) => Object.entries(match).every(([k, v]) => row[k] === v));
}

/** How often the agent's executor ran for messages with these fields (cancels left out). */
function executions(match) {
  return rows(match).filter((row) => row.step !== 'cancel').length;
}

const unique = (prefix) => `${prefix}-${randomUUID().slice(0, 12)}`;

/** A user's message of one text part (the SDK's types want every field; empty is unset). */
function message(text, messageId, { taskId = '', contextId = '' } = {}) {
  return { messageId, contextId, taskId, role: Role.ROLE_USER, parts: [textPart(text)], metadata: undefined, extensions: [], referenceTaskIds: [] };
}

function request(msg, { returnImmediately = false } = {}) {
  return { tenant: '', message: msg, configuration: { acceptedOutputModes: [], taskPushNotificationConfig: undefined, returnImmediately }, metadata: undefined };
}

/** An SDK client of the agent card served at `url` (a gateway), speaking JSON-RPC with the
 * caller's API key on every request (a `fetchImpl` that adds the header). */
async function connect({ key = token, url = gateway.url } = {}) {
  const card = await new DefaultAgentCardResolver().resolve(url);
  const jsonrpc = card.supportedInterfaces.filter((i) => i.protocolBinding === 'JSONRPC').map((i) => i.url);
  assert.deepEqual(jsonrpc, [url], `the card served at ${url} sends clients to ${jsonrpc}, not through the gateway`);
  const fetchImpl = (input, init = {}) => fetch(input, { ...init, headers: { ...init.headers, 'x-onceguard-key': key } });
  const options = ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new JsonRpcTransportFactory({ fetchImpl })],
    preferredTransports: ['JSONRPC'],
  });
  return new ClientFactory(options).createFromAgentCard(card);
}

/** A SendMessage's answer, with the call's options (`serviceParameters`, `signal`). */
const send = (client, msg, { returnImmediately, ...options } = {}) => client.sendMessage(request(msg, { returnImmediately }), options);

async function collect(events) {
  const out = [];
  for await (const event of events) out.push(event);
  return out;
}

/** The JSON-RPC error code the SDK's client error carries (on the error, or its cause for an
 * error event of a stream). */
const codeOf = (error) => error?.envelopeCode ?? error?.cause?.envelopeCode;

/** `promise`'s rejection (the test fails if it resolves). */
async function refusal(promise) {
  try {
    const value = await promise;
    assert.fail(`expected a refusal, got ${JSON.stringify(value)}`);
  } catch (error) {
    if (error instanceof assert.AssertionError) throw error;
    return error;
  }
}

const texts = (parts) => parts.map((p) => p.content?.value);
const artifactTexts = (task) => task.artifacts.flatMap((a) => texts(a.parts));
const eventTaskId = (event) => {
  const { $case, value } = event.payload;
  return $case === 'task' ? value.id : value.taskId;
};
const lastState = (events) => events.map((e) => e.payload.value.status?.state).filter((s) => s !== undefined).at(-1);

test('without the gateway, the same message sent twice runs twice (the scenario is real)', async (t) => {
  const client = await new ClientFactory().createFromUrl(agent.url);
  const text = `echo ${unique('a0')}`;
  const mid = unique('msg');
  await send(client, message(text, mid));
  await send(client, message(text, mid));
  t.diagnostic(`executions: ${executions({ text })}`);
  assert.equal(executions({ text }), 2);
});

test('a duplicate send executes once and replays the task, marked replayed', async (t) => {
  const client = await connect();
  const text = `task ${unique('a')}`;
  const mid = unique('msg');
  const first = await send(client, message(text, mid));
  const second = await send(client, message(text, mid));
  assert.equal(first.status.state, COMPLETED, JSON.stringify(first));
  assert.equal(replayed(first), false);
  assert.equal(second.id, first.id, 'the same task');
  assert.equal(second.metadata?.['dev.onceguard/replayed'], true, JSON.stringify(second.metadata));
  assert.equal(second.status.state, COMPLETED);
  assert.deepEqual(artifactTexts(second), artifactTexts(first));
  assert.deepEqual(artifactTexts(first), [`done ${text.split(' ')[1]}`]);
  assert.equal(executions({ text }), 1);

  // Eight concurrent duplicates, then one more: one task, one execution.
  const burstText = `task ${unique('a8')}`;
  const burstMid = unique('msg');
  const burst = await Promise.all(Array.from({ length: 8 }, () => send(client, message(burstText, burstMid))));
  const again = await send(client, message(burstText, burstMid));
  assert.deepEqual(new Set(burst.map((b) => b.id)), new Set([again.id]), 'eight concurrent duplicates answered one task');
  assert.ok(replayed(again) && again.status.state === COMPLETED);
  assert.equal(executions({ text: burstText }), 1);
  t.diagnostic(`executions: 2 sends ${executions({ text })}; 9 sends ${executions({ text: burstText })}`);
});

test('a send whose connection is cut after it left, sent again with the same messageId, executes once', async (t) => {
  const client = await connect();
  const text = `task ${unique('b')}`;
  const mid = unique('msg');
  const cut = new AbortController();
  const first = send(client, message(text, mid), { signal: cut.signal });
  // The request reached the agent: cut the connection before the answer comes (the task works 200 ms).
  for (let i = 0; i < 300 && executions({ text }) === 0; i++) await sleep(5);
  assert.equal(executions({ text }), 1, 'the first send reached the agent');
  cut.abort();
  const lost = await refusal(first);
  assert.equal(lost.name, 'AbortError', String(lost));
  const retry = await send(client, message(text, mid));
  assert.equal(retry.status.state, COMPLETED, JSON.stringify(retry));
  assert.deepEqual(artifactTexts(retry), [`done ${text.split(' ')[1]}`]);
  assert.equal(replayed(retry), true, 'the retry got the first send\'s task');
  const later = await send(client, message(text, mid));
  assert.equal(later.id, retry.id);
  t.diagnostic(`executions: ${executions({ text })}`);
  assert.equal(executions({ text }), 1, 'the agent ran once');
});

test('a duplicate stream attaches to the running task: one execution', async (t) => {
  const client = await connect();
  const text = `slow ${unique('c')}`;
  const mid = unique('msg');
  const first = client.sendMessageStream(request(message(text, mid)));
  const head = (await first.next()).value;
  const taskId = eventTaskId(head);
  assert.ok(taskId, JSON.stringify(head));
  const rest = collect(first);
  const during = await collect(client.sendMessageStream(request(message(text, mid))));
  const firstEvents = [head, ...(await rest)];
  const afterEnd = await collect(client.sendMessageStream(request(message(text, mid))));
  for (const [name, events] of [['first', firstEvents], ['during', during], ['after', afterEnd]]) {
    t.diagnostic(`${name}: ${events.map((e) => `${e.payload.$case}${e.payload.value.status ? `(${e.payload.value.status.state})` : ''}`).join(' ')}`);
    assert.deepEqual(new Set(events.map(eventTaskId)), new Set([taskId]), `${name}: ${JSON.stringify(events)}`);
    assert.equal(lastState(events), COMPLETED, name);
  }
  assert.ok(!firstEvents.some(replayed));
  assert.ok(afterEnd.some(replayed), 'the stream after the end is the stored task, marked');
  t.diagnostic(`executions: ${executions({ text })}`);
  assert.equal(executions({ text }), 1);
});

test('an input-required continuation sent twice advances the task once', async (t) => {
  const client = await connect();
  const word = unique('d');
  const text = `ask ${word}`;
  const mid = unique('msg');
  const first = await send(client, message(text, mid));
  assert.equal(first.status.state, INPUT_REQUIRED, JSON.stringify(first));
  assert.deepEqual(texts(first.status.message.parts), [`more for ${word}?`]);
  const reply = `yes ${unique('d')}`;
  const replyMid = unique('msg');
  const continuation = () => send(client, message(reply, replyMid, { taskId: first.id, contextId: first.contextId }));
  const cont1 = await continuation();
  const cont2 = await continuation();
  for (const answer of [cont1, cont2]) {
    assert.equal(answer.id, first.id);
    assert.equal(answer.status.state, COMPLETED, JSON.stringify(answer.status));
  }
  assert.equal(replayed(cont1), false);
  assert.equal(replayed(cont2), true);
  const again = await send(client, message(text, mid));
  assert.ok(again.id === first.id && replayed(again), 'the first send replays too, with the task as it ended');
  assert.equal(again.status.state, COMPLETED);
  t.diagnostic(`executions: start ${executions({ task: first.id, step: 'start' })}, continue ${executions({ task: first.id, step: 'continue' })}`);
  assert.equal(executions({ task: first.id, step: 'start' }), 1);
  assert.equal(executions({ task: first.id, step: 'continue' }), 1);
});

test("another caller's GetTask and CancelTask are refused as task not found (-32001); its own send runs", async (t) => {
  const mine = await connect();
  const theirs = await connect({ key: otherToken });
  const text = `task ${unique('e')}`;
  const mid = unique('msg');
  const myTask = await send(mine, message(text, mid));
  const hidden = await refusal(theirs.getTask({ tenant: '', id: myTask.id }));
  assert.equal(codeOf(hidden), -32001, String(hidden));
  assert.equal(hidden.name, 'TaskNotFoundError');
  const notCanceled = await refusal(theirs.cancelTask({ tenant: '', id: myTask.id, metadata: undefined }));
  assert.equal(codeOf(notCanceled), -32001, String(notCanceled));
  assert.equal((await mine.getTask({ tenant: '', id: myTask.id })).status.state, COMPLETED, 'the owner reads it');
  const theirTask = await send(theirs, message(text, mid));
  assert.notEqual(theirTask.id, myTask.id, "the same messageId from another caller is that caller's own send");
  assert.equal(replayed(theirTask), false);
  t.diagnostic(`executions: ${executions({ text })} (one per caller)`);
  assert.equal(executions({ text }), 2);
});

test('a cancel racing completion never runs the task twice, and the replay agrees with the task', async (t) => {
  const client = await connect();
  const outcomes = [];
  for (const delay of [0, 150, 190, 200, 210, 250]) {
    const text = `task ${unique('f')}`;
    const mid = unique('msg');
    const first = await send(client, message(text, mid), { returnImmediately: true });
    await sleep(delay);
    const cancel = await client.cancelTask({ tenant: '', id: first.id, metadata: undefined }).catch((error) => error);
    const got = await client.getTask({ tenant: '', id: first.id });
    const again = await send(client, message(text, mid));
    assert.equal(again.id, first.id);
    assert.ok(TERMINAL.includes(again.status.state), JSON.stringify(again.status));
    assert.equal(again.status.state, got.status.state, 'the replay is the task as it ended');
    assert.equal(replayed(again), true);
    if (cancel instanceof Error) {
      assert.equal(codeOf(cancel), -32002, `a refused cancel is task not cancelable: ${cancel}`);
      assert.equal(again.status.state, COMPLETED);
    } else {
      assert.equal(cancel.status.state, CANCELED);
    }
    const ran = executions({ text });
    assert.equal(ran, 1, 'never a second execution');
    outcomes.push(`${delay} ms: ${ran} execution, cancel ${cancel instanceof Error ? `refused (${codeOf(cancel)})` : 'canceled'}, replay ${again.status.state === CANCELED ? 'canceled' : 'completed'}`);
  }
  t.diagnostic(`cancel racing completion: ${outcomes.join('; ')}`);
});

test('a kill switch refuses new sends with 42301 and forwards nothing', async (t) => {
  const client = await connect();
  const namespace = `a2a/${UPSTREAM_NAME}`;
  let refusedText;
  let refused;
  onceguard(store, 'switch', 'engage', '--tenant', TENANT, '--namespace', namespace, '--reason', 'e2e');
  try {
    const deadline = Date.now() + 3_000;
    while (refused === undefined) {
      const text = `echo ${unique('g')}`;
      try {
        await send(client, message(text, unique('msg')));
      } catch (error) {
        refused = error;
        refusedText = text;
        break;
      }
      assert.ok(Date.now() < deadline, 'the switch did not refuse within 3 s');
      await sleep(200);
    }
  } finally {
    onceguard(store, 'switch', 'release', '--tenant', TENANT, '--namespace', namespace);
  }
  assert.equal(codeOf(refused), 42301, String(refused));
  assert.equal(refused.name, 'JsonRpcTransportError');
  t.diagnostic(`refused: ${refused.message}; data: ${JSON.stringify(refused.data)}`);
  assert.equal(executions({ text: refusedText }), 0, 'the refused send never reached the agent');
  await sleep(1_000); // every instance sees a release within a second
  const text = `echo ${unique('g')}`;
  const released = await send(client, message(text, unique('msg')));
  assert.deepEqual(texts(released.parts), [`echo ${text.split(' ')[1]}`]);
  t.diagnostic(`executions: refused ${executions({ text: refusedText })}, after release ${executions({ text })}`);
  assert.equal(executions({ text }), 1);
});

test('two gateway instances on one store execute a send once', async (t) => {
  const other = await startGateway(store);
  try {
    const text = `task ${unique('h')}`;
    const mid = unique('msg');
    const [one, two] = await Promise.all([gateway.url, other.url].map(async (url) => send(await connect({ url }), message(text, mid))));
    assert.equal(one.id, two.id, 'both answered the same task');
    assert.equal(one.status.state, COMPLETED);
    assert.equal(two.status.state, COMPLETED);
    t.diagnostic(`executions: ${executions({ text })}`);
    assert.equal(executions({ text }), 1);
  } finally {
    await other.stop();
  }
});

/** Holds the write lock of the SQLite database `db` (BEGIN EXCLUSIVE, in a Python child: Node 20
 * has no SQLite of its own) until `release()`. */
async function holdLock(db) {
  const script = [
    'import sqlite3, sys',
    'c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)',
    'c.execute("BEGIN EXCLUSIVE")',
    'print("locked", flush=True)',
    'sys.stdin.read()',
    'c.execute("ROLLBACK")',
  ].join('\n');
  const child = spawn(process.env.PYTHON ?? 'python3', ['-c', script, db], { stdio: ['pipe', 'pipe', 'inherit'] });
  await new Promise((resolve, reject) => {
    child.stdout.on('data', (chunk) => String(chunk).includes('locked') && resolve());
    child.once('exit', (code) => reject(new Error(`the lock holder exited (${code})`)));
  });
  return () => new Promise((resolve) => {
    child.once('exit', resolve);
    child.stdin.end();
  });
}

test('a store that cannot answer fails closed: 50301, and the agent never runs', async (t) => {
  // A gateway on a SQLite store of its own whose write lock another connection holds: the gateway
  // runs, but no claim can be written, so the send is refused (after the store's busy timeout)
  // and never reaches the agent. Once the lock is gone, it runs once.
  const db = path.join(dir, 'down.db');
  const downStore = `sqlite://${db}`;
  onceguard(downStore, 'tenants', 'create', TENANT);
  const key = createKey(downStore, 'ts store down');
  const instance = await startGateway(downStore);
  try {
    const client = await connect({ key, url: instance.url });
    await send(client, message(`echo ${unique('warm')}`, unique('msg')));
    const text = `echo ${unique('i')}`;
    const mid = unique('msg');
    const release = await holdLock(db);
    let refused;
    let down;
    try {
      refused = await refusal(send(client, message(text, mid)));
      down = executions({ text });
    } finally {
      await release();
    }
    assert.equal(codeOf(refused), 50301, String(refused));
    assert.equal(down, 0, 'the agent ran while the store could not answer');
    const recovered = await send(client, message(text, mid));
    assert.deepEqual(texts(recovered.parts), [`echo ${text.split(' ')[1]}`]);
    assert.equal(replayed(recovered), false);
    t.diagnostic(`executions: while down ${down}, after ${executions({ text })}`);
    assert.equal(executions({ text }), 1);
  } finally {
    await instance.stop();
  }
});

test('onceguard/a2a: a re-run of the same run and step runs the agent once; another step runs again', async (t) => {
  const run = unique('run');
  const text = `task ${unique('j')}`;
  // No messageId: the helper sets it to the step's key.
  const params = { tenant: '', message: { ...message(text, ''), messageId: undefined }, configuration: undefined, metadata: undefined };
  const first = await guardA2A(await connect(), { run }).sendMessage(params, { step: 'invoice' });
  // The run again, as after a crash: a new client, a new wrapper, the same run and step.
  const rerun = await guardA2A(await connect(), { run }).sendMessage(params, { step: 'invoice' });
  assert.equal(first.status.state, COMPLETED, JSON.stringify(first));
  assert.equal(replayed(first), false);
  assert.equal(rerun.id, first.id, 'the same task');
  assert.equal(replayed(rerun), true);
  assert.equal(first.history[0]?.messageId, await a2aKey(run, 'invoice'), 'the messageId the agent saw is the step\'s key');
  assert.equal(executions({ text }), 1, 'the re-run did not run the agent');
  const next = await guardA2A(await connect(), { run }).sendMessage(params, { step: 'invoice-2' });
  assert.notEqual(next.id, first.id);
  assert.equal(replayed(next), false);
  assert.equal(executions({ text }), 2, 'another step is another send');

  // A stream of a step, re-run: the stored task, one execution.
  const streamed = `task ${unique('k')}`;
  const streamParams = { ...params, message: { ...params.message, parts: [textPart(streamed)] } };
  const once = await collect(guardA2A(await connect(), { run }).sendMessageStream(streamParams, { step: 'stream' }));
  const twice = await collect(guardA2A(await connect(), { run }).sendMessageStream(streamParams, { step: 'stream' }));
  assert.equal(lastState(once), COMPLETED);
  assert.equal(lastState(twice), COMPLETED);
  assert.ok(twice.some(replayed), JSON.stringify(twice));
  assert.equal(executions({ text: streamed }), 1);
  t.diagnostic(`executions: step invoice twice + step invoice-2: ${executions({ text })}; stream step twice: ${executions({ text: streamed })}`);
});
