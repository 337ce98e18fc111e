"""Decision models in this process: ``Engine`` answers through the same gateway pipeline as the server (limits,
model names, validation), and ``load`` builds one from a model name, folder, ``.gguf`` or hub id."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from .decider import Decider, LoopThread, T

if TYPE_CHECKING:
    from ..engine.local import LocalEngine
    from ..gateway.router import Router
    from ..gateway.service import Gateway


class Engine(Decider):
    """Decision models in this process, behind the same gateway pipeline as the server (limits, model names,
    validation). Build one with ``load()``, or from a ``LocalEngine`` or a configured ``Router``.

    Examples:
        >>> engine = decisiond.load("default")                                   # doctest: +SKIP
        >>> engine.decide("The app crashes on start.", [Predicate("bug", "Is this a bug report?")])["bug"].probability
        0.87
    """

    def __init__(self, source: LocalEngine | Router, model: str = "default"):
        from ..gateway.router import Router
        from ..gateway.service import Gateway

        self.router = source if isinstance(source, Router) else Router.local_only(source)
        self.gateway: Gateway = Gateway(self.router)
        self.model = model
        self._loop = LoopThread()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coroutine)

    async def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.gateway.answer_openai(body)

    def models(self) -> list[str]:
        """The names this engine answers to (``default`` too)."""
        return [m.name for m in self.router.catalog.model_list("decisions")]

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(model: str = "default", *, dtype: str = "float32", device: str = "auto", served_name: str | None = None,
         order: str = "given", calibrate: str = "none", calibration: str | None = None,
         **scheduling: Any) -> Engine:
    """Load a model into this process: ``"default"`` (the embedded SmolLM2-135M-Instruct), a Hugging Face folder,
    a ``.gguf`` file or a hub id. ``order``/``calibrate`` are the model's quality defaults, ``calibration`` a
    profile written by ``decisiond calibrate``; ``max_batch_tokens``/``max_wait_s`` tune batching.

    Examples:
        >>> engine = decisiond.load("default", order="cyclic")                   # doctest: +SKIP
    """
    from ..engine import model as model_mod
    from ..engine.calibration import Profile
    from ..engine.local import LocalEngine

    profile = Profile.load(calibration) if calibration else None  # a file that is not one: refused before the load
    loaded = model_mod.load(model, dtype=dtype, device=device, served_name=served_name)
    return Engine(LocalEngine(loaded, order=order, calibrate=calibrate, profile=profile, **scheduling))
