"""End-to-end tests of `onceguard a2a` with the official A2A Python SDK (`a2a-sdk`) client, over
its JSON-RPC binding, against a real a2a-sdk agent (agent_server.py) started here.

The agent appends a line to an effects file for every execution of its executor, so every test
checks how often the agent really ran, whatever the clients were told. Two agent API keys of one
tenant are two callers. Run by scripts/a2a-tests, which makes the virtualenv and builds the binary
(found at $CARGO_TARGET_DIR/debug/onceguard, or $ONCEGUARD_BIN).

A per-call header (`Idempotency-Key`) goes through the SDK's `ClientCallContext(service_parameters=
{...})`, which the JSON-RPC transport sends as HTTP headers of that one request. The Python client's
`onceguard.a2a` (installed into the virtualenv by scripts/a2a-tests) sends its headers that way.
"""

import asyncio
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from a2a.client import A2ACardResolver, ClientCallContext, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    TaskState,
)
from a2a.utils.errors import JSON_RPC_ERROR_CODE_MAP
from google.protobuf.json_format import MessageToDict
from onceguard.a2a import OnceA2AClient

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "mcp"))
from processes import Gateway, free_port, onceguard, wait_port  # noqa: E402

UPSTREAM_NAME = "agent"
TENANT = "acme"
REPLAYED = "dev.onceguard/replayed"
KEY_HEADER = "x-onceguard-key"

COMPLETED = TaskState.TASK_STATE_COMPLETED
CANCELED = TaskState.TASK_STATE_CANCELED
INPUT_REQUIRED = TaskState.TASK_STATE_INPUT_REQUIRED


def gateway(store: str, upstream: str, workdir: str) -> Gateway:
    """The suite's gateway: a lease of 5 s, duplicates waiting 10 s, JSON-RPC at `/`."""
    return Gateway(store, upstream, workdir, UPSTREAM_NAME, "--lease", "5s", "--wait", "10s", command="a2a", path="/")


class Agent:
    """The a2a-sdk agent process; its task store is in memory, so a restart forgets every task."""

    def __init__(self, workdir: str, effects: str) -> None:
        self.workdir, self.effects, self.port = workdir, effects, free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.start()

    def start(self) -> None:
        log = open(os.path.join(self.workdir, "agent.log"), "a")
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "agent_server.py"), "--port", str(self.port), "--effects", self.effects],
            stdout=subprocess.DEVNULL, stderr=log,
        )
        wait_port(self.port)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


def create_key(store: str, label: str) -> str:
    out = onceguard(store, "api-keys", "create", "--tenant", TENANT, "--role", "agent", "--label", label)
    return json.loads(out)["token"]


class World:
    """The agent, a SQLite store with a tenant and two agent API keys (two callers), and a gateway."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="onceguard-a2a-")
        self.effects = os.path.join(self.dir, "effects.log")
        self.store = f"sqlite://{self.dir}/onceguard.db"
        self.agent = Agent(self.dir, self.effects)
        self.upstream = self.agent.url
        try:
            onceguard(self.store, "tenants", "create", TENANT)
            self.token = create_key(self.store, "e2e caller one")
            self.other_token = create_key(self.store, "e2e caller two")
            self.gateway = gateway(self.store, self.upstream, self.dir)
        except BaseException:
            self.agent.stop()
            raise

    def rows(self, **match) -> list[dict]:
        """What the agent logged (executions and cancels) with these fields."""
        if not os.path.exists(self.effects):
            return []
        with open(self.effects) as f:
            rows = [json.loads(line) for line in f]
        return [r for r in rows if all(r.get(k) == v for k, v in match.items())]

    def executions(self, **match) -> int:
        """How often the agent's executor ran for messages with these fields (cancels left out)."""
        rows = [r for r in self.rows(**match) if r["step"] != "cancel"]
        print(f"agent executions {match}: {json.dumps(rows, indent=None)}")
        return len(rows)

    def close(self) -> None:
        self.gateway.stop()
        self.agent.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def world():
    w = World()
    yield w
    w.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def message(text: str, message_id: str, task_id: str = "", context_id: str = "") -> Message:
    """A user's message of one text part. The SDK sets no messageId itself: the caller does."""
    return Message(role=Role.ROLE_USER, parts=[Part(text=text)], message_id=message_id, task_id=task_id,
                   context_id=context_id)


