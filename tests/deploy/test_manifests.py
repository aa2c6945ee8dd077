"""The deployment files, checked as far as this machine can without a cluster or Docker:
Kubernetes manifests against Kubernetes' own schemas (kubernetes-validate), the compose file's
references, and every Sluice command line and configuration in them by Sluice's own parsers."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.cli import parse_serve
from server.core.config import parse_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROOT = DEPLOY.parent
KUBERNETES_VERSION = "1.33.0"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _serve_args(args: list[str]) -> Any:
    """Sluice's own parser reads the arguments (the image's entry point is `sluice serve`)."""
    return parse_serve(args).options


def _router_args(args: list[str]) -> Any:
    """vLLM's router's own parser reads its arguments (`vllm-router` is a Python launcher)."""
    from vllm_router.launch_router import parse_router_args

    return parse_router_args(args)


MANIFESTS = [
    *sorted(DEPLOY.glob("kubernetes/*.yaml")),
    DEPLOY / "autoscaling" / "hpa-prometheus-adapter.yaml",
]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kubernetes_manifests_match_kubernetes_schemas(path: Path) -> None:
    # Imported here: it loads jsonschema (~0.1 s), which every pytest-xdist worker would pay
    # at collection, though one of them runs these tests.
    import kubernetes_validate

    for document in _documents(path):
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_deployment_fits_sluices_drain_and_probes() -> None:
    documents = _documents(DEPLOY / "kubernetes" / "sluice.yaml")
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    pod = by_kind[("Deployment", "sluice")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _serve_args(container["args"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    # preStop (endpoints removed), then SIGTERM's drain, must end before the kill.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + args.drain_seconds + 10
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "metrics": args.metrics_port}  # the image listens on 8000
    # The router finds exactly the replicas' pods (not its own) on the port they serve, and
    # the `sluice` Service is the router; `sluice-replicas` reaches the replicas directly.
    router_pod = by_kind[("Deployment", "sluice-router")]["spec"]["template"]
    (router,) = router_pod["spec"]["containers"]
    assert router["command"] == ["vllm-router"]
    routing = _router_args(router["args"])
    replica_labels = by_kind[("Deployment", "sluice")]["spec"]["template"]["metadata"]["labels"]
    assert routing.service_discovery and routing.selector == replica_labels
    assert not routing.selector.items() <= router_pod["metadata"]["labels"].items()
    assert routing.service_discovery_port == 8000 and routing.policy == "cache_aware"
    assert routing.service_discovery_namespace == "sluice"
    assert routing.health_check_endpoint == "/ready"  # a draining replica is passed over
    front = by_kind[("Service", "sluice")]["spec"]["selector"]
    assert front == router_pod["metadata"]["labels"] and front != replica_labels
    assert by_kind[("Service", "sluice-replicas")]["spec"]["selector"] == replica_labels
    role = by_kind[("Role", "sluice-router")]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"])
    assert router_pod["spec"]["serviceAccountName"] == "sluice-router"
    config = parse_config(
        yaml.safe_load(by_kind[("ConfigMap", "sluice-config")]["data"]["sluice.yaml"])
    )
    redis_service = by_kind[("Service", "redis")]
    assert config.state.url == (
        f"redis://{redis_service['metadata']['name']}."
        f"{redis_service['metadata']['namespace']}.svc:6379/0"
    )


def test_the_compose_file_references_what_exists() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    replicas = [name for name in services if name.startswith("sluice-")]
    assert len(replicas) >= 2
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = (DEPLOY / volume.split(":")[0]).resolve()
            assert source.exists(), f"{name} mounts {source}, which is missing"
        for dependency in service.get("depends_on", {}):
            assert dependency in services
    for name in replicas:
        service = services[name]
        args = _serve_args(service["command"])
        grace = int(service["stop_grace_period"].rstrip("s"))
        assert grace >= args.drain_seconds
        mounted = {v.split(":")[1]: DEPLOY / v.split(":")[0] for v in service["volumes"]}
        config = parse_config(yaml.safe_load(mounted[str(args.config)].read_text()))
        assert config.state.url == "redis://redis:6379/0" and "redis" in services
    # vLLM's router in front of every replica, at the port nginx sends to.
    router = services["router"]
    assert router["entrypoint"] == ["vllm-router"]
    routing = _router_args(router["command"])
    assert routing.worker_urls == [f"http://{name}:8000" for name in replicas]
    assert routing.port == 8000 and routing.policy == "cache_aware"
    assert routing.health_check_endpoint == "/ready"  # a draining replica is passed over
    nginx = (DEPLOY / "compose" / "nginx.conf").read_text()
    assert "server router:8000;" in nginx
    # What the router cannot carry (WebSockets, the APIs it strips of Authorization) goes to
    # every replica directly.
    assert all(f"server {name}:8000" in nginx for name in replicas)
    assert "proxy_buffering off" in nginx  # SSE tokens go out one by one
    prometheus = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    (scrape,) = prometheus["scrape_configs"]
    assert scrape["static_configs"][0]["targets"] == [f"{name}:8000" for name in replicas]


def test_the_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: run scripts/install-test-deps.sh"
    # As mounted in the container: the config, and Sluice's rules beside it.
    shutil.copy(DEPLOY / "compose" / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copytree(ROOT / "dashboards" / "prometheus" / "rules", tmp_path / "rules")
    checked = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout + checked.stderr
