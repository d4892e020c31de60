"""The container and Kubernetes files (deploy/): they parse, their arguments are flags `q3tts serve` takes, and
the endpoints they probe exist. (No Docker engine or cluster runs here: building the image and applying the
manifests were not tried; the README says so.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("fastapi")

from q3tts.cli.commands import build_parser  # noqa: E402
from q3tts.server import ServerConfig, create_app  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REPO = DEPLOY.parent


def routes() -> set[str]:
    from q3tts.server.routes import playground, speech, status, voices

    create_app(ServerConfig(model="tiny"))  # the routers below are the app's
    return {route.path for module in (status, speech, voices, playground) for route in module.router.routes}


def serve_args(args: list[str]):
    return build_parser().parse_args(["serve", *args])


def test_kubernetes_manifests():
    deployment, = yaml.safe_load_all((DEPLOY / "k8s" / "deployment.yaml").read_text())
    service, = yaml.safe_load_all((DEPLOY / "k8s" / "service.yaml").read_text())
    assert deployment["kind"] == "Deployment" and service["kind"] == "Service"
    pod = deployment["spec"]["template"]["spec"]
    container, = pod["containers"]
    args = serve_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and args.host == "0.0.0.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    probed = {container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probed <= routes()
    assert pod["terminationGracePeriodSeconds"] > args.drain_timeout  # streams finish before the kill
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] in ports


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = {line.split()[0]: line for line in re.sub(r"\\\n\s*", " ", text).splitlines()
                    if line and not line.startswith("#")}
    entry = json.loads(instructions["ENTRYPOINT"].removeprefix("ENTRYPOINT"))
    command = json.loads(instructions["CMD"].removeprefix("CMD"))
    assert entry[-2:] == ["q3tts", "serve"] or entry[-1] == "serve"
    args = serve_args(command)
    assert instructions["EXPOSE"].split()[1] == str(args.port) and args.host == "0.0.0.0"
    assert "/ready" in instructions["HEALTHCHECK"] and "/ready" in routes()
    # The README's install command (torch as scripts/test.sh pins it, then the project), with the server extra.
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    torch_pin = re.search(r"torch==[\d.]+", test_sh).group(0)
    install = shlex.split(instructions["RUN"].split("&&")[-1])
    assert install[1:] == ["install", torch_pin, ".[server]"]
    # Triton compiles its launcher with a C compiler at the first kernel (the slim base image has none).
    assert re.search(r"^RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev", text, re.M)
    assert "gcc" in (DEPLOY / "ray" / "Dockerfile").read_text()
    assert torch_pin in (REPO / "README.md").read_text().split("\n", 5)[3]


def test_ray_service():
    """The KubeRay RayService: its Serve config builds (q3tts.ray_serve checks every argument), the GPU workers
    can hold the replicas, the voices folder is the shared volume on every node, and the images agree on Ray."""
    pytest.importorskip("ray.serve")
    import importlib

    service, = yaml.safe_load_all((DEPLOY / "ray" / "rayservice.yaml").read_text())
    pvc, = yaml.safe_load_all((DEPLOY / "ray" / "voices-pvc.yaml").read_text())
    assert service["kind"] == "RayService" and service["apiVersion"] == "ray.io/v1"
    application, = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, _, name = application["import_path"].partition(":")
    app = getattr(importlib.import_module(module), name)(application["args"])
    deployment = app._bound_deployment
    scaling = deployment._deployment_config.autoscaling_config
    cluster = service["spec"]["rayClusterConfig"]
    workers, = cluster["workerGroupSpecs"]
    worker, = workers["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == deployment.ray_actor_options["num_gpus"] == 1
    assert scaling.max_replicas <= workers["maxReplicas"] and cluster["enableInTreeAutoscaling"]
    voices = application["args"]["voices_dir"]
    for spec in (cluster["headGroupSpec"]["template"]["spec"], workers["template"]["spec"]):
        mounts = {m["name"]: m["mountPath"] for c in spec["containers"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert mounts["voices"] == voices
        assert volumes["voices"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    dockerfile = (DEPLOY / "ray" / "Dockerfile").read_text()
    assert f"rayproject/ray:{cluster['rayVersion']}-" in dockerfile
    assert re.search(r'pip install torch==[\d.]+ "\.\[ray\]"', dockerfile)
