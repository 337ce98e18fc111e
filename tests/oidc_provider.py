"""A small, real OpenID Connect identity provider for the console's tests, on loopback: a discovery document, a JWKS,
an authorize endpoint that signs in ``provider.user`` at once and redirects back with a code, and a token endpoint
that checks the client (HTTP Basic), the code (once, for its client and redirect URI) and the PKCE verifier (S256)
and returns an RS256 ID token signed with a test key.

``provider.tamper`` makes the next ID tokens wrong in one way, for the refusals: ``expired``, ``audience``,
``issuer``, ``signature`` (signed by another key under the published key id), ``nonce``."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

CLIENT_ID = "decisiond-console"
CLIENT_SECRET = "console-client-secret-0123456789"


@dataclass
class Grant:
    client_id: str
    redirect_uri: str
    challenge: str
    nonce: str
    claims: dict[str, Any]


@dataclass
class Provider:
    """The identity provider; ``user``: the claims of whoever signs in next (``sub``, ``email``, ``groups``)."""

    user: dict[str, Any] = field(default_factory=lambda: {"sub": "u-1", "email": "ada@example.com",
                                                          "groups": ["decisiond-admins"]})
    tamper: str | None = None
    redirect_uris: set[str] = field(default_factory=set)
    grants: dict[str, Grant] = field(default_factory=dict)
    token_requests: list[dict[str, Any]] = field(default_factory=list)
    # The host name in its URLs: "localhost" makes it another site than a gateway on 127.0.0.1 (SameSite).
    host: str = "127.0.0.1"
    server: ThreadingHTTPServer | None = None

    def __post_init__(self) -> None:
        self.key = RSAKey.generate_key(2048, parameters={"kid": "test-key-1", "use": "sig", "alg": "RS256"})
        # Another key under the same id: a token it signs has a signature the published key does not verify.
        self.forger = RSAKey.generate_key(2048, parameters={"kid": "test-key-1", "use": "sig", "alg": "RS256"})

    @property
    def issuer(self) -> str:
        return f"http://{self.host}:{self.server.server_address[1]}"

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.issuer, "authorization_endpoint": self.issuer + "/authorize",
                "token_endpoint": self.issuer + "/token", "jwks_uri": self.issuer + "/jwks",
                "response_types_supported": ["code"], "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["RS256"], "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": ["client_secret_basic"]}

    def jwks(self) -> dict[str, Any]:
        return KeySet([self.key]).as_dict(private=False)

    def authorize(self, query: dict[str, str]) -> tuple[int, dict[str, str], Any]:
        if query.get("client_id") != CLIENT_ID or query.get("response_type") != "code":
            return 400, {}, {"error": "unauthorized_client"}
        if query.get("redirect_uri") not in self.redirect_uris:
            return 400, {}, {"error": "invalid_request", "error_description": "redirect_uri not registered"}
        if query.get("code_challenge_method") != "S256" or not query.get("code_challenge"):
            return 400, {}, {"error": "invalid_request", "error_description": "PKCE S256 required"}
        if "openid" not in query.get("scope", "").split():
            return 400, {}, {"error": "invalid_scope"}
        code = secrets.token_urlsafe(24)
        self.grants[code] = Grant(CLIENT_ID, query["redirect_uri"], query["code_challenge"], query.get("nonce", ""),
                                  dict(self.user))
        location = query["redirect_uri"] + "?" + urlencode({"code": code, "state": query.get("state", "")})
        return 302, {"location": location}, b""

    def token(self, form: dict[str, str], authorization: str | None) -> tuple[int, dict[str, str], Any]:
        self.token_requests.append(dict(form))
        expected = "Basic " + base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
        if authorization != expected:
            return 401, {}, {"error": "invalid_client"}
        grant = self.grants.pop(form.get("code", ""), None)  # a code is good once
        if form.get("grant_type") != "authorization_code" or grant is None or \
                form.get("redirect_uri") != grant.redirect_uri:
            return 400, {}, {"error": "invalid_grant"}
        verifier = form.get("code_verifier", "")
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        if challenge != grant.challenge:
            return 400, {}, {"error": "invalid_grant", "error_description": "PKCE verification failed"}
        return 200, {}, {"access_token": secrets.token_urlsafe(16), "token_type": "Bearer", "expires_in": 300,
                         "id_token": self.id_token(grant)}

    def id_token(self, grant: Grant) -> str:
        now = int(time.time())
        claims = {"iss": self.issuer, "aud": CLIENT_ID, "iat": now, "exp": now + 300, "nonce": grant.nonce,
                  "auth_time": now, **grant.claims}
        tamper = self.tamper
        if tamper == "expired":
            claims.update(iat=now - 900, exp=now - 600)
        elif tamper == "audience":
            claims["aud"] = "another-client"
        elif tamper == "issuer":
            claims["iss"] = "https://idp.example.com"
        elif tamper == "nonce":
            claims["nonce"] = "not-the-nonce"
        key = self.forger if tamper == "signature" else self.key
        return jwt.encode({"alg": "RS256", "kid": "test-key-1", "typ": "JWT"}, claims, key)

    def start(self) -> "Provider":
        provider = self

        class Handle(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, answer: tuple[int, dict[str, str], Any]) -> None:
                status, headers, body = answer
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("cache-control", "no-store")
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                if parts.path == "/.well-known/openid-configuration":
                    self._answer((200, {}, provider.discovery()))
                elif parts.path == "/jwks":
                    self._answer((200, {}, provider.jwks()))
                elif parts.path == "/authorize":
                    self._answer(provider.authorize(query))
                else:
                    self._answer((404, {}, {"error": "not_found"}))

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                if urlsplit(self.path).path == "/token":
                    self._answer(provider.token(form, self.headers.get("authorization")))
                else:
                    self._answer((404, {}, {"error": "not_found"}))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handle)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
