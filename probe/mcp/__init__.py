"""``probe mcp``: an MCP server (stdio) for coding agents, made with the official ``mcp`` SDK (the
optional extra ``probe[mcp]``). See ``probe.mcp.server``."""
