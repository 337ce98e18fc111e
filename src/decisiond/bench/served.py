"""The served-engine row of ``decisiond bench --served``: the benchmark's model served by llama.cpp's server
(llama-cpp-python on the model's GGUF, with as many threads as the in-process engine has) and read through decisiond's
``logprobs`` provider, beside the in-process engine on the same tickets, the two taking turns."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from ..canonical import DecisionRequest, DecisionResult
from ..engine.local import LocalEngine
from ..engine.model import DEFAULT_MODEL, ModelNotFound, default_gguf
from ..gateway.providers.logprobs import LogprobsProvider
from ..gateway.settings import ProviderConfig
from .services import LlamaCppServer, start_llamacpp


def gguf_of(model: str) -> Path:
    """The GGUF a model spec names (the embedded default, or a ``.gguf`` file): what llama.cpp's server runs."""
    if model in ("", DEFAULT_MODEL):
        return default_gguf()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ModelNotFound(f"--served runs the model in llama.cpp's server, which needs a GGUF: {model!r} is not one "
                        "(use default or a .gguf file)")


class ServedEngine:
    """llama.cpp's server on ``gguf`` and a logprobs provider in front of it (its own event loop, on a thread),
    answering decisions synchronously as the in-process engine does."""

    def __init__(self, gguf: Path, engine: LocalEngine, threads: int):
        self.server: LlamaCppServer = start_llamacpp(gguf, threads)
        config = ProviderConfig(name="llamacpp", type="logprobs", base_url=self.server.url, tokenizer=str(gguf),
                                timeout=600)
        self.provider = LogprobsProvider(config, engine.tokenizer, engine.name, engine.context_length)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def decide(self, request: DecisionRequest) -> DecisionResult:
        result: DecisionResult = self._run(self.provider.decide(request, self.server.model))
        return result

    def close(self) -> None:
        self._run(self.provider.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.server.stop()
