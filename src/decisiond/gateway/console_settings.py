"""The ``console`` section of the gateway's config: the operator's console (``/console``, ``server.console``), its
sessions and its single sign-on with OpenID Connect (``server.console_oidc``). Its own module, beside ``settings``,
which holds it as ``GatewayConfig.console``."""

from __future__ import annotations

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Signature algorithms an ID token may use: asymmetric only (a shared-secret HS256 token could be forged by anyone
# who holds the client secret; ``none`` is never accepted).
ID_TOKEN_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint_url(value: str, what: str) -> str:
    """An identity provider's URL: ``https``, or ``http`` on a loopback host only (a provider on this machine);
    no fragment, no credentials in it."""
    parts = urlsplit(value)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"{what} must be an https URL, got {value[:100]!r}")
    if parts.scheme == "http" and not _loopback(parts.hostname):
        raise ValueError(f"{what} must be https (http only on a loopback host), got {value[:100]!r}")
    if parts.fragment or parts.username or parts.password:
        raise ValueError(f"{what} may carry no fragment and no credentials")
    return value


class OidcConfig(BaseModel):
    """Single sign-on to the console with OpenID Connect: the authorization code flow with PKCE (S256) against the
    operator's identity provider, found by its discovery document (``<issuer>/.well-known/openid-configuration``).
    An ID token's signature (by a key of the provider's JWKS, asymmetric algorithms only), issuer, audience, expiry
    and nonce are checked; a claim of it gives the console role."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    issuer: str = Field(min_length=1, max_length=2000)
    """The identity provider's issuer URL, exactly as its ID tokens' ``iss`` says (https; http only on a loopback
    host)."""
    client_id: str = Field(min_length=1, max_length=500)
    """The console's client id at the identity provider: ID tokens must name it in their audience."""
    client_secret: str | None = Field(default=None, min_length=1, max_length=2000, repr=False)
    """The client secret of a confidential client (e.g. ``${OIDC_CLIENT_SECRET}``), sent to the token endpoint
    (HTTP Basic, or in the form where the provider supports only that); unset: a public client, PKCE alone."""
    redirect_uri: str | None = Field(default=None, max_length=2000)
    """The callback URL registered at the identity provider, ending in ``/console/oidc/callback``; unset: this
    server's own URL as the request reached it (set it behind a proxy that rewrites the host or scheme)."""
    scopes: list[str] = Field(default_factory=lambda: ["openid", "profile", "email"], min_length=1, max_length=20)
    """The scopes asked for; ``openid`` is always among them."""
    role_claim: str = Field(default="groups", min_length=1, max_length=200)
    """The ID token claim that gives the role: a string or a list of strings; a dotted name reaches into an object
    (``realm_access.roles``)."""
    admin_values: list[str] = Field(min_length=1, max_length=100)
    """Values of ``role_claim`` that make the signed-in person an admin (every console action)."""
    read_only_values: list[str] = Field(default_factory=list, max_length=100)
    """Values of ``role_claim`` that make the signed-in person read-only (every page, no change)."""
    default_role: Literal["none", "read_only"] = "none"
    """The role of someone the identity provider signed in whose claim holds none of those values: refused
    (``none``, the default) or read-only."""
    name_claim: str = Field(default="email", min_length=1, max_length=200)
    """The claim shown as who signed in, and written on the access log of each console action (``sub`` when the
    token has none)."""
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256", "PS256"], min_length=1)
    """The signature algorithms an ID token may use: asymmetric ones only."""
    leeway_s: int = Field(default=60, ge=0, le=300)
    """Clock skew allowed on an ID token's ``exp`` and ``iat``, in seconds."""
    timeout_s: float = Field(default=10.0, gt=0, le=60)
    """How long a call to the identity provider (discovery, keys, token) may take."""

    @field_validator("issuer")
    @classmethod
    def _issuer(cls, value: str) -> str:
        return check_endpoint_url(value, "issuer")

    @field_validator("redirect_uri")
    @classmethod
    def _redirect(cls, value: str | None) -> str | None:
        if value is not None and not urlsplit(value).path.endswith("/console/oidc/callback"):
            raise ValueError("redirect_uri must end in /console/oidc/callback")
        return check_endpoint_url(value, "redirect_uri") if value is not None else None

    @field_validator("algorithms")
    @classmethod
    def _algorithms(cls, value: list[str]) -> list[str]:
        unknown = [a for a in value if a not in ID_TOKEN_ALGORITHMS]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not an asymmetric signature algorithm "
                             f"({', '.join(ID_TOKEN_ALGORITHMS)})")
        return value

    @model_validator(mode="after")
    def _openid(self) -> "OidcConfig":
        if "openid" not in self.scopes:
            self.scopes = ["openid", *self.scopes]
        if set(self.admin_values) & set(self.read_only_values):
            raise ValueError("a value cannot be in both admin_values and read_only_values")
        return self


class ConsoleConfig(BaseModel):
    """The operator's console (``/console``): one page on the admin API. Sign-in with the master key, or with
    OpenID Connect (``oidc``); the session is a signed cookie (HttpOnly, SameSite=Strict, Secure over https) and
    every change it makes carries its CSRF token."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = True
    """Whether ``/console`` and its sign-in routes answer (404 when off)."""
    session_ttl_s: int = Field(default=8 * 3600, ge=60, le=7 * 86400)
    """How long a console session lasts after sign-in, in seconds."""
    session_secret: str | None = Field(default=None, min_length=32, repr=False)
    """The secret sessions are signed with (e.g. ``${DECISIOND_CONSOLE_SECRET}``), shared by replicas; unset: one
    derived from the master key (a new master key ends every session). Single sign-on on a server without a master
    key needs it."""
    secure_cookie: bool | None = None
    """Whether the session cookie is ``Secure`` (sent over https only); unset: when the request came over https
    (behind a TLS proxy, run uvicorn with ``--proxy-headers`` or set this to true)."""
    sign_in_failures_per_minute: int = Field(default=10, ge=1, le=1000)
    """Failed sign-ins one client address may make in a minute; past it every sign-in from that address is refused
    (429) until the minute is over. All addresses together may fail ten times as often."""
    oidc: OidcConfig | None = None
    """Single sign-on with OpenID Connect; unset: the master key alone signs in."""
