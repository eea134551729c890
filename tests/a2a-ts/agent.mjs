// A small A2A (v1.0) agent built with the official JavaScript SDK (@a2a-js/sdk: its
// DefaultRequestHandler, InMemoryTaskStore and express JSON-RPC handler), for the gateway's
// TypeScript end-to-end tests: the same skills and effects log as tests/a2a/agent_server.py.
//
// Every execution of its executor appends one JSON line to an effects file, so that a test can
// tell how often the agent really ran, whatever the gateway answered. It behaves by the first
// word of the user's text:
//
// - `echo <x>`: answers at once with a Message "echo <x>" (no task);
// - `task <x>`: a task that works for 200 ms, then completes with an artifact "done <x>";
// - `slow <x>`: a task that stays `working` for 3 s (CancelTask cancels it), then completes;
// - `long <x>`: the same for 30 s;
// - `ask <x>`: a task that stops at `input-required`; the message that continues it (the same
//   taskId) is an execution of its own (step "continue") and completes the task.
//
// A cancel is logged too, with step "cancel" (not an execution). The agent serves JSON-RPC at
// `/` and its card at /.well-known/agent-card.json, naming http://127.0.0.1:PORT/.
//
//     node agent.mjs --port 8000 --effects /tmp/effects.log
import { randomUUID } from 'node:crypto';
import { appendFileSync, closeSync, fsyncSync, openSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import { parseArgs } from 'node:util';
import express from 'express';
import { A2A_PROTOCOL_VERSION, AGENT_CARD_PATH, Role, TaskState } from '@a2a-js/sdk';
import { AgentEvent, DefaultRequestHandler, InMemoryTaskStore } from '@a2a-js/sdk/server';
import { UserBuilder, agentCardHandler, jsonRpcHandler } from '@a2a-js/sdk/server/express';

export const SKILLS = ['echo', 'task', 'slow', 'long', 'ask'];
const WORK_MS = { task: 200, slow: 3_000, long: 30_000 };

/** Appends one line to the effects file, durably. */
function record(effects, row) {
  const fd = openSync(effects, 'a');
  try {
    appendFileSync(fd, JSON.stringify(row) + '\n');
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

export const textPart = (text) => ({ content: { $case: 'text', value: text }, metadata: undefined, filename: '', mediaType: 'text/plain' });
const textOf = (message) => (message?.parts ?? []).filter((p) => p.content?.$case === 'text').map((p) => p.content.value).join('');
const now = () => new Date().toISOString();

function agentMessage(text, contextId, taskId = '') {
  return { messageId: randomUUID(), contextId, taskId, role: Role.ROLE_AGENT, parts: [textPart(text)], metadata: undefined, extensions: [], referenceTaskIds: [] };
}

class Agent {
  /** The executions at work, by task id: a cancel aborts its wait. */
  running = new Map();
  /** Each task's context, for the status a cancel publishes. */
  contexts = new Map();

  constructor(effects) {
    this.effects = effects;
  }

  async execute(context, bus) {
    const text = textOf(context.userMessage);
    const { taskId, contextId } = context;
    let task = context.task;
    const continuing = task?.status?.state === TaskState.TASK_STATE_INPUT_REQUIRED;
    const skill = continuing ? task.metadata?.skill : text.split(/\s+/)[0] ?? '';
    record(this.effects, { skill, text, task: taskId, context: contextId, step: continuing ? 'continue' : 'start' });
    this.contexts.set(taskId, contextId);

    const rest = text.includes(' ') ? text.slice(text.indexOf(' ') + 1) : '';
    const status = (state, message) => AgentEvent.statusUpdate({ taskId, contextId, status: { state, message, timestamp: now() }, metadata: undefined });
    const artifact = (value) => AgentEvent.artifactUpdate({
      taskId,
      contextId,
      artifact: { artifactId: randomUUID(), name: 'result', description: '', parts: [textPart(value)], metadata: undefined, extensions: [] },
      append: false,
      lastChunk: true,
      metadata: undefined,
    });

    if (skill === 'echo' && !task) {
      bus.publish(AgentEvent.message(agentMessage(`echo ${rest}`, contextId)));
      return;
    }
    // Every execution publishes its task first, a continuation's too (the SDK requires it).
    task ??= {
      id: taskId,
      contextId,
      status: { state: TaskState.TASK_STATE_SUBMITTED, message: undefined, timestamp: now() },
      artifacts: [],
      history: [context.userMessage],
      metadata: { skill },
    };
    bus.publish(AgentEvent.task(task));
    if (continuing) {
      bus.publish(artifact(`done ${rest}`));
      bus.publish(status(TaskState.TASK_STATE_COMPLETED));
    } else if (skill === 'ask') {
      bus.publish(status(TaskState.TASK_STATE_INPUT_REQUIRED, agentMessage(`more for ${rest}?`, contextId, taskId)));
    } else if (skill in WORK_MS) {
      bus.publish(status(TaskState.TASK_STATE_WORKING));
      const cancel = new AbortController();
      this.running.set(taskId, cancel);
      try {
        await sleep(WORK_MS[skill], undefined, { signal: cancel.signal });
      } catch {
        return; // canceled: the cancel published the state
      } finally {
        this.running.delete(taskId);
      }
      bus.publish(artifact(`done ${rest}`));
      bus.publish(status(TaskState.TASK_STATE_COMPLETED));
    } else {
      bus.publish(status(TaskState.TASK_STATE_REJECTED, agentMessage(`no skill ${JSON.stringify(skill)}`, contextId, taskId)));
    }
  }

  async cancelTask(taskId, bus) {
    const contextId = this.contexts.get(taskId) ?? '';
    record(this.effects, { skill: 'cancel', text: '', task: taskId, context: contextId, step: 'cancel' });
    this.running.get(taskId)?.abort();
    bus.publish(AgentEvent.statusUpdate({ taskId, contextId, status: { state: TaskState.TASK_STATE_CANCELED, message: undefined, timestamp: now() }, metadata: undefined }));
  }

  stop() {
    for (const cancel of this.running.values()) cancel.abort();
  }
}

function card(url) {
  return {
    name: 'onceguard-test-agent',
    description: 'Echoes, runs tasks, slow tasks and tasks that ask for more input.',
    supportedInterfaces: [{ url, protocolBinding: 'JSONRPC', tenant: '', protocolVersion: A2A_PROTOCOL_VERSION }],
    provider: undefined,
    version: '1.0.0',
    capabilities: { streaming: true, pushNotifications: false, extensions: [], extendedAgentCard: false },
    securitySchemes: {},
    securityRequirements: [],
    defaultInputModes: ['text/plain'],
    defaultOutputModes: ['text/plain'],
    skills: SKILLS.map((s) => ({ id: s, name: s, description: `\`${s} <x>\``, tags: ['test'], examples: [], inputModes: [], outputModes: [], securityRequirements: [] })),
    signatures: [],
  };
}

/** Starts the agent on 127.0.0.1:`port` (0: any free port); its task store is in memory. */
export function startAgent({ effects, port = 0 }) {
  const agent = new Agent(effects);
  const app = express();
  const server = app.listen(port, '127.0.0.1');
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.once('listening', () => {
      const url = `http://127.0.0.1:${server.address().port}/`;
      const handler = new DefaultRequestHandler(card(url), new InMemoryTaskStore(), agent);
      app.use(`/${AGENT_CARD_PATH}`, agentCardHandler({ agentCardProvider: handler }));
      app.use(jsonRpcHandler({ requestHandler: handler, userBuilder: UserBuilder.noAuthentication }));
      resolve({
        url,
        close: () => new Promise((done) => {
          agent.stop();
          server.close(() => done());
          server.closeAllConnections();
        }),
      });
    });
  });
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const { values } = parseArgs({ options: { port: { type: 'string' }, effects: { type: 'string' } } });
  if (!values.port || !values.effects) throw new Error('usage: node agent.mjs --port PORT --effects FILE');
  const { url } = await startAgent({ effects: values.effects, port: Number(values.port) });
  console.error(`agent at ${url}, effects in ${values.effects}`);
}
