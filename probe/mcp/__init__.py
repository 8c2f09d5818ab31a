"""``probe mcp``: an MCP server (stdio) for coding agents, made with the official ``mcp`` SDK (the
optional extra ``rankprobe[mcp]``). See ``probe.mcp.server``."""
