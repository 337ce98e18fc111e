"""The served-engine rows of ``decisiond bench --served``: the benchmark's model served by llama.cpp's server
(llama-cpp-python on the model's GGUF, with as many threads as the in-process engine has) and by vLLM (its CPU build,
in float32, on the GGUF de-quantized to a folder; where its environment is installed: ``tests/install_vllm.sh``),
each read through decisiond's ``logprobs`` provider, beside the in-process engine, the two taking turns on the same
tickets (each served engine on tickets of its own)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from ..canonical import DecisionRequest, DecisionResult
from ..engine.local import LocalEngine
from ..engine.model import DEFAULT_MODEL, ModelNotFound, converted_gguf, default_gguf
from ..gateway.providers.logprobs import LogprobsProvider
from ..gateway.settings import ProviderConfig
from .services import LlamaCppServer, Unavailable, VllmServer, start_llamacpp, start_vllm, vllm_python


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
    """A served model's ``server`` (named ``label``) and a logprobs provider in front of it (its own event loop, on a
    thread), answering decisions synchronously as the in-process engine does."""

    def __init__(self, server: LlamaCppServer | VllmServer, label: str, engine: LocalEngine, tokenizer: str):
        self.server, self.label = server, label
        config = ProviderConfig(name=label, type="logprobs", base_url=server.url, tokenizer=tokenizer, timeout=600)
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


def start_served(gguf: Path, engine: LocalEngine, threads: int, log: Any) -> list[ServedEngine]:
    """llama.cpp's server on ``gguf`` and, where its environment is installed, vLLM on the same weights."""
    served = [ServedEngine(start_llamacpp(gguf, threads), "llama.cpp's server", engine, str(gguf))]
    if vllm_python() is None:
        log("vLLM is not installed (tests/install_vllm.sh makes .venv-vllm): no vLLM row")
        return served
    log("starting vLLM …")
    try:
        server = start_vllm(converted_gguf(gguf), engine.name, context=engine.context_length)
    except Unavailable as error:
        log(f"vLLM did not start: {error}")
        return served
    served.append(ServedEngine(server, "vLLM", engine, str(gguf)))
    return served
