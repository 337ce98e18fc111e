"""What a request costs, in USD, by the rules of the seeds (GoModel's and Bud's billing):

- the provider's own figure wins: an upstream that reports ``usage.cost`` (OpenRouter) is charged what it says;
- a model or provider without a price costs nothing (local models cost 0 unless priced);
- ``per_request``: a flat price per call, whatever the tokens — only for a model that serves nothing but decisions,
  and the only price a provider that reports no tokens may have (a per-token price would make every call free);
- decisions answered in OpenAI's format (OpenAI's Decisions API, Azure) are billed on input tokens only, all of
  them at the input rate: output, cache reads and cache writes are free, as in OpenAI's Decisions API;
- any other answer (System One, local, ``/v1/score``, chat traffic): input tokens at the input rate — cached ones at
  ``cached_input_per_mtok`` when it is set — plus output tokens at the output rate;
- a long-context tier (``long_context: {above_tokens, input_per_mtok}``) sets the input rate of a request whose
  input tokens exceed ``above_tokens`` (the whole request, as providers bill it).

Prices are per million tokens. ``check_pricing`` applies the start-up rules with messages naming the entry.
"""

from __future__ import annotations

from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..canonical import DecisionRequest, ScoreRequest, Usage
from .chat import ChatRequest

MTOK = 1_000_000


class LongContext(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    above_tokens: int = Field(ge=1)
    """Requests with more input tokens than this..."""
    input_per_mtok: float = Field(ge=0)
    """...pay this input rate (USD per million tokens) for all of them."""


class Pricing(BaseModel):
    """A model's (or a provider's default) price."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    input_per_mtok: float | None = Field(default=None, ge=0)
    """USD per million input tokens."""
    output_per_mtok: float | None = Field(default=None, ge=0)
    """USD per million output tokens."""
    cached_input_per_mtok: float | None = Field(default=None, ge=0)
    """USD per million cached input tokens, where the upstream reports them."""
    long_context: LongContext | None = None
    """A higher input rate above a number of input tokens."""
    per_request: float | None = Field(default=None, ge=0)
    """Or a flat price per call, whatever the tokens."""

    @model_validator(mode="after")
    def _one_kind(self) -> "Pricing":
        if self.per_request is not None and self.per_token:
            raise ValueError("a price is per request or per token, not both")
        return self

    @property
    def per_token(self) -> bool:
        return any(v is not None for v in (self.input_per_mtok, self.output_per_mtok, self.cached_input_per_mtok,
                                           self.long_context))

    def input_rate(self, input_tokens: int) -> float:
        if self.long_context is not None and input_tokens > self.long_context.above_tokens:
            return self.long_context.input_per_mtok
        return self.input_per_mtok or 0.0


def check_pricing(where: str, pricing: Pricing | None, capabilities: Iterable[str] = ("decisions",),
                  reports_tokens: bool = True) -> None:
    """Bud's rules, at start-up: per-request only for a decisions-only model; no per-token price on a provider
    that reports no tokens. Raises ValueError naming ``where``."""
    if pricing is None:
        return
    caps = set(capabilities)
    if pricing.per_request is not None and caps != {"decisions"}:
        raise ValueError(f"{where}: a per_request price applies only to a model that serves nothing but decisions "
                         f"(this one serves {', '.join(sorted(caps))}); price it per token")
    if pricing.per_token and not reports_tokens:
        raise ValueError(f"{where}: this provider reports no token counts, so a per-token price would cost every "
                         "call nothing; give it a per_request price")


def billed_as(request: DecisionRequest | ScoreRequest | ChatRequest, provider_format: str) -> str:
    """The format a request is billed by: chat traffic as chat (input and output), ``/v1/score`` as a local call,
    a decision by the wire format that answers it (``provider_format``)."""
    if isinstance(request, ChatRequest):
        return "chat"
    return "local" if isinstance(request, ScoreRequest) else provider_format


def cost(pricing: Pricing | None, usage: Usage, provider_format: str) -> float:
    """The USD cost of one answered request (see the module docstring for the rules)."""
    if usage.cost is not None:
        return float(usage.cost)
    if pricing is None:
        return 0.0
    if pricing.per_request is not None:
        return pricing.per_request
    rate = pricing.input_rate(usage.input_tokens)
    if provider_format == "openai":  # OpenAI's Decisions API: input tokens only, all at the input rate
        return usage.input_tokens * rate / MTOK
    cached = min(usage.cached_tokens, usage.input_tokens) if pricing.cached_input_per_mtok is not None else 0
    return ((usage.input_tokens - cached) * rate + cached * (pricing.cached_input_per_mtok or 0.0)
            + usage.output_tokens * (pricing.output_per_mtok or 0.0)) / MTOK