@asynccontextmanager
async def connect(world: World, token: str | None = None, url: str | None = None, streaming: bool = False):
    """An a2a-sdk client of the agent card served at `url` (the gateway), speaking JSON-RPC with
    the caller's API key on every request. `streaming` picks SendStreamingMessage over SendMessage
    (the SDK's own default is to stream when the card says it can)."""
    url = url or world.gateway.url
    http = httpx.AsyncClient(headers={KEY_HEADER: token or world.token}, timeout=30)
    try:
        card = await A2ACardResolver(http, url).get_agent_card()
        jsonrpc = [i.url for i in card.supported_interfaces if i.protocol_binding == "JSONRPC"]
        assert jsonrpc == [url], f"the card served at {url} sends clients to {jsonrpc}, not through the gateway"
        client = ClientFactory(ClientConfig(httpx_client=http, streaming=streaming)).create(card)
        yield client
        await client.close()
    finally:
        await http.aclose()


def send_request(msg: Message, return_immediately: bool = False) -> SendMessageRequest:
    request = SendMessageRequest(message=msg)
    request.configuration.return_immediately = return_immediately
    return request


def call_context(key: str | None) -> ClientCallContext | None:
    """Headers of one call: the SDK sends `service_parameters` as HTTP headers of that request."""
    return ClientCallContext(service_parameters={"Idempotency-Key": key}) if key else None


async def send(client, msg: Message, key: str | None = None, return_immediately: bool = False) -> StreamResponse:
    """A SendMessage (the client is not streaming): its one answer, a `task` or a `message`."""
    answers = [a async for a in client.send_message(send_request(msg, return_immediately), context=call_context(key))]
    assert len(answers) == 1, answers
    return answers[0]


async def stream(client, msg: Message) -> list[StreamResponse]:
    """A SendStreamingMessage (the client is streaming): every event up to the end."""
    return [e async for e in client.send_message(send_request(msg))]


def metadata(answer: StreamResponse) -> dict:
    """The metadata of an answer's task or message (where the gateway marks a replay)."""
    which = answer.WhichOneof("payload")
    return MessageToDict(getattr(answer, which).metadata) if which in ("task", "message") else {}


def replayed(answer: StreamResponse) -> bool:
    return metadata(answer).get(REPLAYED) is True


def text_of(parts) -> list[str]:
    return [p.text for p in parts]


def artifact_texts(task) -> list[str]:
    return [t for a in task.artifacts for t in text_of(a.parts)]


def event_task_id(event: StreamResponse) -> str:
    which = event.WhichOneof("payload")
    if which == "task":
        return event.task.id
    if which == "status_update":
        return event.status_update.task_id
    if which == "artifact_update":
        return event.artifact_update.task_id
    return event.message.task_id


def last_state(events: list[StreamResponse]):
    states = [e.task.status.state if e.HasField("task") else e.status_update.status.state
              for e in events if e.HasField("task") or e.HasField("status_update")]
    return states[-1] if states else None


def error_code(exc: BaseException) -> int | None:
    """The JSON-RPC error code of an a2a-sdk client exception. The JSON-RPC transport raises the
    SDK's own error class for the A2A codes (-32001 TaskNotFoundError, …) and, for any other code,
    `A2AClientError("JSON-RPC Error <code>: <message>")`: the code is only in the text. An answer
    with an HTTP status other than 2xx loses the JSON-RPC error entirely (`HTTP Error <status>`)."""
    code = JSON_RPC_ERROR_CODE_MAP.get(type(exc))
    if code is not None:
        return code
    found = re.match(r"JSON-RPC Error (-?\d+):", str(exc))
    return int(found.group(1)) if found else None


