"""A fastmcp server whose `pay` tool runs as a background task (the 2026-07-28 tasks extension,
from `fastmcp-tasks`), for the gateway's end-to-end tests of delegated keys.

Each execution appends a line to the effects file, so a test can tell how often it really ran.

    python task_server.py --port 8000 --effects /tmp/effects.log
"""

import argparse
import asyncio
import json
import os

from fastmcp import FastMCP
from fastmcp_tasks import TasksExtension

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--effects", required=True)
args = parser.parse_args()

mcp = FastMCP("onceguard-task-tools")
mcp.add_extension(TasksExtension(url="memory://"))


@mcp.tool(task=True, annotations={"destructiveHint": True})
async def pay(amount: int, tag: str, seconds: float = 0.5) -> dict:
    """Pays `amount` after `seconds` (counts the payment)."""
    await asyncio.sleep(seconds)
    with open(args.effects, "a") as f:
        f.write(json.dumps({"tool": "pay", "tag": tag}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return {"paid": amount, "tag": tag}


if __name__ == "__main__":
    mcp.run(transport="http", host="127.0.0.1", port=args.port, path="/mcp", show_banner=False, log_level="warning")
