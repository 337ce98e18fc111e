"""How a ``type: logprobs`` provider reads a served model's log-probabilities (``gateway.providers.logprobs``): the
provider entry's ``logprobs:`` block. Pure configuration; no I/O."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's most top_logprobs, and vLLM's default --max-logprobs.
DEFAULT_TOP_LOGPROBS = 20
DEFAULT_CONCURRENCY = 8


class LogprobsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    prompt: Literal["text", "ids"] = "text"
    """api completions: how the rendered prompt is sent. ``text`` (every server; llama-cpp-python and Ollama take no
    other): the server tokenizes it, and decisiond checks it counted the tokens decisiond did (``usage``) and refuses an
    input whose text would tokenize into control tokens; ``ids``: decisiond's token ids as they are (vLLM, SGLang,
    llama.cpp's own server), for models whose server would add tokens to a text prompt (a second BOS)."""
    top_logprobs: int = Field(default=DEFAULT_TOP_LOGPROBS, ge=1, le=1000)
    """How many next-token log-probabilities each request asks the server for (OpenAI's and vLLM's default cap: 20;
    vLLM's ``--max-logprobs`` raises it). A question may have at most this many options or levels here."""
    restrict: Literal["logit_bias", "allowed_token_ids", "none"] = "logit_bias"
    """When a label is not among the top log-probabilities, a second read of the same prompt restricted to the labels:
    ``logit_bias`` (+100 on each label token: OpenAI, llama.cpp, SGLang, vLLM), vLLM's ``allowed_token_ids``, or
    ``none`` (servers that take neither, as Ollama). It needs the labels' token ids, so a ``tokenizer``."""
    widen_to: int = Field(default=1000, ge=0, le=200_000)
    """Where a label is still missing (a server that reads its log-probabilities before it restricts the answer:
    llama.cpp's servers, vLLM's default ``raw_logprobs``), one more plain read of this many top log-probabilities:
    llama-cpp-python takes any number, vLLM at most its ``--max-logprobs`` (a larger number is the server's 400,
    named in the error). 0: no such read."""
    server: Literal["auto", "vllm", "sglang", "llamacpp", "ollama", "openai", "generic"] = "auto"
    """Which server this is, for the fields it takes beyond OpenAI's (``dialects.served_servers``): vLLM's
    ``logprob_token_ids`` (every label read by its id, in one request), the sampling settings that keep a read exact,
    the fields that keep thinking off. ``auto``: read from the server's ``/v1/models`` (its ``owned_by``), and read
    again every few minutes; ``generic``: OpenAI's fields only."""
    concurrency: int = Field(default=DEFAULT_CONCURRENCY, ge=1, le=256)
    """Requests to the server in flight at once for one decision (its questions, option orders and calibration
    inputs go out concurrently, at most this many at a time)."""
