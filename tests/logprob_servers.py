"""Simulated OpenAI-compatible servers on loopback that answer with a real model's next-token log-probabilities (the
tiny random Llama on SmolLM2's tokenizer, computed here with torch), in the shapes and with the limits each server
documents:

- ``vllm``: /v1/completions (text or token-id prompts) and /v1/chat/completions; OpenAI's legacy logprobs shape on
  completions (``{token text: logprob}``; ``token_id:N`` keys with ``return_tokens_as_token_ids``); ``logit_bias`` and
  ``allowed_token_ids``; log-probabilities from the raw logits, before either (V1's default ``raw_logprobs``), unless
  ``processed`` (``--logprobs-mode processed_logprobs``); at most ``max_logprobs`` (20) or a 400; with ``label_ids``
  (0.32 and later) ``logprob_token_ids``: the given ids' log-probabilities, the chosen token first, ``logprobs``
  then unchecked (``sampling_params``, ``completion/protocol.py``); each token printed as 0.32's
  ``convert_ids_list_to_tokens``: ``decode([id])`` with the leading spaces of a Metaspace piece restored;
- ``sglang``: the same routes and shapes, ``logit_bias`` applied before the log-probabilities, each token printed by
  a lone ``decode([id])`` (``batch_decode([[id]])``: SentencePiece's ``▁A`` prints ``A``); and its native
  ``/generate`` with ``token_ids_logprob`` (``meta_info.output_token_ids_logprobs``), unless not ``native``;
- ``llamacpp``: llama.cpp's own server: ``logprobs.content[0]`` with each token's ``id`` on both routes, raw
  probabilities, ``logit_bias``; a token printed as its piece (``▁A`` prints `` A``);
- ``ollama``: /v1/chat/completions only (its /v1/completions templates the prompt again), ``logprobs`` and
  ``top_logprobs`` (20 at most: "top_logprobs must be between 0 and 20"), no ``logit_bias`` (ignored), tokens printed
  as llama-server's pieces;
- ``openai``: /v1/chat/completions, ``top_logprobs`` at most 20, ``logit_bias``, images only with ``vision``; a field
  it does not know is a 400 ("Unrecognized request argument supplied"), and reasoning models (``o3``…) refuse
  ``max_tokens`` and ``logprobs``.

``GET /v1/models`` answers each server's model card (its ``owned_by``: ``vllm``, ``sglang``, ``llamacpp``,
``library`` for Ollama, ``system`` for OpenAI).

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
    label_ids: bool = True  # vllm: 0.32's logprob_token_ids (False: an older vLLM, which ignores the field)
    native: bool = True  # sglang: its native /generate route (False: only /v1 is reachable, as behind a proxy)
    thinks: bool = False  # a thinking model: thinking on unless the request turns it off (Ollama's default)
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
        if seen.method == "GET":
            return self._models(seen)
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
        if seen.path == "/generate" and self.flavor == "sglang" and self.native:
            return self._generate(body)
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

    def _models(self, seen: Seen):
        if not seen.path.endswith("/v1/models"):
            return 404, {}, {"error": {"message": "Not Found"}}
        owner = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "ollama": "library",
                 "openai": "system"}[self.flavor]
        return 200, {}, {"object": "list", "data": [{"id": "served", "object": "model", "created": 0,
                                                     "owned_by": owner}]}

    def printed(self, i: int) -> str:
        """A token's text as this server prints it (see the module docstring)."""
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(i)
        if self.flavor == "sglang":
            return tok.decode([i])
        if self.flavor == "vllm":
            text = tok.decode([i])
            markers = len(piece) - len(piece.lstrip("▁"))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            return " " * missing + text if missing > 0 else text
        return piece.replace("▁", " ") if "▁" in piece else tok.convert_tokens_to_string([piece])

    def _unknown(self, body: dict):
        """OpenAI's refusals of fields it does not take, and of reasoning models' max_tokens and logprobs."""
        known = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "logprobs", "top_logprobs",
                 "stream", "logit_bias", "frequency_penalty", "presence_penalty", "top_p", "n", "seed", "stop", "user"}
        for name in body:
            if name not in known:
                return 400, {}, {"error": {"message": f"Unrecognized request argument supplied: {name}",
                                           "type": "invalid_request_error", "param": None, "code": None}}
        if str(body.get("model", "")).startswith("o3"):
            for name in ("max_tokens", "logprobs"):
                if name in body:
                    return 400, {}, {"error": {"message": f"Unsupported parameter: '{name}' is not supported with "
                                                          "this model.", "type": "invalid_request_error",
                                               "param": name, "code": "unsupported_parameter"}}
        return None

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
        if self.flavor == "openai" and (refusal := self._unknown(body)):
            return refusal
        k = body.get("top_logprobs") if chat else body.get("logprobs")
        if chat and body.get("logprobs") is not True:
            k = None
        wanted = body.get("logprob_token_ids") if self.flavor == "vllm" and self.label_ids else None
        if wanted:
            k = len(wanted)  # vLLM 0.32 reads these ids and leaves logprobs unchecked
        if self.flavor == "ollama" and isinstance(k, int) and k > 20:
            return 400, {}, {"error": {"message": "top_logprobs must be between 0 and 20", "type": "invalid_request_error"}}
        if isinstance(k, int) and k > self.max_logprobs and not wanted:
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
        position = None if k is None or self.no_logprobs else self._position(logprobs, chosen, k, chat, body, wanted)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": position}
        text = self.printed(chosen)
        if self.thinks and body.get("reasoning_effort") != "none" and \
                (body.get("chat_template_kwargs") or {}).get("enable_thinking") is not False:
            # the model opens its reasoning: Ollama splits it off as "reasoning", the first token is <think>
            if position is not None:
                position["content"][0].update(token="<think>", logprob=-0.01, bytes=list(b"<think>"))
            choice["message"] = {"role": "assistant", "content": "", "reasoning": "Okay"}
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return 200, {}, {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                         "model": body.get("model"), "choices": [choice], "usage": usage}

    def _generate(self, body: dict):
        """SGLang's native route (``GenerateReqInput``; ``meta_info`` as ``tokenizer_manager`` fills it): entries
        ``[logprob, id, null]`` (text only with ``return_text_in_logprobs``), one list per output position."""
        ids = list(body["input_ids"])
        logprobs = torch.log_softmax(self.logits(ids), dim=-1)
        chosen = int(torch.argmax(logprobs))
        k = int(body.get("top_logprobs_num") or 0)
        top = torch.topk(logprobs, k) if k else None
        wanted = body.get("token_ids_logprob")
        meta: dict[str, Any] = {
            "id": "a1", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(ids),
            "weight_version": "default", "num_retractions": 0, "input_token_logprobs": [],
            "output_token_logprobs": [[float(logprobs[chosen]), chosen, None]], "output_token_logprobs_length": 1}
        if k:
            meta["input_top_logprobs"] = []
            meta["output_top_logprobs"] = [[[float(v), int(i), None] for v, i in zip(top.values, top.indices)]]
        if wanted is not None:
            meta["input_token_ids_logprobs"] = []
            meta["output_token_ids_logprobs"] = [[[float(logprobs[int(i)]), int(i), None] for i in wanted]]
        meta.update(reasoning_tokens=0, completion_tokens=1, cached_tokens=self._cached_tokens(ids), e2e_latency=0.01)
        return 200, {}, {"text": self.printed(chosen), "output_ids": [chosen], "meta_info": meta}

    def _position(self, logprobs: torch.Tensor, chosen: int, k: int, chat: bool, body: dict,
                  wanted: list[int] | None) -> dict:
        if wanted:  # the sampled token, then the given ids (sampler.gather_specific_token_logprobs)
            pairs = [(int(i), float(logprobs[int(i)])) for i in wanted]
        else:
            top = torch.topk(logprobs, k)
            pairs = [(int(i), float(v)) for v, i in zip(top.values, top.indices) if math.isfinite(float(v))]
        as_ids = bool(body.get("return_tokens_as_token_ids")) and self.flavor == "vllm"

        def text(i: int) -> str:
            return f"token_id:{i}" if as_ids else self.printed(i)

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
