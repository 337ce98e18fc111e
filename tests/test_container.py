"""decisiond's images, built from the ``Containerfile`` and run with real podman (``tests/containers.py``): the base
image made here with debootstrap, this machine's pip settings mounted into the build, containers on the host's
network.

- The engine image serves the embedded SmolLM2 as a user that is not root, from a model converted at build time
  (the first start converts nothing), answers the official ``openai`` SDK (a decision, and a file of the Files API
  kept in its data volume, 0600 in a 0700 folder), reports healthy, shows one scrape of every worker's counts in
  ``/metrics`` (it runs two), keeps the master key out of its logs and layers, and stops on SIGTERM within 15 s with
  exit status 0.
- The gateway image holds no torch, refuses the embedded default naming the engine extra, and two of its containers
  on the host's PostgreSQL and Redis share one budget and one rate limit, with their settings given as
  ``deploy/compose.yaml`` gives them.
- ``deploy/compose.yaml`` runs two replicas of the image on PostgreSQL and Redis, its secrets from the environment,
  with a config that loads.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import upstreams
import yaml
from containers import ROOT, Podman, base_image, build, start
from servers import free_port
from services import start_postgres, start_redis

pytestmark = [pytest.mark.services, pytest.mark.slow]

MASTER = "container-master-key-0123456789abcdef"
LIMITED = "container-limited-key-0123456789abcdef"
QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}
COMPOSE = ROOT / "deploy" / "compose.yaml"
PRICE, LIMIT = 0.01, 0.10
STOP_WITHIN_S = 15

GATEWAY_CONFIG = f"""
auth:
  keys: [{{name: limited, key: "{LIMITED}", rate_limits: {{requests_per_minute: 3}}}}]
cache: {{enabled: false}}
providers:
  - {{name: up, type: openai, base_url: "${{UP}}/v1", pricing: {{per_request: {PRICE}}}}}
models:
  - {{name: luna, provider: up, upstream: gpt-6-luna}}
budgets:
  - {{model: luna, limit_usd: {LIMIT}, period: daily}}
"""


@pytest.fixture(scope="module")
def podman():
    found = Podman.make()
    base_image(found)
    yield found
    found.remove()


def _image(podman: Podman, variant: str):
    tag = f"localhost/decisiond-test:{variant}-{podman.folder.name[-8:].lower()}"
    build(podman, variant, tag)
    yield tag
    podman.run("rmi", "-f", tag, check=False)  # the tag: the layers stay in podman's cache for the next build


@pytest.fixture(scope="module")
def engine_image(podman):
    yield from _image(podman, "engine")


@pytest.fixture(scope="module")
def gateway_image(podman):
    yield from _image(podman, "gateway")


def wait_ready(url: str, container, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        state = container.podman.inspect(container.name)["State"]
        assert state["Running"], f"the container stopped ({state['ExitCode']}):\n{container.logs()}"
        time.sleep(0.5)
    raise AssertionError(f"not ready in {timeout} s:\n{container.logs()}")


def requests_counted(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}, timeout=30).text
    found = re.findall(r'^decisiond_requests_total\{[^}]*route="/v1/decisions"[^}]*status="200"\} (\S+)$', text, re.M)
    return sum(float(x) for x in found)


def test_the_engine_image_answers_the_sdk_as_a_user_not_root_and_stops_on_sigterm_within_15_s(podman, engine_image):
    port = free_port()
    volume = f"{podman.folder.name.lower()}-data"
    container = start(podman, engine_image, {"DECISIOND_MASTER_KEY": MASTER, "DECISIOND_HOST": "127.0.0.1",
                                             "DECISIOND_PORT": str(port)}, volumes=[f"{volume}:/var/lib/decisiond"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, container)
        assert "converting" not in container.logs()  # the model was converted at build time
        client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=120)
        decision = client.decisions.create(model="default", input="I was charged twice.", questions=[QUESTION])
        assert 0.0 <= decision.answers[0].probability <= 1.0
        upload = client.files.create(file=("t.jsonl", b'{"custom_id": "a", "method": "POST", "url": "/v1/decisions", '
                                                      b'"body": {"model": "default", "input": "x", "questions": []}}\n'),
                                     purpose="batch")
        assert [f.id for f in client.files.list()] == [upload.id]
        # One scrape sees both workers' counts, whichever answers it.
        assert [requests_counted(url) for _ in range(4)] == [1.0] * 4
        assert container.exec("id", "-u").stdout.strip() == "10001"
        status = container.exec("cat", "/proc/1/status").stdout
        assert re.search(r"^Uid:\s+10001\s", status, re.M), status
        modes = container.exec("stat", "-c", "%a %U %n", "/var/lib/decisiond",
                               "/var/lib/decisiond/decisiond.sqlite3").stdout.split("\n")
        assert modes[:2] == ["700 decisiond /var/lib/decisiond",
                             "600 decisiond /var/lib/decisiond/decisiond.sqlite3"], modes
        assert podman.run("healthcheck", "run", container.name, check=False).returncode == 0
        assert container.stop() < STOP_WITHIN_S
        assert container.exit_code() == 0, container.logs()
        logs = container.logs()
        assert "Application shutdown complete" in logs and MASTER not in logs
    finally:
        container.remove()
        podman.run("volume", "rm", "-f", volume, check=False)
    history = podman.run("history", "--no-trunc", "--format", "{{.CreatedBy}}", engine_image).stdout
    config = podman.run("image", "inspect", engine_image).stdout
    assert MASTER not in history + config
    assert "USER decisiond" in history or '"User": "decisiond"' in config


def test_the_gateway_image_holds_no_torch_and_refuses_the_embedded_default_by_name(podman, gateway_image):
    torch = podman.run("run", "--rm", "--network", "host", "--entrypoint", "python", gateway_image, "-c",
                       "import torch", check=False)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    embedded = podman.run("run", "--rm", "--network", "host", "--env", "DECISIOND_HOST=127.0.0.1", "--env",
                          f"DECISIOND_PORT={free_port()}", gateway_image, check=False, timeout=120)
    assert embedded.returncode == 2, embedded.stdout + embedded.stderr
    assert "decisiond[engine]" in embedded.stderr


@pytest.fixture(scope="module")
def upstream():
    up = upstreams.openai_server()
    yield up
    up.stop()


def compose_environment() -> dict[str, str]:
    """The decisiond replicas' environment as ``deploy/compose.yaml`` gives it (``${…}`` left as written)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return dict(services["decisiond-1"]["environment"])