def run(coro):
    return asyncio.run(coro)


def test_a_duplicate_send_executes_once_and_replays_the_task(world):
    text, mid = f"task {unique('a')}", unique("msg")
    burst_text, burst_mid = f"task {unique('a8')}", unique("msg")

    async def go():
        async with connect(world) as client:
            first = await send(client, message(text, mid))
            second = await send(client, message(text, mid))
            burst = await asyncio.gather(*[send(client, message(burst_text, burst_mid)) for _ in range(8)])
            after = await send(client, message(burst_text, burst_mid))
            return first, second, burst, after

    first, second, burst, after = run(go())
    assert first.HasField("task") and first.task.status.state == COMPLETED, first
    assert not replayed(first)
    assert second.HasField("task") and second.task.id == first.task.id, second
    assert replayed(second), metadata(second)
    assert second.task.status.state == COMPLETED
    assert artifact_texts(second.task) == artifact_texts(first.task) == [f"done {text.split(' ', 1)[1]}"]
    assert world.executions(text=text) == 1

    assert all(b.HasField("task") for b in burst), burst
    assert {b.task.id for b in burst} == {after.task.id}, "eight concurrent duplicates answered one task"
    assert replayed(after) and after.task.status.state == COMPLETED
    assert world.executions(text=burst_text) == 1


def test_a_duplicate_send_answered_with_a_message_replays_the_message(world):
    word = unique("b")
    text, mid = f"echo {word}", unique("msg")

    async def go():
        async with connect(world) as client:
            return await send(client, message(text, mid)), await send(client, message(text, mid))

    first, second = run(go())
    assert first.HasField("message") and text_of(first.message.parts) == [f"echo {word}"], first
    assert not replayed(first)
    assert second.HasField("message"), second
    assert text_of(second.message.parts) == text_of(first.message.parts)
    assert second.message.message_id == first.message.message_id, "the stored answer, not a new one"
    assert replayed(second), metadata(second)
    assert world.executions(text=text) == 1


def test_a_message_id_reused_for_another_message_is_refused(world):
    mid = unique("msg")
    one, two = f"echo {unique('c')}", f"echo {unique('c')}"

    async def go():
        async with connect(world) as client:
            await send(client, message(one, mid))
            with pytest.raises(Exception) as refused:
                await send(client, message(two, mid))
            return refused.value

    refused = run(go())
    assert error_code(refused) == 42201, repr(refused)
    assert world.executions(text=one) == 1
    assert world.executions(text=two) == 0


def test_the_idempotency_key_header_takes_precedence_over_the_message_id(world):
    text, key = f"echo {unique('d')}", unique("key")

    async def go():
        async with connect(world) as client:
            first = await send(client, message(text, unique("msg")), key=key)
            second = await send(client, message(text, unique("msg")), key=key)
            return first, second

    first, second = run(go())
    assert first.HasField("message") and second.HasField("message"), (first, second)
    assert replayed(second) and not replayed(first)
    assert text_of(second.message.parts) == text_of(first.message.parts)
    assert world.executions(text=text) == 1


