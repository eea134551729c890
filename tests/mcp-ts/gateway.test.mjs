// End-to-end tests of `onceguard mcp` with the MCP TypeScript SDK (server and client, 2025-11-25
// tasks) and the AI SDK's MCP client (its tools/call retry option). Run by scripts/mcp-tests,
// which installs the pinned packages and builds the binary ($ONCEGUARD_BIN, or
// $CARGO_TARGET_DIR/debug/onceguard).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { randomUUID } from 'node:crypto';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { CallToolResultSchema } from '@modelcontextprotocol/sdk/types.js';
import { experimental_createMCPClient as createMCPClient } from '@ai-sdk/mcp';
import { startResumableServer, startServer } from './server.mjs';

const here = path.dirname(new URL(import.meta.url).pathname);
const target = process.env.CARGO_TARGET_DIR ?? path.join(here, '..', '..', 'target');
const binary = process.env.ONCEGUARD_BIN ?? path.join(target, 'debug', 'onceguard');
const KEY = 'dev.onceguard/idempotency-key';

let upstream, gateway, gatewayUrl, token, otherToken, store, dir;

function onceguard(store, ...args) {
  return execFileSync(binary, ['--log-format', 'json', '--store', store, ...args], { encoding: 'utf8' });
}

before(async () => {
  upstream = await startServer();
  dir = mkdtempSync(path.join(os.tmpdir(), 'onceguard-mcp-ts-'));
  store = `sqlite://${dir}/onceguard.db`;
  onceguard(store, 'tenants', 'create', 'acme');
  token = JSON.parse(onceguard(store, 'api-keys', 'create', '--tenant', 'acme', '--label', 'ts')).token;
  otherToken = JSON.parse(onceguard(store, 'api-keys', 'create', '--tenant', 'acme', '--label', 'other')).token;
  gateway = spawn(binary, ['--log-format', 'json', '--store', store, 'mcp', '--listen', '127.0.0.1:0',
    '--upstream', upstream.url, '--upstream-name', 'ts', '--lease', '5s', '--no-key', 'derive'],
    { stdio: ['ignore', 'ignore', 'pipe'] });
  gatewayUrl = await new Promise((resolve, reject) => {
    let buffer = '';
    const timer = setTimeout(() => reject(new Error(`the gateway did not start: ${buffer}`)), 60_000);
    gateway.stderr.on('data', (chunk) => {
      buffer += chunk;
      for (const line of buffer.split('\n')) {
        try {
          const event = JSON.parse(line);
          if (event.addr) {
            clearTimeout(timer);
            resolve(`http://${event.addr}/mcp`);
          }
        } catch {}
      }
    });
  });
});

after(async () => {
  gateway?.kill('SIGKILL');
  gateway?.stderr.destroy();
  await upstream?.close();
  rmSync(dir, { recursive: true, force: true });
});

async function sdkClient(url = gatewayUrl, key = token) {
  const client = new Client({ name: 'onceguard-ts-test', version: '1.0.0' }, { capabilities: { tasks: {} } });
  const transport = new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers: { 'x-onceguard-key': key } },
  });
  await client.connect(transport);
  return client;
}

async function collect(stream) {
  const messages = [];
  for await (const message of stream) messages.push(message);
  return messages;
}

test('2025-11-25 tasks: a retried task call gets the same task, pays once, and its result outlives the server', async () => {
  const client = await sdkClient();
  const tag = randomUUID();
  const params = { name: 'pay', arguments: { amount: 5, tag, ms: 800 }, _meta: { [KEY]: randomUUID() } };
  const stream = () => client.experimental.tasks.callToolStream(params, CallToolResultSchema, { task: { ttl: 60_000 } });
  // The first call and its retry while the task works.
  const first = stream();
  const created = (await first.next()).value;
  assert.equal(created.type, 'taskCreated', JSON.stringify(created));
  const taskId = created.task.taskId;
  assert.match(taskId, /^ogt1\./, 'the caller sees the gateway task id');
  const retry = await collect(stream());
  const rest = await collect(first);
  const retried = retry.find((m) => m.type === 'taskCreated');
  assert.equal(retried?.task.taskId, taskId, `the retry gets the same task: ${JSON.stringify(retry)}`);
  for (const messages of [rest, retry]) {
    const result = messages.find((m) => m.type === 'result');
    assert.equal(result?.result.content[0].text, 'paid 5', JSON.stringify(messages));
  }
  assert.equal(upstream.executions('pay', tag), 1);

  // The server forgets its tasks; the gateway still has the result.
  upstream.forgetTasks();
  const got = await client.experimental.tasks.getTask(taskId);
  assert.equal(got.status, 'completed');
  const payload = await client.experimental.tasks.getTaskResult(taskId, CallToolResultSchema);
  assert.equal(payload.content[0].text, 'paid 5');
  const again = await collect(stream());
  const replay = again.find((m) => m.type === 'result');
  assert.equal(replay?.result.content[0].text, 'paid 5', JSON.stringify(again));
  assert.equal(replay.result._meta['dev.onceguard/replayed'], true);
  assert.equal(upstream.executions('pay', tag), 1, 'the tool ran once');
  await client.close();
});