def test_two_gateway_containers_on_postgres_and_redis_share_one_budget_and_one_rate_limit(
        podman, gateway_image, upstream, tmp_path):
    redis, postgres, running = start_redis(), None, []
    config = tmp_path / "decisiond.yaml"
    config.write_text(GATEWAY_CONFIG)
    config.chmod(0o644)
    try:
        postgres = start_postgres()
        given = compose_environment()
        env = {"DECISIOND_MASTER_KEY": MASTER, "DECISIOND_DATABASE_URL": postgres.url,
               "DECISIOND_REDIS_URL": redis.url, "DECISIOND_CONFIG": given["DECISIOND_CONFIG"],
               "DECISIOND_WORKERS": given["DECISIOND_WORKERS"], "UP": upstream.url, "DECISIOND_HOST": "127.0.0.1"}
        assert set(given) <= set(env)
        for _ in range(2):
            port = free_port()
            container = start(podman, gateway_image, {**env, "DECISIOND_PORT": str(port)},
                              volumes=[f"{config}:{given['DECISIOND_CONFIG']}:ro"])
            running.append((f"http://127.0.0.1:{port}", container))
        for url, container in running:
            wait_ready(url, container, timeout=120)

        def ask(n: int, key: str = MASTER) -> int:
            return httpx.post(running[n % 2][0] + "/v1/decisions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": "luna", "input": f"ticket {n}", "questions": [QUESTION]},
                              timeout=60).status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(ask, range(30)))
        admitted = statuses.count(200)
        assert set(statuses) <= {200, 402} and 0 < admitted <= round(LIMIT / PRICE), statuses
        assert 200 in statuses[0::2] and 200 in statuses[1::2]  # both containers answered
        deadline = time.monotonic() + 30
        while True:
            (view,) = httpx.get(running[1][0] + "/admin/budgets", headers={"Authorization": f"Bearer {MASTER}"},
                                timeout=30).json()["data"]
            if view["spent_usd"] >= admitted * PRICE - 1e-9 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert view["spent_usd"] == pytest.approx(admitted * PRICE) and view["spent_usd"] <= LIMIT + 1e-9
        limited = [ask(n, LIMITED) for n in range(8)]  # 3 a minute in Redis, whichever container answers
        assert limited.count(200) + limited.count(402) == 3 and limited.count(429) == 5, limited
        for _, container in running:
            assert container.stop() < STOP_WITHIN_S and container.exit_code() == 0, container.logs()
    finally:
        for _, container in running:
            container.remove()
        if postgres is not None:
            postgres.remove()
        redis.stop()


def test_the_compose_file_runs_two_replicas_on_postgres_and_redis_with_secrets_from_the_environment():
    from decisiond.gateway import config as gateway_config

    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    replicas = [name for name, service in services.items() if service.get("image", "").startswith("${DECISIOND_IMAGE")]
    assert replicas == ["decisiond-1", "decisiond-2"]
    assert {"postgres", "redis"} <= set(services)
    for name in replicas:
        service = services[name]
        env = service["environment"]
        assert env["DECISIOND_DATABASE_URL"].startswith("postgresql://") and "@postgres:" in env["DECISIOND_DATABASE_URL"]
        assert env["DECISIOND_REDIS_URL"].startswith("redis://redis:")
        assert env["DECISIOND_MASTER_KEY"].startswith("${DECISIOND_MASTER_KEY:?")  # never a value in the file
        assert "${POSTGRES_PASSWORD:?" in env["DECISIOND_DATABASE_URL"]
        assert {dep: spec["condition"] for dep, spec in service["depends_on"].items()} == {
            "postgres": "service_healthy", "redis": "service_healthy"}
        mounts = dict(volume.split(":")[:2] for volume in service["volumes"])
        assert mounts[f"{name}-data"] == "/var/lib/decisiond"  # a data volume each: its own usage journal
        source = [s for s, target in mounts.items() if target == env["DECISIOND_CONFIG"]]
        assert source, "the config DECISIOND_CONFIG names is mounted"
        parsed = yaml.safe_load((COMPOSE.parent / source[0]).read_text())
        gateway_config.parse(parsed)
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert Path(COMPOSE.parent / "decisiond.yaml").is_file()