def test_the_python_client_sends_each_step_of_a_run_once(world):
    """`onceguard.a2a.OnceA2AClient` keys a send by its run and step (messages without a
    messageId): the same step of the same run, sent again by a fresh connection and wrapper (as a
    resumed orchestrator builds them), is answered with the first send's task; another step runs.
    The run reaches the gateway: a run whose budget allows one effect is refused a second step
    (42901), and its first step still replays."""
    run_id, budgeted = unique("run"), unique("run")
    text = f"task {unique('m')}"
    allowed_text, refused_text = f"echo {unique('m')}", f"echo {unique('m')}"
    onceguard(world.store, "runs", "budget", "--tenant", TENANT, budgeted, "--max-effects", "1")

    async def step(run_id: str, text: str, name: str) -> StreamResponse:
        async with connect(world) as client:
            orchestrator = OnceA2AClient(client, run_id)
            answers = [a async for a in orchestrator.send_message(send_request(message(text, "")), step=name)]
        assert len(answers) == 1, answers
        return answers[0]

    async def go():
        first = await step(run_id, text, "research")
        again = await step(run_id, text, "research")
        other = await step(run_id, text, "review")
        allowed = await step(budgeted, allowed_text, "one")
        with pytest.raises(Exception) as refused:
            await step(budgeted, refused_text, "two")
        allowed_again = await step(budgeted, allowed_text, "one")
        return first, again, other, allowed, refused.value, allowed_again

    first, again, other, allowed, refused, allowed_again = run(go())
    assert first.HasField("task") and first.task.status.state == COMPLETED, first
    assert not replayed(first)
    assert again.HasField("task") and again.task.id == first.task.id, again
    assert replayed(again) and again.task.status.state == COMPLETED
    assert other.HasField("task") and other.task.id != first.task.id and not replayed(other), other
    assert world.executions(text=text) == 2, "one execution per step"

    assert allowed.HasField("message") and not replayed(allowed), allowed
    assert error_code(refused) == 42901, repr(refused)
    assert world.executions(text=refused_text) == 0
    assert allowed_again.HasField("message") and replayed(allowed_again), allowed_again
    assert world.executions(text=allowed_text) == 1


def test_keys_and_tasks_belong_to_their_caller(world):
    text, mid = f"task {unique('e')}", unique("msg")

    async def go():
        async with connect(world) as mine, connect(world, token=world.other_token) as theirs:
            my_answer = await send(mine, message(text, mid))
            their_answer = await send(theirs, message(text, mid))
            with pytest.raises(Exception) as hidden:
                await theirs.get_task(GetTaskRequest(id=my_answer.task.id))
            their_list = await theirs.list_tasks(ListTasksRequest())
            my_list = await mine.list_tasks(ListTasksRequest())
            return my_answer, their_answer, hidden.value, their_list, my_list

    my_answer, their_answer, hidden, their_list, my_list = run(go())
    assert my_answer.task.id != their_answer.task.id, "the other caller's send ran as its own"
    assert not replayed(their_answer)
    assert world.executions(text=text) == 2
    assert error_code(hidden) == -32001, repr(hidden)
    their_ids, my_ids = {t.id for t in their_list.tasks}, {t.id for t in my_list.tasks}
    print(f"ListTasks: mine {sorted(my_ids)}, theirs {sorted(their_ids)}")
    assert my_answer.task.id not in their_ids
    assert their_answer.task.id in their_ids
    assert my_answer.task.id in my_ids and their_answer.task.id not in my_ids


def test_a_completed_task_replays_after_the_agent_forgot_it(world):
    text, mid = f"task {unique('f')}", unique("msg")

    async def before():
        async with connect(world) as client:
            first = await send(client, message(text, mid))
            got = await client.get_task(GetTaskRequest(id=first.task.id))
            return first, got

    async def after():
        async with connect(world) as client:
            return await send(client, message(text, mid))

    first, got = run(before())
    assert got.id == first.task.id and got.status.state == COMPLETED, got
    world.agent.restart()  # the agent's task store is in memory: the task is gone there
    again = run(after())
    assert again.HasField("task") and again.task.id == first.task.id, again
    assert again.task.status.state == COMPLETED and replayed(again)
    assert artifact_texts(again.task) == artifact_texts(first.task)
    assert world.executions(text=text) == 1


