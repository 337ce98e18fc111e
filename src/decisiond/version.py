"""decisiond's version, in one place (the package, the server, the MCP server and the CLI read it)."""

__version__ = "0.1.0"
