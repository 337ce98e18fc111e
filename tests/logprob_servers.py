"""Simulated OpenAI-compatible servers on loopback that answer with a real model's next-token log-probabilities (the
tiny random Llama on SmolLM2's tokenizer, computed here with torch), in the shapes and with the limits each server
documents:

- ``vllm``: /v1/completions (text or token-id prompts) and /v1/chat/completions; OpenAI's legacy logprobs shape on
  completions (``{token text: logprob}``; ``token_id:N`` keys with ``return_tokens_as_token_ids``); ``logit_bias`` and
  ``allowed_token_ids``; log-probabilities from the raw logits, before either (V1's default ``raw_logprobs``), unless
  ``processed`` (``--logprobs-mode processed_logprobs``); at most ``max_logprobs`` (20) or a 400;
- ``sglang``: the same routes and shapes, ``logit_bias`` applied before the log-probabilities;
- ``llamacpp``: llama.cpp's own server: ``logprobs.content[0]`` with each token's ``id`` on both routes, raw
  probabilities, ``logit_bias``;
- ``ollama``: /v1/chat/completions only (its /v1/completions templates the prompt again), ``logprobs`` and
  ``top_logprobs`` (20 at most), no ``logit_bias`` (ignored);
- ``openai``: /v1/chat/completions, ``top_logprobs`` at most 20, ``logit_bias``, images only with ``vision``.

And the ways they fail: ``no_logprobs`` (a reply without them), ``no_bias`` (400 on ``logit_bias``), and by the model
name a request carries: ``hang`` (never answers), ``e500``/``e503`` (that status), ``leaky`` (an error that echoes the
request's Authorization header).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from upstreams import Seen, Upstream

REFUSED_IMAGES = "Invalid content type. image_url is only supported by certain models."


@dataclass
class LogprobServer:
    model: Any  # a LoadedModel (tiny_loaded)
    flavor: str = "vllm"
    max_logprobs: int = 20
    processed: bool = False
    vision: bool = False
    no_logprobs: bool = False
    no_bias: bool = False
    bos: bool = False  # adds a BOS to text prompts (as vLLM does for Llama 3 without add_special_tokens: false)
    seen: list[dict] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _model_lock: threading.Lock = field(default_factory=threading.Lock)
    _cached: list[list[int]] = field(default_factory=list)

    def start(self) -> "LogprobServer":
        self.upstream = Upstream(self._handle).start()
        return self

    @property
    def url(self) -> str:
        return self.upstream.url

    def stop(self) -> None:
        self.upstream.stop()

    # ------------------------------------------------------------------------------------------------ model

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def logits(self, ids: list[int]) -> torch.Tensor:
        with self._model_lock, torch.no_grad():
            out = self.model.model(torch.tensor([ids]))
        return out.logits[0, -1].double()

    # ---------------------------------------------------------------------------------------------- serving

    def _handle(self, seen: Seen):
        body = seen.json()
        self.seen.append({"path": seen.path, "body": body, "auth": seen.headers.get("authorization")})
        model = body.get("model", "")
        if model == "hang":
            time.sleep(30)
            return 500, {}, {"error": {"message": "too late"}}
        if model in ("e500", "e503"):
            return int(model[1:]), {}, {"error": {"message": f"upstream says {model}", "type": "server_error"}}
        if model == "leaky":
            return 500, {}, {"error": {"message": f"bad header {seen.headers.get('authorization')}"}}
        chat = seen.path.endswith("/chat/completions")
        if not chat and (self.flavor in ("ollama", "openai") or not seen.path.endswith("/completions")):
            return 404, {}, {"error": {"message": "Not Found"}}
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(0.01)  # long enough for concurrent requests to overlap
            return self._answer(body, chat)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _prompt(self, body: dict, chat: bool) -> list[int] | tuple[int, dict]:
        tok = self.tokenizer
        if not chat:
            prompt = body["prompt"]
            if isinstance(prompt, list) and self.flavor not in ("vllm", "sglang", "llamacpp"):
                return 422, {"detail": "prompt: Input should be a valid string"}
            ids = list(prompt) if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=False)
            return ([tok.bos_token_id] if self.bos and isinstance(prompt, str) else []) + ids
        messages = []
        for m in body["messages"]:
            content = m["content"]
            if isinstance(content, list):
                images = [p for p in content if p.get("type") == "image_url"]
                if images and not self.vision:
                    return 400, {"error": {"message": REFUSED_IMAGES, "type": "invalid_request_error"}}
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            messages.append({"role": m["role"], "content": content})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       **(body.get("chat_template_kwargs") or {}))
        return tok.encode(text, add_special_tokens=False)

    def _answer(self, body: dict, chat: bool):
        k = body.get("top_logprobs") if chat else body.get("logprobs")
        if chat and body.get("logprobs") is not True:
            k = None
        if isinstance(k, int) and k > self.max_logprobs:
            return 400, {}, {"error": {"message": f"Requested sample logprobs of {k}, which is greater than max "
                                                  f"allowed: {self.max_logprobs}", "type": "BadRequestError"}}
        bias = body.get("logit_bias") if self.flavor != "ollama" else None
        if bias and self.no_bias:
            return 400, {}, {"error": {"message": "logit_bias is not supported with this model.",
                                       "param": "logit_bias"}}
        ids = self._prompt(body, chat)
        if isinstance(ids, tuple):
            return ids[0], {}, ids[1]
        raw = self.logits(ids)
        processed = raw.clone()
        for key, value in (bias or {}).items():
            processed[int(key)] += float(value)
        allowed = body.get("allowed_token_ids") if self.flavor == "vllm" else None
        if allowed:
            mask = torch.full_like(processed, -math.inf)
            mask[allowed] = 0
            processed = processed + mask
        chosen = int(torch.argmax(processed))
        logprobs = torch.log_softmax(processed if self.processed or self.flavor == "sglang" else raw, dim=-1)
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1,
                 "prompt_tokens_details": {"cached_tokens": self._cached_tokens(ids)}}
        position = None if k is None or self.no_logprobs else self._position(logprobs, chosen, k, chat, body)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": position}
        text = self.tokenizer.decode([chosen])
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return 200, {}, {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                         "model": body.get("model"), "choices": [choice], "usage": usage}

    def _position(self, logprobs: torch.Tensor, chosen: int, k: int, chat: bool, body: dict) -> dict:
        top = torch.topk(logprobs, k)
        pairs = [(int(i), float(v)) for v, i in zip(top.values, top.indices) if math.isfinite(float(v))]
        as_ids = bool(body.get("return_tokens_as_token_ids")) and self.flavor == "vllm"

        def text(i: int) -> str:
            return f"token_id:{i}" if as_ids else self.tokenizer.decode([i])

        lp = max(float(logprobs[chosen]), -9999.0)
        if chat or self.flavor == "llamacpp":
            def entry(i: int, v: float) -> dict:
                out = {"token": text(i), "logprob": v, "bytes": list(text(i).encode())}
                if self.flavor == "llamacpp":
                    out["id"] = i
                return out

            return {"content": [{**entry(chosen, lp), "top_logprobs": [entry(i, v) for i, v in pairs]}]}
        return {"tokens": [text(chosen)], "token_logprobs": [lp], "text_offset": [0],
                "top_logprobs": [{text(i): v for i, v in pairs}]}

    def _cached_tokens(self, ids: list[int]) -> int:
        """A prefix cache's hits: the longest prefix this prompt shares with an earlier one."""
        with self._lock:
            best = 0
            for other in self._cached[-64:]:
                n = 0
                while n < min(len(ids), len(other)) and ids[n] == other[n]:
                    n += 1
                best = max(best, n)
            self._cached.append(ids)
        return best