def test_a_canceled_task_replays_canceled(world):
    """A `slow` task answered at once (returnImmediately), then CancelTask through the gateway,
    with a duplicate send racing it: the duplicate and every later one answer the same task, and
    once the cancel answered, canceled; the agent ran once and saw one cancel."""
    text, mid = f"slow {unique('g')}", unique("msg")

    async def go():
        async with connect(world) as client:
            first = await send(client, message(text, mid), return_immediately=True)
            task_id = first.task.id
            canceled, racing = await asyncio.gather(
                client.cancel_task(CancelTaskRequest(id=task_id)),
                send(client, message(text, mid), return_immediately=True),
            )
            after = await send(client, message(text, mid))
            immediate = await send(client, message(text, mid), return_immediately=True)
            return first, canceled, racing, after, immediate

    first, canceled, racing, after, immediate = run(go())
    assert first.HasField("task") and first.task.status.state not in (COMPLETED, CANCELED), first
    assert canceled.id == first.task.id and canceled.status.state == CANCELED, canceled
    assert racing.HasField("task") and racing.task.id == first.task.id, racing
    for answer in (after, immediate):
        assert answer.HasField("task") and answer.task.id == first.task.id, answer
        assert answer.task.status.state == CANCELED, answer.task.status
        assert replayed(answer)
    assert world.executions(text=text) == 1
    assert len(world.rows(task=first.task.id, step="cancel")) == 1


def test_an_input_required_continuation_executes_once(world):
    word = unique("h")
    text, mid = f"ask {word}", unique("msg")
    reply, reply_mid = f"yes {unique('h')}", unique("msg")

    async def go():
        async with connect(world) as client:
            first = await send(client, message(text, mid))
            task, context = first.task.id, first.task.context_id
            cont1 = await send(client, message(reply, reply_mid, task_id=task, context_id=context))
            cont2 = await send(client, message(reply, reply_mid, task_id=task, context_id=context))
            again = await send(client, message(text, mid))
            got = await client.get_task(GetTaskRequest(id=task))
            return first, cont1, cont2, again, got

    first, cont1, cont2, again, got = run(go())
    assert first.HasField("task") and first.task.status.state == INPUT_REQUIRED, first
    assert text_of(first.task.status.message.parts) == [f"more for {word}?"]
    for answer in (cont1, cont2):
        assert answer.HasField("task") and answer.task.id == first.task.id, answer
        assert answer.task.status.state == COMPLETED, answer.task.status
    assert replayed(cont2) and not replayed(cont1)
    assert again.task.id == first.task.id and replayed(again), "the first send replays too"
    assert got.status.state == COMPLETED
    assert world.executions(task=first.task.id, step="start") == 1
    assert world.executions(task=first.task.id, step="continue") == 1


def test_a_duplicate_stream_follows_the_same_task(world):
    """SendStreamingMessage of `task` three times: the first; a duplicate once the first's task
    was announced (while it works, ~200 ms); and one after the first ended. One execution; every
    duplicate's events are of the first's task, and end with it completed."""
    text, mid = f"task {unique('i')}", unique("msg")

    async def go():
        async with connect(world, streaming=True) as client:
            first_stream = client.send_message(send_request(message(text, mid)))
            head = await anext(first_stream)
            rest = asyncio.create_task(asyncio.wait_for(stream_rest(first_stream), 30))
            during = await stream(client, message(text, mid))
            first = [head, *await rest]
            after = await stream(client, message(text, mid))
            return first, during, after

    async def stream_rest(it):
        return [e async for e in it]

    first, during, after = run(go())
    for name, events in (("first", first), ("during", during), ("after", after)):
        print(f"{name}: {[MessageToDict(e) for e in events]}")
    task_id = event_task_id(first[0])
    assert task_id, first
    for events in (first, during, after):
        assert events and {event_task_id(e) for e in events} == {task_id}, events
        assert last_state(events) == COMPLETED, events
    assert not any(replayed(e) for e in first)
    assert any(replayed(e) for e in after), "the stream after the end is the stored task, marked"
    assert world.executions(text=text) == 1


