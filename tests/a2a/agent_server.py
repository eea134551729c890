"""A small A2A (v1.0) agent built with the official a2a-sdk, for the gateway's end-to-end tests.

Every execution of its executor appends one line to an effects file, so that a test can tell how
often the agent really ran, whatever the gateway answered. It behaves by the first word of the
user's text:

- `echo <x>`: answers at once with a Message "echo <x>" (no task);
- `task <x>`: a task that works for 200 ms, then completes with an artifact "done <x>";
- `slow <x>`: a task that stays `working` for 3 s (CancelTask cancels it), then completes;
- `long <x>`: the same for 30 s;
- `ask <x>`: a task that stops at `input-required`; the message that continues it (the same
  taskId) is an execution of its own (step "continue") and completes the task.

A cancel is logged too, with step "cancel" (not an execution). The agent serves JSON-RPC at `/`
(with the v0.3 method names too), HTTP+JSON under `/rest`, and its card at
/.well-known/agent-card.json, naming http://127.0.0.1:PORT/.

    python agent_server.py --port 8000 --effects /tmp/effects.log
"""

import argparse
import asyncio
import json
import os

import uvicorn
from a2a.helpers import new_task_from_user_message, new_text_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, TaskState
from starlette.applications import Starlette

SKILLS = ["echo", "task", "slow", "long", "ask"]


def record(**row) -> None:
    """Appends one line to the effects file, durably."""
    with open(args.effects, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Agent(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        text = context.get_user_input()
        task = context.current_task
        continuing = task is not None and task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
        skill = task.metadata["skill"] if continuing else (text.split() or [""])[0]
        record(skill=skill, text=text, task=context.task_id, context=context.context_id,
               step="continue" if continuing else "start")

        rest = text.split(" ", 1)[1] if " " in text else ""
        if skill == "echo" and task is None:
            await event_queue.enqueue_event(new_text_message(f"echo {rest}", context_id=context.context_id))
            return
        if task is None:
            task = new_task_from_user_message(context.message)
            task.metadata.update({"skill": skill})
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if continuing:
            await updater.add_artifact([new_text_part(f"done {rest}")], name="result")
            await updater.complete()
        elif skill == "ask":
            await updater.requires_input(updater.new_agent_message([new_text_part(f"more for {rest}?")]))
        elif skill in ("task", "slow", "long"):
            await updater.start_work()
            await asyncio.sleep({"task": 0.2, "slow": 3.0, "long": 30.0}[skill])
            await updater.add_artifact([new_text_part(f"done {rest}")], name="result")
            await updater.complete()
        else:
            await updater.reject(updater.new_agent_message([new_text_part(f"no skill {skill!r}")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        record(skill="cancel", text="", task=context.task_id, context=context.context_id, step="cancel")
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--effects", required=True)
args = parser.parse_args()

url = f"http://127.0.0.1:{args.port}/"
card = AgentCard(
    name="onceguard-test-agent",
    description="Echoes, runs tasks, slow tasks and tasks that ask for more input.",
    version="1.0.0",
    supported_interfaces=[
        AgentInterface(protocol_binding="JSONRPC", url=url, protocol_version="1.0"),
        AgentInterface(protocol_binding="HTTP+JSON", url=f"{url}rest", protocol_version="1.0"),
    ],
    capabilities=AgentCapabilities(streaming=True),
    default_input_modes=["text/plain"],
    default_output_modes=["text/plain"],
    skills=[
        AgentSkill(id=s, name=s, description=f"`{s} <x>`", tags=["test"]) for s in SKILLS
    ],
)
handler = DefaultRequestHandler(agent_executor=Agent(), task_store=InMemoryTaskStore(), agent_card=card)
app = Starlette(routes=[
    *create_agent_card_routes(card),
    *create_jsonrpc_routes(handler, rpc_url="/", enable_v0_3_compat=True),
    *create_rest_routes(handler, path_prefix="/rest"),
])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