/** A TCP relay to `target`, as an intermediary whose upstream timed out: the first answer to a
 * tools/call is replaced by a 502 and the connection closed. The client sees its request fail
 * after the server acted. */
async function cutter(target) {
  const { hostname, port } = new URL(target);
  let cut = 0;
  const relay = net.createServer((inbound) => {
    const outbound = net.connect(Number(port), hostname);
    let toolCall = false;
    inbound.on('data', (chunk) => {
      if (chunk.includes('"tools/call"')) toolCall = true;
      outbound.write(chunk);
    });
    outbound.on('data', (chunk) => {
      if (toolCall && cut === 0) {
        cut += 1;
        inbound.end('HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n');
        outbound.destroy();
        return;
      }
      inbound.write(chunk);
    });
    inbound.on('error', () => outbound.destroy());
    outbound.on('error', () => inbound.destroy());
    inbound.on('close', () => outbound.destroy());
    outbound.on('close', () => inbound.end());
  });
  await new Promise((resolve) => relay.listen(0, '127.0.0.1', resolve));
  return { url: `http://127.0.0.1:${relay.address().port}/mcp`, cuts: () => cut, close: () => relay.close() };
}

async function aiSdkCall(url, run, tag) {
  const client = await createMCPClient({
    transport: { type: 'http', url, headers: { 'x-onceguard-key': token, 'x-onceguard-run-id': run } },
    maxRetries: 2,
    protocolVersionDiscovery: false,
  });
  try {
    const tools = await client.tools();
    return await tools.send_email.execute({ to: 'a@example.com', tag }, { toolCallId: 'call-1', messages: [] });
  } finally {
    await client.close();
  }
}

test("the AI SDK's tools/call retry after a lost answer is a replay, never a second execution", async () => {
  const tag = randomUUID();
  const relay = await cutter(gatewayUrl);
  const result = await aiSdkCall(relay.url, `run-${tag}`, tag);
  relay.close();
  assert.equal(relay.cuts(), 1, 'the first answer was lost');
  assert.equal(result.content[0].text, 'sent to a@example.com');
  assert.equal(result._meta?.['dev.onceguard/replayed'], true, 'the retry got the stored result');
  assert.equal(upstream.executions('send_email', tag), 1, 'the email went once');
});

test('without the gateway, the same retry sends the email twice (the scenario is real)', async () => {
  const tag = randomUUID();
  const relay = await cutter(upstream.url);
  await aiSdkCall(relay.url, `run-${tag}`, tag);
  relay.close();
  assert.equal(relay.cuts(), 1);
  assert.equal(upstream.executions('send_email', tag), 2);
});

test('a legacy answer delivered on the resumed stream settles the key: the retry replays it', async () => {
  const resumable = await startResumableServer();
  const store = `sqlite://${dir}/resumable.db`;
  onceguard(store, 'tenants', 'create', 'acme');
  const key = JSON.parse(onceguard(store, 'api-keys', 'create', '--tenant', 'acme', '--label', 'ts')).token;
  const second = spawn(binary, ['--log-format', 'json', '--store', store, 'mcp', '--listen', '127.0.0.1:0',
    '--upstream', resumable.url, '--upstream-name', 'resumable', '--lease', '5s'], { stdio: ['ignore', 'ignore', 'pipe'] });
  try {
    const url = await new Promise((resolve, reject) => {
      let buffer = '';
      const timer = setTimeout(() => reject(new Error(`the gateway did not start: ${buffer}`)), 60_000);
      second.stderr.on('data', (chunk) => {
        buffer += chunk;
        const addr = buffer.split('\n').map((l) => { try { return JSON.parse(l).addr; } catch { return undefined; } }).find(Boolean);
        if (addr) {
          clearTimeout(timer);
          resolve(`http://${addr}/mcp`);
        }
      });
    });
    const tag = randomUUID();
    const call = { name: 'send_receipt', arguments: { tag }, _meta: { [KEY]: randomUUID() } };
    const connect = async () => {
      const client = new Client({ name: 'onceguard-ts-test', version: '1.0.0' });
      const transport = new StreamableHTTPClientTransport(new URL(url), {
        requestInit: { headers: { 'x-onceguard-key': key } },
        reconnectionOptions: { initialReconnectionDelay: 50, maxReconnectionDelay: 200, reconnectionDelayGrowFactor: 1.5, maxRetries: 5 },
      });
      await client.connect(transport);
      return client;
    };
    const client = await connect();
    const first = await client.callTool(call);
    assert.equal(first.content[0].text, `receipt ${tag}`, 'the answer came on the resumed stream');
    await client.close();
    const again = await connect();
    const replay = await again.callTool(call);
    assert.equal(replay.content[0].text, `receipt ${tag}`);
    assert.equal(replay._meta?.['dev.onceguard/replayed'], true, 'the resumed answer settled the key');
    assert.equal(resumable.executions(tag), 1);
    await again.close();
  } finally {
    second.kill('SIGKILL');
    second.stderr.destroy();
    await resumable.close();
  }
});

