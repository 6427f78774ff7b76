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
