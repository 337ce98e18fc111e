"""decisiond as an MCP server (the official ``mcp`` package): tools ``decide`` (input + questions → answers) and
``list_models``, over stdio (``decisiond mcp``) or streamable HTTP at ``/mcp`` on the HTTP server.

Over HTTP the endpoint sits behind the same keys as every other route (``Authorization: Bearer <key>``, checked
by ``gateway.stages.auth.Authenticator`` before the MCP transport sees the request; a key's model allowlist and rate
limits apply to its tool calls, which run through the same gateway pipeline as ``POST /v1/decisions``). Over stdio
the caller is whoever started the process.
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..dialects import openai as openai_dialect
from ..errors import DecisionError, openai_param
from ..gateway.service import Gateway
from ..gateway.stages.allowlist import allowed
from ..gateway.types import Caller
from ..library.answers import Decision
from ..limits import BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from ..version import __version__
from .boundary import Refused, refusing
from .payload import read_body

INSTRUCTIONS = (
    "decisiond answers typed questions about an input with a probability for every option. Call `decide` with "
    "the input text and questions such as {\"type\": \"predicate\", \"name\": \"billing\", \"instructions\": "
    "\"Is this about billing?\"}, {\"type\": \"choice\", \"name\": \"team\", \"instructions\": \"Which team?\", "
    "\"choices\": [{\"value\": \"billing\"}, {\"value\": \"shipping\"}]} or {\"type\": \"score\", \"name\": "
    "\"urgency\", \"instructions\": \"How urgent?\", \"levels\": [{\"label\": \"low\"}, {\"label\": \"high\"}]}. "
    "`list_models` names the models you may use."
)


async def _caller(gateway: Gateway, ctx: Context | None) -> Caller:
    """The HTTP caller's key (re-read from the request's headers), or the local user over stdio."""
    request = ctx.request_context.request if ctx is not None else None
    headers = getattr(request, "headers", None)
    if headers is None:
        return Caller()
    try:
        return await gateway.auth.authenticate(headers)
    except DecisionError as error:
        raise ToolError(error.message) from None


def build(gateway: Gateway) -> MCPServer:
    """The MCP server over ``gateway``: its pipeline answers, its router lists the models."""
    server: MCPServer = MCPServer("decisiond", instructions=INSTRUCTIONS, version=__version__)

    @server.tool(description=(
        "Answer questions about an input with a probability per option. `input`: the text (or OpenAI input "
        "items). `questions`: OpenAI-shaped questions (predicate | choice | score). `model`: a name from "
        "list_models, or 'default'. `order` ('given' | 'cyclic') and `calibrate` ('none' | 'contextual') are "
        "the quality modes. Returns each answer with its probabilities, confidence and label_mass."))
    async def decide(input: str | list[dict[str, Any]], questions: list[dict[str, Any]], ctx: Context,
                     model: str = "default", order: str | None = None,
                     calibrate: str | None = None) -> dict[str, Any]:
        caller = await _caller(gateway, ctx)
        body: dict[str, Any] = {"model": model, "input": input, "questions": questions}
        body.update({k: v for k, v in (("order", order), ("calibrate", calibrate)) if v is not None})
        try:
            response = await gateway.answer_openai(body, caller, request_type="mcp")
        except DecisionError as error:
            param = openai_param(error.path)
            raise ToolError(f"{error.code} ({error.status}){f' at {param}' if param else ''}: "
                            f"{openai_dialect.error_message(error)}") from None
        return Decision.from_response(response).to_dict()

    @server.tool(description="The decision models this caller may use, with their descriptions.")
    async def list_models(ctx: Context) -> list[dict[str, Any]]:
        caller = await _caller(gateway, ctx)
        router = gateway.router
        return [{"name": m.name, "description": m.description, "owned_by": m.owned_by}
                for m in router.catalog.model_list("decisions") if allowed(router.catalog, caller, m.name)]

    return server


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over the body already read, then whatever the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class KeyedEndpoint:
    """Pure ASGI: the caller's key is checked (401 in OpenAI's error shape) and the body is read under the server's
    body limits (413, 408, as on every route) before the MCP transport runs."""

    def __init__(self, app: ASGIApp, gateway: Gateway, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_read_timeout: float = BODY_READ_TIMEOUT_S):
        self.app = app
        self.gateway = gateway
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout = body_read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                admitted = await refusing(self._admit(scope, receive), scope, receive, send)
            except ClientDisconnect:
                return
            if isinstance(admitted, Refused):
                return
            caller, receive = admitted
            fields = scope.get("state", {}).get("log")
            if isinstance(fields, dict) and caller.key_id is not None:
                fields["key_id"] = caller.key_id
        await self.app(scope, receive, send)

    async def _admit(self, scope: Scope, receive: Receive) -> tuple[Caller, Receive]:
        """The caller, and a ``receive`` that hands the body over again once it is read (a POST's)."""
        caller = await self.gateway.auth.authenticate(Headers(scope=scope))
        if scope.get("method") == "POST":
            body = await read_body(Request(scope, receive), self.max_body_bytes, self.body_read_timeout)
            receive = _replay(body, receive)
        return caller, receive


def http_endpoint(server: MCPServer, gateway: Gateway, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                  body_read_timeout: float = BODY_READ_TIMEOUT_S) -> ASGIApp:
    """The streamable HTTP endpoint, keyed. Run ``server.session_manager.run()`` in the app's lifespan.

    Without keys the MCP package's DNS-rebinding protection stays on (loopback hosts only); with keys a browser
    page cannot call it without the key, and the server may sit behind any host name."""
    security = TransportSecuritySettings(enable_dns_rebinding_protection=False) if gateway.auth.enabled else None
    server.streamable_http_app(streamable_http_path="/mcp", stateless_http=True, json_response=True,
                               transport_security=security)
    return KeyedEndpoint(StreamableHTTPASGIApp(server.session_manager), gateway, max_body_bytes, body_read_timeout)
