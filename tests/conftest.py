from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers share the cores: one compute thread per process (this worker and every decisiond it
    # starts), or OpenMP threads spinning on each other's cores make every model test several times slower.
    os.environ["OMP_NUM_THREADS"] = "1"

import atexit  # noqa: E402
import inspect  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

# Every server keeps its state in a database: without a database_url, the default SQLite file in the data directory.
# Each test process (each xdist worker, and the decisiond processes it starts) gets a data directory of its own,
# never the user's, where servers that name none share it as servers of one host do.
os.environ["DECISIOND_DATA_DIR"] = _DATA_DIR = tempfile.mkdtemp(prefix="decisiond-data-")
atexit.register(shutil.rmtree, _DATA_DIR, ignore_errors=True)

import pytest  # noqa: E402
from servers import start_decisiond, warm  # noqa: E402


def _one_default_ssl_context() -> None:
    """Every client in these tests speaks plain HTTP on loopback, yet each new HTTP client (each ``httpx.get``, each
    ``OpenAI(...)`` or ``TypeSafeClient(...)``; the SDKs use the ``httpx2`` fork) loads the CA bundle: ~50 ms of CPU,
    8 s over three test files. The default context is built once per library and shared; any other verify or cert
    setting is built as usual."""
    import functools
    import importlib

    for name in ("httpx", "httpx2"):
        try:
            transports = importlib.import_module(f"{name}._transports.default")
        except ImportError:
            continue
        build = transports.create_ssl_context
        default = functools.cache(build)

        def create_ssl_context(verify=True, cert=None, trust_env=True, build=build, default=default):
            if verify is True and cert is None and trust_env is True:
                return default()
            return build(verify=verify, cert=cert, trust_env=trust_env)

        transports.create_ssl_context = create_ssl_context


_one_default_ssl_context()


def pytest_sessionstart(session):
    # The preloading forkserver of tests/servers.py does its imports while the tests are collected. Under xdist the
    # controller runs no test: only the workers (and a plain run) start decisiond processes.
    if not getattr(session.config.option, "numprocesses", None) or hasattr(session.config, "workerinput"):
        warm()


# Markers, set here from what a test uses so that no test has to remember them:
# - ``model``: runs the real SmolLM2 model (one of these fixtures, or ``smollm_dir`` asked for directly rather than
#   only through the tokenizer the tiny model shares);
# - ``services``: starts PostgreSQL, Redis, Chromium, llama.cpp's server or several replicas (fixtures below and in
#   test modules, or a ``postgresql`` param);
# - ``reliability``: everything under tests/reliability (hostile input, misbehaving upstreams, fuzzing, load);
# - ``slow``: any of the above, or marked by hand (a whole CLI run, a kill and resume, a fresh interpreter).
# ``pytest -m "not slow"`` is the everyday subset; ``pytest`` runs everything, as CI does.
REAL_MODEL_FIXTURES = {"server", "smol_engine", "openai_client"}
REAL_MODEL_SERVER = {"server", "openai_client"}
SERVICE_FIXTURES = {"postgres", "shared_postgres", "redis", "replicas", "browser", "browser_factory", "llamacpp",
                    "vllm_servers"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        direct = set(inspect.signature(item.function).parameters) if hasattr(item, "function") else set()
        params = [str(v) for v in getattr(getattr(item, "callspec", None), "params", {}).values()]
        if REAL_MODEL_FIXTURES & set(item.fixturenames) or "smollm_dir" in direct:
            item.add_marker(pytest.mark.model)
        if SERVICE_FIXTURES & set(item.fixturenames) or "postgresql" in params:
            item.add_marker(pytest.mark.services)
        if "reliability" in item.path.parts:
            item.add_marker(pytest.mark.reliability)
        if {"model", "services", "reliability"} & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.slow)
    schedule(items)


# Files that run as long as the SmolLM2 group (the images' builds): started as early, so that none starts last.
LONGEST_FILES = {"test_container.py", "test_served_vllm.py"}


def schedule(items) -> None:
    """xdist (``--dist loadgroup``) keeps a group on one worker: each test file is a group, so that its module
    fixtures start once, except that every file using the real SmolLM2 server shares one group, so that only one
    worker starts that server. Files that start no process go first (they run while the forkserver of
    ``tests/servers.py`` does its imports), then the SmolLM2 group and the images' builds, the longest, then files with
    slow tests, so that no long file starts last and leaves one worker running alone."""
    files_on_server = {item.path for item in items if REAL_MODEL_SERVER & set(item.fixturenames)}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    in_process = {item.path for item in items} - {item.path for item in items if starts_processes(item)}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("smollm-server" if item.path in files_on_server else
                                                item.path.name))
    items.sort(key=lambda item: 0 if item.path in in_process else
               1 if item.path in files_on_server or item.path.name in LONGEST_FILES else 2 if item.path in slow_files
               else 3)