def test_a_kill_switch_refuses_new_sends(world):
    namespace = f"a2a/{UPSTREAM_NAME}"
    refused_text = None

    async def go():
        nonlocal refused_text
        async with connect(world) as client:
            onceguard(world.store, "switch", "engage", "--tenant", TENANT, "--namespace", namespace, "--reason", "e2e")
            try:
                deadline = time.monotonic() + 3
                while True:
                    text = f"echo {unique('j')}"
                    try:
                        await send(client, message(text, unique("msg")))
                    except Exception as e:
                        assert error_code(e) == 42301, repr(e)
                        refused_text = text
                        break
                    assert time.monotonic() < deadline, "the switch did not refuse within 3 s"
                    await asyncio.sleep(0.2)
            finally:
                onceguard(world.store, "switch", "release", "--tenant", TENANT, "--namespace", namespace)
                await asyncio.sleep(1.0)  # every instance sees a release within a second
            text = f"echo {unique('j')}"
            released = await send(client, message(text, unique("msg")))
            return text, released

    text, released = run(go())
    assert world.executions(text=refused_text) == 0
    assert released.HasField("message") and world.executions(text=text) == 1


def test_two_gateways_on_one_store_execute_once(world):
    other = gateway(world.store, world.upstream, world.dir)
    text, mid = f"task {unique('k')}", unique("msg")

    async def through(url):
        async with connect(world, url=url) as client:
            return await send(client, message(text, mid))

    async def go():
        return await asyncio.gather(through(world.gateway.url), through(other.url))

    try:
        answers = run(go())
    finally:
        other.stop()
    assert all(a.HasField("task") for a in answers), answers
    assert answers[0].task.id == answers[1].task.id
    assert world.executions(text=text) == 1


def test_a_store_that_cannot_answer_fails_closed(world):
    """A gateway on a SQLite store of its own whose write lock another connection holds (BEGIN
    EXCLUSIVE): the gateway runs, but no claim can be written, so the send is answered 50301 (after
    the store's busy timeout) and never reaches the agent. Once the lock is gone, it runs once."""
    workdir = tempfile.mkdtemp(prefix="onceguard-a2a-down-", dir=world.dir)
    db = os.path.join(workdir, "onceguard.db")
    store = f"sqlite://{db}"
    onceguard(store, "tenants", "create", TENANT)
    token = create_key(store, "e2e store down")
    instance = gateway(store, world.upstream, workdir)
    text, mid = f"echo {unique('l')}", unique("msg")

    async def go():
        async with connect(world, token=token, url=instance.url) as client:
            await send(client, message(f"echo {unique('warm')}", unique("msg")))
            lock = sqlite3.connect(db, isolation_level=None, timeout=10)
            try:
                lock.execute("BEGIN EXCLUSIVE")
                with pytest.raises(Exception) as refused:
                    await send(client, message(text, mid))
                down = world.executions(text=text)
            finally:
                lock.execute("ROLLBACK")
                lock.close()
            recovered = await send(client, message(text, mid))
            return refused.value, down, recovered

    try:
        refused, down, recovered = run(go())
    finally:
        instance.stop()
    assert error_code(refused) == 50301, repr(refused)
    assert down == 0, "the agent ran while the store could not answer"
    assert recovered.HasField("message") and not replayed(recovered)
    assert world.executions(text=text) == 1


def test_the_agent_card_names_the_gateway(world):
    card = httpx.get(world.gateway.url + ".well-known/agent-card.json", timeout=10).json()
    upstream_card = httpx.get(world.upstream + ".well-known/agent-card.json", timeout=10).json()
    print(json.dumps(card, indent=1))
    interfaces = card["supportedInterfaces"]
    assert [i["url"] for i in interfaces if i["protocolBinding"] == "JSONRPC"] == [world.gateway.url]
    assert not [i for i in interfaces if i["url"].startswith(world.upstream)], "a way around the gateway"
    assert [i["protocolBinding"] for i in interfaces] == ["JSONRPC"], "interfaces the gateway does not serve are dropped"
    assert any(i["protocolBinding"] == "HTTP+JSON" for i in upstream_card["supportedInterfaces"])
    assert card["skills"] == upstream_card["skills"]
    assert card["name"] == upstream_card["name"]
    assert card["capabilities"].get("streaming") is True, "the gateway streams (SendStreamingMessage)"
