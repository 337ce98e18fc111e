"""Single sign-on to the console with OpenID Connect: the authorization code flow with PKCE (RFC 7636, S256).

1. ``start``: a fresh ``state``, ``nonce`` and code verifier; the browser goes to the provider's
   ``authorization_endpoint`` (from its discovery document, whose ``issuer`` must be the configured one) with the
   verifier's S256 challenge. The three values ride a signed, short-lived cookie of the sign-in (``server.console``).
2. ``identity``: back at ``/console/oidc/callback`` with a code, the code and the verifier go to the
   ``token_endpoint`` (with the client secret of a confidential client); the ID token that comes back is checked by
   ``joserfc``: a compact JWS signed with a key of the provider's JWKS (read again once when its key id is unknown)
   by one of the configured asymmetric algorithms; ``iss`` the issuer; ``aud`` holding the client id (``azp`` it
   too, when there are several audiences); ``exp`` in the future and ``iat`` not in it (``leeway_s``); ``nonce``
   the one sent. The role comes from ``role_claim``.

Every refusal is an ``OidcRefused`` with a short code (``token_expired``, ``wrong_audience``, ``wrong_issuer``,
``bad_signature``, ``nonce_mismatch``, ``no_role``…) and a message that holds no token, code or secret.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
from joserfc import jwt
from joserfc.errors import (
    BadSignatureError,
    ExpiredTokenError,
    InvalidClaimError,
    InvalidKeyIdError,
    JoseError,
    MissingClaimError,
    UnsupportedAlgorithmError,
)
from joserfc.jwk import KeySet

from ..gateway.console_settings import OidcConfig, check_endpoint_url

DISCOVERY_PATH = "/.well-known/openid-configuration"
CACHE_S = 3600.0
JWKS_REFRESH_MIN_S = 30.0
MAX_DOCUMENT_BYTES = 256 * 1024


class OidcRefused(Exception):
    """A sign-in refused: ``code`` for the page, ``message`` for the log (neither holds a token or secret)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class LoginState:
    """What a sign-in must find again at the callback: the state, the nonce and the PKCE code verifier."""

    state: str
    nonce: str
    verifier: str


@dataclass(frozen=True)
class Identity:
    subject: str
    name: str
    role: str


def challenge(verifier: str) -> str:
    """The S256 code challenge of a PKCE verifier: base64url(SHA-256(verifier)), unpadded."""
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).rstrip(b"=").decode()


def claim(claims: dict[str, Any], dotted: str) -> Any:
    """A claim by a dotted name (``realm_access.roles``); None when absent."""
    value: Any = claims
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def role_of(config: OidcConfig, claims: dict[str, Any]) -> str | None:
    """``admin`` when the role claim (a string or a list of strings) holds one of ``admin_values``, else
    ``read_only`` for one of ``read_only_values`` or by ``default_role``; None: no role."""
    value = claim(claims, config.role_claim)
    held = {value} if isinstance(value, str) else {v for v in value if isinstance(v, str)} \
        if isinstance(value, list) else set()
    if held & set(config.admin_values):
        return "admin"
    if held & set(config.read_only_values) or config.default_role == "read_only":
        return "read_only"
    return None