def starts_processes(item) -> bool:
    """Whether a test's module starts decisiond, Redis, PostgreSQL or a browser (by what it imports or uses)."""
    import servers
    import services

    launchers = {id(f) for f in (servers.start_decisiond, servers.run_decisiond, servers.decisiond,
                                 services.start_redis, services.start_postgres, subprocess)}
    module = vars(item.module) if hasattr(item, "module") else {}
    return bool(launchers & {id(value) for value in module.values()}) or \
        bool({"tiny_server", "server", "database", *SERVICE_FIXTURES} & set(item.fixturenames))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(request, tmp_path_factory):
    """The gateway database's URL, once a SQLite file and once a fresh PostgreSQL server (one per module)."""
    from services import start_postgres

    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('database')}/gateway.sqlite3"
        return
    postgres = start_postgres()
    try:
        yield postgres.url
    finally:
        postgres.remove()


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The embedded SmolLM2 GGUF, converted once to a safetensors folder in the user cache dir."""
    from decisiond.engine.model import converted_gguf, default_gguf

    return str(converted_gguf(default_gguf()))


@pytest.fixture(scope="session")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


def tiny_loaded(tokenizer, context_length: int = 512, seed: int = 0, attn_implementation: str | None = None,
                dtype: str = "float32"):
    """A random-weight two-layer Llama on SmolLM2's tokenizer: real forward passes in milliseconds. The same seed gives
    the same weights whatever the attention implementation (None: transformers' default, sdpa) and dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from decisiond.engine.model import LoadedModel

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_length,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **({"attn_implementation": attn_implementation} if attn_implementation else {}),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Spread the logits so that label probabilities differ visibly from uniform (the final norm only: the
    # embeddings are tied to the head and stay small).
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)
    model = model.to(getattr(torch, dtype))
    return LoadedModel(
        name="tiny-random",
        model=model,
        tokenizer=tokenizer,
        context_length=context_length,
        path="(random)",
        dtype=dtype,
        device="cpu",
        parameters=sum(p.numel() for p in model.parameters()),
    )


@pytest.fixture(scope="session")
def tiny(tokenizer):
    return tiny_loaded(tokenizer)


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    from decisiond.engine.local import LocalEngine

    return LocalEngine(tiny)


@pytest.fixture(scope="session")
def server(smollm_dir):
    """decisiond serving the real SmolLM2 model on loopback."""
    running = start_decisiond("--model", "default", "--max-body-bytes", str(4 * 1024 * 1024))
    yield running
    running.stop()


# A chat template whose behaviour a request picks with chat_template_kwargs {"mode": …}, to reach every template
# refusal on a real server: labels after a space, a reasoning block left open, a template that raises, one that
# starts every answer with reasoning; with thinking off it closes an empty think block, as Qwen templates do
# (then one newline: SmolLM2's tokenizer splits a final "\n\n" differently once a label follows).
MODES_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and mode == 'hidden' %}<think>\nr\n</think>\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if mode == 'space' %}Answer: {% elif mode == 'open' %}<think>\n"
    "{% elif mode == 'raise' %}{{ raise_exception('the template refuses') }}{% elif mode == 'hidden' %}"
    "{% elif enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_dir(tokenizer, tmp_path_factory) -> str:
    """The tiny random model saved as a Hugging Face folder with MODES_TEMPLATE, for a second real server."""
    import copy

    folder = tmp_path_factory.mktemp("tiny-modes")
    loaded = tiny_loaded(tokenizer)
    loaded.model.save_pretrained(folder)
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = MODES_TEMPLATE
    clone.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_server(tiny_dir):
    running = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny-modes")
    yield running
    running.stop()


@pytest.fixture()
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, _strict_response_validation=True)


def blocked(scheduler):
    """Occupy a scheduler's worker until the returned event (a ``threading.Event``) is set."""
    import threading

    release, started = threading.Event(), threading.Event()
    threading.Thread(target=lambda: scheduler.call(lambda: (started.set(), release.wait(60)))).start()
    assert started.wait(60)
    return release


@pytest.fixture()
def browser_factory():
    """``make(*chromium_args)`` → a headless Chromium driver (Debian ``chromium`` + ``chromium-driver``, selenium);
    the test quits it."""
    from services import start_chromium

    return start_chromium
