"""A small stdio MCP server with one tool, `get_weather(city)`, for driving Codex with an MCP
server (the `mcp` package from PyPI). Each call is appended to $WEATHER_MCP_LOG when set."""
from __future__ import annotations

import json
import os

try:
    from mcp.server.mcpserver import MCPServer as Server  # mcp 2.x
except ImportError:
    from mcp.server.fastmcp import FastMCP as Server  # mcp 1.x

server = Server("weather")


@server.tool()
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    log = os.environ.get("WEATHER_MCP_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"tool": "get_weather", "city": city}) + "\n")
    return json.dumps({"city": city, "temperature_c": 18, "conditions": "sunny"})


if __name__ == "__main__":
    server.run()
