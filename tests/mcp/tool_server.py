"""A small fastmcp server for the gateway's end-to-end tests and benchmark.

Every tool with a side effect counts its executions in a file (one line per execution), so that
a test can tell how often an effect really ran, whatever the gateway answered.

    python tool_server.py --port 8000 --effects /tmp/effects.log
"""

import argparse
import asyncio
import json
import os

import mcp_types
from fastmcp import Context, FastMCP
from mcp_types import InputRequiredResult

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--effects", required=True)
args = parser.parse_args()

mcp = FastMCP("onceguard-test-tools")


COUNTS: dict[str, int] = {}


def record(tool: str, **details) -> int:
    """Appends one execution (durably); answers how many executions of `tool` this process ran."""
    with open(args.effects, "a") as f:
        f.write(json.dumps({"tool": tool, **details}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    COUNTS[tool] = COUNTS.get(tool, 0) + 1
    return COUNTS[tool]


@mcp.tool(annotations={"destructiveHint": True})
def send_email(to: str, body: str) -> dict:
    """Sends an email (counts it)."""
    n = record("send_email", to=to)
    return {"message_id": f"msg-{n}", "to": to}


@mcp.tool(annotations={"readOnlyHint": True})
def count_effects() -> int:
    """How many effects ran (read-only)."""
    if not os.path.exists(args.effects):
        return 0
    with open(args.effects) as f:
        return sum(1 for _ in f)


@mcp.tool()
async def slow_job(steps: int, ctx: Context, tag: str = "") -> dict:
    """Works for `steps` tenths of a second, reporting progress, then counts itself."""
    for step in range(steps):
        await ctx.report_progress(step + 1, steps, f"step {step + 1}")
        await asyncio.sleep(0.1)
    n = record("slow_job", steps=steps, tag=tag)
    return {"job": n, "steps": steps, "tag": tag}


@mcp.tool()
async def paced_job(steps: int, ctx: Context, tag: str) -> dict:
    """Reports `steps` progress notifications, each only after the client saw the one before.

    The client acknowledges step N by creating the file `ack-<tag>-<N>` beside the effects log.
    A gateway that held notifications back until the result would leave every step unacknowledged:
    the tool waits up to 5 s per step and reports which steps the client saw while it worked.
    """
    seen = []
    for step in range(1, steps + 1):
        await ctx.report_progress(step, steps, f"step {step}")
        ack = os.path.join(os.path.dirname(args.effects), f"ack-{tag}-{step}")
        for _ in range(500):
            if os.path.exists(ack):
                break
            await asyncio.sleep(0.01)
        seen.append(os.path.exists(ack))
    n = record("paced_job", steps=steps, tag=tag)
    return {"job": n, "acknowledged": seen, "tag": tag}


@mcp.tool()
def fail_tool(reason: str) -> str:
    """Always fails as a tool error (isError: true), after counting itself."""
    record("fail_tool")
    raise ValueError(f"refused: {reason}")


@mcp.tool()
async def transfer(amount: int, ctx: Context, tag: str = "") -> dict | InputRequiredResult:
    """Asks for confirmation (2026-07-28 input_required) before it counts a transfer."""
    responses = ctx.input_responses
    if not responses:
        return InputRequiredResult(
            result_type="input_required",
            input_requests={
                "confirm": mcp_types.ElicitRequest(
                    method="elicitation/create",
                    params=mcp_types.ElicitRequestFormParams(
                        mode="form",
                        message=f"Transfer {amount}?",
                        requested_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}},
                    ),
                )
            },
            request_state=f"amount={amount}",
        )
    answer = responses["confirm"]
    content = getattr(answer, "content", None) or {}
    if getattr(answer, "action", None) != "accept" or not content.get("ok"):
        return {"transferred": False}
    n = record("transfer", amount=amount, tag=tag)
    return {"transferred": True, "transfer_id": n}


if __name__ == "__main__":
    mcp.run(transport="http", host="127.0.0.1", port=args.port, path="/mcp", show_banner=False, log_level="warning")
