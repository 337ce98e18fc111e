"""Virtual models as data: ``VirtualModelConfig`` (``failover``, ``alias``, ``cascade``) and the checks of the chains
they form (known names, no cycle, a bounded depth, cascades asked by name only). Pure: no I/O."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, model_validator

from ..limits import DECISION_RETENTION_DAYS

if TYPE_CHECKING:
    from .settings import GatewayConfig

MAX_CHAIN_DEPTH = 8


class VirtualModelConfig(BaseModel):
    """A name for other models: ``failover`` (the first target that answers), ``alias`` (one target), or ``cascade``
    (every question to the first target, those it is unsure of to the next: see ``gateway.cascade``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The name clients ask for."""
    strategy: Literal["failover", "alias", "cascade"] = "failover"
    """``failover``: the first target that answers; ``alias``: its one target; ``cascade``: every question to the first
    target, the unsure ones on to the next.
    """
    targets: list[str] = Field(min_length=1)
    """Models or virtual models, in order."""
    escalate_below: NonNegativeFloat | list[NonNegativeFloat] | None = None
    """cascade: a question goes on to the next target when its confidence is below this (one number for every step, or
    one per step but the last); 0 never escalates, above 1 always does.
    """
    deadline: float | None = Field(default=None, gt=0)
    """Seconds for the whole request across its attempts."""
    attempt_timeout: float | None = Field(default=None, gt=0)
    """Seconds for each attempt (else each provider's timeout)."""
    guardrails: list[str] = Field(default_factory=list)
    """Guardrails (by name) every request to it runs through."""
    cache: bool | None = None
    """Whether answers asked under this name are cached; None leaves it to the target that answers."""
    store: bool = False
    """Keep each decision asked under this name (for a cascade, every step's answers too), so that labels can be
    posted for it and its accuracy measured."""
    store_retention_days: int = Field(default=DECISION_RETENTION_DAYS, ge=1)
    """How long a stored decision is kept, in days (with its labels)."""

    @model_validator(mode="after")
    def _strategy_fits(self) -> "VirtualModelConfig":
        if self.strategy == "alias" and len(self.targets) != 1:
            raise ValueError(f"alias {self.name!r} must have exactly one target")
        if (self.strategy == "cascade") != (self.escalate_below is not None):
            raise ValueError(f"virtual model {self.name!r}: escalate_below goes with strategy cascade, and a cascade "
                             "needs it")
        if self.strategy == "cascade" and len(self.targets) < 2:
            raise ValueError(f"cascade {self.name!r} needs at least two targets")
        if isinstance(self.escalate_below, list) and len(self.escalate_below) != len(self.targets) - 1:
            raise ValueError(f"cascade {self.name!r}: escalate_below lists one threshold per step but the last "
                             f"({len(self.targets) - 1}), not {len(self.escalate_below)}")
        return self

    @property
    def thresholds(self) -> list[float]:
        """A cascade's threshold for each step but the last."""
        given = self.escalate_below if self.escalate_below is not None else 0.0
        return list(given) if isinstance(given, list) else [given] * (len(self.targets) - 1)


def known_model(config: GatewayConfig, name: str) -> bool:
    if any(m.name == name for m in config.models) or any(v.name == name for v in config.virtual_models):
        return True
    provider, _, upstream = name.partition("/")
    return bool(upstream) and any(p.name == provider for p in config.providers)


def check_chains(config: GatewayConfig) -> None:
    """Virtual models must name known models, form no cycle, and nest at most ``MAX_CHAIN_DEPTH`` deep."""
    virtual = {v.name: v for v in config.virtual_models}

    def depth(name: str, path: tuple[str, ...]) -> int:
        if name in path:
            raise ValueError(f"virtual models form a cycle: {' -> '.join(path + (name,))}")
        if name not in virtual:
            if not known_model(config, name):
                raise ValueError(f"virtual model {path[-1]!r} names unknown model {name!r}")
            return 0
        if path and virtual[name].strategy == "cascade":  # its steps are calls of their own, not one attempt
            raise ValueError(f"virtual model {path[-1]!r} names the cascade {name!r}; a cascade is asked by name only")
        return 1 + max(depth(t, path + (name,)) for t in virtual[name].targets)

    for name in virtual:
        if depth(name, ()) > MAX_CHAIN_DEPTH:
            raise ValueError(f"virtual model {name!r} nests more than {MAX_CHAIN_DEPTH} levels deep")