/** Starts `pay` as a 2025-11-25 task with a new key; answers the client, the call and its task id. */
async function startPayment(ms) {
  const client = await sdkClient();
  const tag = randomUUID();
  const params = { name: 'pay', arguments: { amount: 1, tag, ms }, _meta: { [KEY]: randomUUID() } };
  const stream = client.experimental.tasks.callToolStream(params, CallToolResultSchema, { task: { ttl: 60_000 } });
  const created = (await stream.next()).value;
  assert.equal(created.type, 'taskCreated', JSON.stringify(created));
  stream.return?.();
  return { client, tag, params, taskId: created.task.taskId };
}

test('2025-11-25 tasks: another API key of the tenant cannot see, poll or cancel the task', async () => {
  const { client, tag, taskId } = await startPayment(300);
  const other = await sdkClient(gatewayUrl, otherToken);
  await assert.rejects(other.experimental.tasks.getTask(taskId), /no such task/);
  await assert.rejects(other.experimental.tasks.cancelTask(taskId), /no such task/);
  const listed = await other.experimental.tasks.listTasks();
  assert.deepEqual(listed.tasks, []);
  const own = await client.experimental.tasks.listTasks();
  assert.ok(own.tasks.some((t) => t.taskId === taskId), JSON.stringify(own));
  const result = await client.experimental.tasks.getTaskResult(taskId, CallToolResultSchema);
  assert.equal(result.content[0].text, 'paid 1');
  assert.equal(upstream.executions('pay', tag), 1);
  await other.close();
  await client.close();
});

test('2025-11-25 tasks: a kill switch that revokes leases cancels the task, which never runs again', async () => {
  const { client, tag, params, taskId } = await startPayment(3_000);
  onceguard(store, 'switch', 'engage', '--tenant', 'acme', '--namespace', 'mcp/ts', '--reason', 'runaway', '--revoke-leases');
  try {
    let status = 'working';
    for (let i = 0; i < 100 && status === 'working'; i++) {
      status = (await client.experimental.tasks.getTask(taskId)).status;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    assert.equal(status, 'cancelled');
  } finally {
    onceguard(store, 'switch', 'release', '--tenant', 'acme', '--namespace', 'mcp/ts');
  }
  let refused = '';
  for (let i = 0; i < 20; i++) {
    const again = await client.callTool(params).catch((e) => ({ error: String(e) }));
    refused = again.error ?? JSON.stringify(again);
    if (!refused.includes('kill switch')) break;
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
  assert.match(refused, /not run again/);
  await new Promise((resolve) => setTimeout(resolve, 3_200));
  assert.equal(upstream.executions('pay', tag), 0, 'the task was cancelled before it paid');
  await client.close();
});

test('2025-11-25 tasks: a cancel racing completion never loses the outcome', async () => {
  const outcomes = [];
  for (const delay of [0, 280, 400]) {
    const { client, tag, params, taskId } = await startPayment(300);
    await new Promise((resolve) => setTimeout(resolve, delay));
    await client.experimental.tasks.cancelTask(taskId).catch(() => {});
    await new Promise((resolve) => setTimeout(resolve, 500));
    const again = await client.callTool(params).catch((e) => ({ error: String(e) }));
    const paid = upstream.executions('pay', tag);
    assert.ok(paid <= 1, 'never a second payment');
    // A replay only of a payment that happened; no payment: refused, never run.
    if (again.content) assert.equal(paid, 1, JSON.stringify(again));
    else assert.match(again.error ?? '', /not run again/, JSON.stringify(again));
    outcomes.push(`${delay} ms: ${paid} payment(s), ${again.content ? 'replayed' : 'refused'}`);
    await client.close();
  }
  console.log(`cancel racing completion: ${outcomes.join('; ')}`);
});