class OidcClient:
    """The console's client of one identity provider: its discovery document and keys are read on first use and
    kept ``CACHE_S`` seconds."""

    def __init__(self, config: OidcConfig, http: httpx.AsyncClient | None = None):
        self.config = config
        self.http = http or httpx.AsyncClient(timeout=config.timeout_s, follow_redirects=False)
        self._metadata: tuple[float, dict[str, Any]] | None = None
        self._keys: tuple[float, KeySet] | None = None

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _json(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        try:
            answer = await self.http.request(method, url, **kwargs)
        except httpx.HTTPError as error:
            raise OidcRefused("provider_unreachable", f"the identity provider did not answer: "
                                                      f"{type(error).__name__}") from None
        if len(answer.content) > MAX_DOCUMENT_BYTES:
            raise OidcRefused("provider_error", f"the identity provider's answer from {url[:200]} is too large")
        try:
            body = answer.json()
        except ValueError:
            body = None
        if answer.status_code != 200 or not isinstance(body, dict):
            said = body.get("error") if isinstance(body, dict) else None
            raise OidcRefused("provider_error", f"the identity provider answered {answer.status_code} from "
                                                f"{url[:200]}" + (f" ({str(said)[:100]})" if said else ""))
        return dict(body)

    async def metadata(self) -> dict[str, Any]:
        """The discovery document: its ``issuer`` the configured one, its endpoints https (http on loopback)."""
        if self._metadata is not None and self._metadata[0] > time.monotonic():
            return self._metadata[1]
        url = self.config.issuer.rstrip("/") + DISCOVERY_PATH
        document = await self._json("GET", url)
        if document.get("issuer") != self.config.issuer:
            raise OidcRefused("provider_error", "the discovery document names another issuer than the configured "
                                                f"one ({str(document.get('issuer'))[:200]!r})")
        for name in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            value = document.get(name)
            try:
                check_endpoint_url(value if isinstance(value, str) else "", name)
            except ValueError as error:
                raise OidcRefused("provider_error", f"the discovery document's {error}") from None
        self._metadata = (time.monotonic() + CACHE_S, document)
        return document

    async def keys(self, refresh: bool = False) -> KeySet:
        """The provider's signing keys (JWKS); ``refresh``: read again, at most every ``JWKS_REFRESH_MIN_S``."""
        now = time.monotonic()
        if self._keys is not None and (self._keys[0] > now if not refresh else
                                       self._keys[0] - CACHE_S + JWKS_REFRESH_MIN_S > now):
            return self._keys[1]
        document = await self._json("GET", (await self.metadata())["jwks_uri"])
        try:
            keys = KeySet.import_key_set(document)  # type: ignore[arg-type]
        except (JoseError, ValueError, KeyError, TypeError):
            raise OidcRefused("provider_error", "the identity provider's JWKS holds no usable key") from None
        self._keys = (now + CACHE_S, keys)
        return keys

    async def start(self, redirect_uri: str) -> tuple[str, LoginState]:
        """The authorization URL to send the browser to, and the state to find again at the callback."""
        login = LoginState(secrets.token_urlsafe(24), secrets.token_urlsafe(24), secrets.token_urlsafe(48))
        query = {"response_type": "code", "client_id": self.config.client_id, "redirect_uri": redirect_uri,
                 "scope": " ".join(self.config.scopes), "state": login.state, "nonce": login.nonce,
                 "code_challenge": challenge(login.verifier), "code_challenge_method": "S256"}
        endpoint = (await self.metadata())["authorization_endpoint"]
        return endpoint + ("&" if "?" in endpoint else "?") + urlencode(query), login

    async def exchange(self, code: str, login: LoginState, redirect_uri: str) -> str:
        """The ID token the token endpoint gives for ``code`` and the PKCE verifier."""
        metadata = await self.metadata()
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                "code_verifier": login.verifier, "client_id": self.config.client_id}
        auth: httpx.BasicAuth | None = None
        secret = self.config.client_secret
        if secret is not None:
            methods = metadata.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
            if "client_secret_basic" in methods:
                auth = httpx.BasicAuth(self.config.client_id, secret)
            else:
                form["client_secret"] = secret
        body = await self._json("POST", metadata["token_endpoint"], data=form, auth=auth,
                                headers={"accept": "application/json"})
        token = body.get("id_token")
        if not isinstance(token, str) or not token:
            raise OidcRefused("provider_error", "the token endpoint returned no id_token")
        return token

    async def identity(self, id_token: str, login: LoginState) -> Identity:
        """Who an ID token says signed in, and their role, once it has passed every check (module docstring)."""
        claims = await self._verified(id_token)
        config = self.config
        registry = jwt.JWTClaimsRegistry(
            leeway=config.leeway_s, iss={"essential": True, "value": config.issuer},
            aud={"essential": True, "value": config.client_id}, sub={"essential": True},
            exp={"essential": True}, iat={"essential": True}, nonce={"essential": True, "value": login.nonce})
        try:
            registry.validate(claims)
        except ExpiredTokenError:
            raise OidcRefused("token_expired", "the ID token has expired") from None
        except (InvalidClaimError, MissingClaimError) as error:
            raise _claim_refusal(error) from None
        except JoseError as error:
            raise OidcRefused("invalid_token", f"the ID token was refused: {type(error).__name__}") from None
        audience = claims["aud"]
        if isinstance(audience, list) and len(audience) > 1 and claims.get("azp") != config.client_id:
            raise OidcRefused("wrong_audience", "the ID token has several audiences and another authorized party")
        if not isinstance(claims["iat"], (int, float)) or claims["iat"] > time.time() + config.leeway_s:
            raise OidcRefused("invalid_token", "the ID token was issued in the future")
        role = role_of(config, claims)
        if role is None:
            raise OidcRefused("no_role", f"the ID token's {config.role_claim} claim grants no console role")
        name = claim(claims, config.name_claim)
        subject = str(claims["sub"])[:200]
        return Identity(subject, str(name)[:200] if isinstance(name, str) and name else subject, role)

    async def _verified(self, id_token: str) -> dict[str, Any]:
        """The claims of an ID token whose signature holds (a compact JWS by a key of the JWKS)."""
        if id_token.count(".") != 2 or len(id_token) > 16384:
            raise OidcRefused("invalid_token", "the ID token is not a compact JWS")
        for refresh in (False, True):
            keys = await self.keys(refresh)
            try:
                return dict(jwt.decode(id_token, keys, algorithms=self.config.algorithms).claims)
            except InvalidKeyIdError:
                if refresh:
                    raise OidcRefused("bad_signature", "the ID token is signed by a key the provider does not "
                                                       "publish") from None
            except BadSignatureError:
                raise OidcRefused("bad_signature", "the ID token's signature does not hold") from None
            except UnsupportedAlgorithmError:
                raise OidcRefused("bad_signature", "the ID token is signed with an algorithm not allowed") from None
            except (JoseError, ValueError) as error:
                raise OidcRefused("invalid_token", f"the ID token cannot be read: {type(error).__name__}") from None
        raise AssertionError("unreachable")


def _claim_refusal(error: InvalidClaimError | MissingClaimError) -> OidcRefused:
    """An invalid or missing claim (``error.claim``: its name, or the missing names joined by commas) as a
    refusal: ``wrong_issuer``, ``wrong_audience``, ``nonce_mismatch`` or ``invalid_token``."""
    names = set(error.claim.split(","))
    missing = isinstance(error, MissingClaimError)
    for name, code in (("iss", "wrong_issuer"), ("aud", "wrong_audience"), ("nonce", "nonce_mismatch")):
        if name in names:
            said = "missing" if missing else "not the expected one"
            return OidcRefused(code, f"the ID token's {name} claim is {said}")
    return OidcRefused("invalid_token", f"the ID token's {error.claim[:60]} claim is "
                                        f"{'missing' if missing else 'invalid'}")
