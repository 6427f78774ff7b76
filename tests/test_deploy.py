"""The image and the Kubernetes examples: numeric non-root user, gRPC probes, valid settings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from compactd import config
from compactd.api.server import components

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    (user,) = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert user == "10001:10001"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_a_kubernetes_example_probes_grpc_health_and_configures_compactd_validly(
    path: Path, tmp_path: Path
) -> None:
    documents = _documents(path)
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    (compactd,) = [c for c in (*pod.get("initContainers", ()), *pod["containers"])
                   if c["name"] == "compactd"]  # fmt: skip
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the health-only port
        assert compactd[probe]["grpc"]["port"] == 8081
    assert compactd["securityContext"]["readOnlyRootFilesystem"] is True

    environ = {e["name"]: e["value"] for e in compactd["env"] if "value" in e}
    assert config.unknown_variables(environ) == []
    (configmap,) = [d for d in documents if d["kind"] == "ConfigMap"]
    file = tmp_path / "compactd.toml"
    file.write_text(configmap["data"]["compactd.toml"])
    settings = config.load(file, environ={k: v for k, v in environ.items()
                                          if k.startswith("COMPACTD_")})  # fmt: skip
    assert settings.metrics_listen == "0.0.0.0:9464"
    assert settings.health_listen == "0.0.0.0:8081"
    host, _ = settings.host_port
    assert config.is_loopback(host) or settings.tls_cert_file  # no plaintext beyond the pod
    parts = components(settings)  # routes, policy, summarizer: as `compactd serve` validates them
    assert parts.summarizer.provider  # the summary route is named, so its endpoint may be used


def test_the_replicas_example_runs_three_stateless_pods_on_postgresql_from_a_secret(
    tmp_path: Path,
) -> None:
    documents = _documents(ROOT / "deploy" / "kubernetes" / "replicas.yaml")
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deployment["spec"]["template"]["spec"]
    assert all("persistentVolumeClaim" not in v for v in pod["volumes"])  # nothing on the pods
    (migrate,) = pod["initContainers"]
    (compactd,) = pod["containers"]
    assert migrate["args"][0] == "migrate"
    assert compactd["args"][0] == "serve"
    for container in (migrate, compactd):
        (store,) = [e for e in container["env"] if e["name"] == "COMPACTD_STORE"]
        assert store["valueFrom"]["secretKeyRef"] == {"name": "compactd-postgres", "key": "url"}
    (secret,) = [d for d in documents if d["kind"] == "Secret"]
    assert secret["stringData"]["url"].startswith("postgresql://")
    services = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "Service"}
    assert services["compactd-replicas"]["clusterIP"] == "None"  # for round_robin clients
    assert all(s["selector"] == {"app": "compactd-replicas"} for s in services.values())
    (budget,) = [d for d in documents if d["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["minAvailable"] == 2

    (configmap,) = [d for d in documents if d["kind"] == "ConfigMap"]
    file = tmp_path / "compactd.toml"
    file.write_text(configmap["data"]["compactd.toml"])
    settings = config.load(file, environ={"COMPACTD_STORE": secret["stringData"]["url"]})
    assert settings.store.startswith("postgresql://")
    assert settings.bracket_lease_s == 30
