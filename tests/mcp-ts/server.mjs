// An MCP server made with the TypeScript SDK, for the gateway's end-to-end tests: a plain tool
// `send_email` and a task tool `pay` (2025-11-25 tasks, the SDK's experimental task API), each
// counting its executions. Stateless: a server and a transport per request, one task store for all.
import crypto from 'node:crypto';
import http from 'node:http';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { InMemoryTaskStore } from '@modelcontextprotocol/sdk/experimental/tasks/stores/in-memory.js';
import { z } from 'zod';

export function startServer() {
  const executions = new Map();
  const count = (tool, tag) => executions.set(`${tool}/${tag}`, (executions.get(`${tool}/${tag}`) ?? 0) + 1);
  let taskStore = new InMemoryTaskStore();
  const stores = [taskStore];

  const build = () => {
    const server = new McpServer(
      { name: 'onceguard-ts-tools', version: '1.0.0' },
      { capabilities: { tasks: { requests: { tools: { call: {} } }, list: {}, cancel: {} } }, taskStore },
    );
    server.registerTool(
      'send_email',
      { inputSchema: { to: z.string(), tag: z.string() }, annotations: { destructiveHint: true } },
      async ({ to, tag }) => {
        count('send_email', tag);
        return { content: [{ type: 'text', text: `sent to ${to}` }], structuredContent: { to, tag } };
      },
    );
    server.experimental.tasks.registerToolTask(
      'pay',
      { inputSchema: { amount: z.number(), tag: z.string(), ms: z.number() }, execution: { taskSupport: 'required' } },
      {
        async createTask({ amount, tag, ms }, { taskStore: store, taskRequestedTtl }) {
          const task = await store.createTask({ ttl: taskRequestedTtl ?? 60_000, pollInterval: 50 });
          setTimeout(async () => {
            // A cancelled task does not pay.
            if ((await store.getTask(task.taskId))?.status === 'cancelled') return;
            count('pay', tag);
            await store.storeTaskResult(task.taskId, 'completed', {
              content: [{ type: 'text', text: `paid ${amount}` }],
            });
          }, ms);
          return { task };
        },
        async getTask(_args, { taskId, taskStore: store }) {
          return store.getTask(taskId);
        },
        async getTaskResult(_args, { taskId, taskStore: store }) {
          return store.getTaskResult(taskId);
        },
      },
    );
    return server;
  };

  const httpServer = http.createServer(async (req, res) => {
    let body = '';
    for await (const chunk of req) body += chunk;
    const server = build();
    const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined });
    // Left open when the response ends: the SDK's task machinery may still write to it.
    await server.connect(transport);
    await transport.handleRequest(req, res, body ? JSON.parse(body) : undefined);
  });
  return new Promise((resolve) => {
    httpServer.listen(0, '127.0.0.1', () => {
      resolve({
        url: `http://127.0.0.1:${httpServer.address().port}/mcp`,
        executions: (tool, tag) => executions.get(`${tool}/${tag}`) ?? 0,
        // The server forgets every task, as when their TTL passes.
        forgetTasks: () => {
          taskStore = new InMemoryTaskStore();
          stores.push(taskStore);
        },
        close: () =>
          new Promise((done) => {
            // Each store's TTL timers would keep the process alive.
            for (const store of stores) store.cleanup();
            httpServer.close(done);
            httpServer.closeAllConnections();
          }),
      });
    });
  });
}

/** A stateful server with resumable streams (an event store): its tool `send_receipt` closes
 * the call's event stream before it answers, so the client resumes it with `Last-Event-ID` and
 * gets the answer there (the SDK's `closeSSEStream`). Counts its executions. */
export async function startResumableServer() {
  const { InMemoryEventStore } = await import('@modelcontextprotocol/sdk/examples/shared/inMemoryEventStore.js');
  const { isInitializeRequest } = await import('@modelcontextprotocol/sdk/types.js');
  const executions = new Map();
  const sessions = new Map();
  const build = () => {
    const server = new McpServer({ name: 'onceguard-ts-resumable', version: '1.0.0' });
    server.registerTool(
      'send_receipt',
      { inputSchema: { tag: z.string() }, annotations: { destructiveHint: true } },
      async ({ tag }, extra) => {
        executions.set(tag, (executions.get(tag) ?? 0) + 1);
        extra.closeSSEStream?.();
        await new Promise((resolve) => setTimeout(resolve, 300));
        return { content: [{ type: 'text', text: `receipt ${tag}` }] };
      },
    );
    return server;
  };
  const httpServer = http.createServer(async (req, res) => {
    let body = '';
    for await (const chunk of req) body += chunk;
    const parsed = body ? JSON.parse(body) : undefined;
    const sessionId = req.headers['mcp-session-id'];
    let transport = sessionId ? sessions.get(sessionId) : undefined;
    if (!transport) {
      if (sessionId || !isInitializeRequest(parsed)) {
        res.writeHead(404).end();
        return;
      }
      transport = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => crypto.randomUUID(),
        eventStore: new InMemoryEventStore(),
        retryInterval: 50,
        onsessioninitialized: (id) => sessions.set(id, transport),
      });
      await build().connect(transport);
    }
    await transport.handleRequest(req, res, parsed);
  });
  return new Promise((resolve) => {
    httpServer.listen(0, '127.0.0.1', () => {
      resolve({
        url: `http://127.0.0.1:${httpServer.address().port}/mcp`,
        executions: (tag) => executions.get(tag) ?? 0,
        close: () =>
          new Promise((done) => {
            for (const transport of sessions.values()) transport.close();
            httpServer.close(done);
            httpServer.closeAllConnections();
          }),
      });
    });
  });
}
