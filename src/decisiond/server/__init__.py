"""The HTTP surfaces: the FastAPI app (``app``), the decision routes (``routes``), chat, admin, MCP, metrics and the
playground. Each route reads its body (``payload``), parses it with a dialect, runs the gateway's pipeline and
renders the answer or the error in that same dialect."""
