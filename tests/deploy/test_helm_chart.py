"""The Helm chart, rendered by the real Helm engine: lint-clean, schema-valid objects, and a
Serve config equal to the matching deploy/ config; bad values are refused at install time.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig
from replica.request import SLO
from router.app import FrontDoorDeployment
from router.config import FrontDoorConfig
from router.reasoning import PARSERS as REASONING
from router.reasoning import ReasoningParser
from router.tokenizer import TextCodec
from router.tool_parsers import PARSERS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "slos-serve"
EXAMPLES = CHART / "examples"
KUBE_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]

# Chart values -> the deploy/ Serve config the rendered RayService must carry.
VALUE_SETS = {
    "default": (None, "serve-cpu.yaml"),
    "a100-opt7b": ("values-a100-opt7b.yaml", "serve-a100-opt7b.yaml"),
    "h100-llama8b": ("values-h100-llama8b.yaml", "serve-h100-llama8b.yaml"),
    "h100-llama70b-tp4": ("values-h100-llama70b-tp4.yaml", "serve-h100-llama70b-tp4.yaml"),
}
GPU_SETS = [name for name in VALUE_SETS if name != "default"]
OPTIONS_ON = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "networkPolicy": {
        "enabled": True,
        "clients": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
    },
    "apiKeys": {"existingSecret": "slos-api-keys"},
    "grpcTls": {"existingSecret": "slos-grpc-tls"},
    "autoscaling": {"enabled": True},
}


def values_for(name: str) -> dict[str, Any] | None:
    file = VALUE_SETS[name][0]
    if file is None:
        return None
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / file).read_text())
    return data


def one(objects: list[Manifest], kind: str, suffix: str = "") -> Manifest:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return found


def pod_templates(rayservice: Manifest) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [group["template"] for group in groups]


def serve_config(rayservice: Manifest) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    return config


def listening_on_all_interfaces(config: dict[str, Any]) -> dict[str, Any]:
    """The deploy/ config as the chart must embed it: pods listen on 0.0.0.0 for the Services."""
    expected = copy.deepcopy(config)
    expected["http_options"]["host"] = "0.0.0.0"
    for app in expected["applications"]:
        app["args"]["http"]["host"] = "0.0.0.0"
        app["args"]["grpc"]["host"] = "0.0.0.0"
    return expected


def validate_core(obj: Manifest) -> None:
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_is_clean(name: str) -> None:
    report = helm.lint(CHART, values_for(name), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_serve_config_equals_the_matching_deploy_config(render: Render, name: str) -> None:
    config = serve_config(one(render(values_for(name)), "RayService"))
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    ClusterConfig.from_dict(app["args"]["cluster"])
    deploy_config = yaml.safe_load((ROOT / "deploy" / VALUE_SETS[name][1]).read_text())
    assert config == listening_on_all_interfaces(deploy_config)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rayservice_validates_against_the_kuberay_crd(
    render: Render, rayservice_validator: jsonschema.Draft4Validator, name: str
) -> None:
    rayservice = one(render(values_for(name)), "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    errors = [
        f"{list(e.absolute_path)}: {e.message}"
        for e in rayservice_validator.iter_errors(rayservice)
    ]
    assert errors == []


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_other_objects_and_pod_templates_validate_against_kubernetes(
    render: Render, name: str
) -> None:
    objects = render(values_for(name))
    assert sorted(o["kind"] for o in objects) == ["PodDisruptionBudget", "RayService", "Service"]
    for obj in objects:
        if obj["kind"] != "RayService":
            validate_core(obj)
    rayservice = one(objects, "RayService")
    validate_core({"apiVersion": "v1", "kind": "Service", **rayservice["spec"]["serveService"]})
    for i, template in enumerate(pod_templates(rayservice)):
        validate_core(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"t{i}"},
                "template": template,
            }
        )


def test_services_reach_the_serve_proxies_and_the_front_doors_grpc(render: Render) -> None:
    objects = render()
    rayservice = one(objects, "RayService")
    templates = pod_templates(rayservice)
    # HTTP is KubeRay's serve Service: KubeRay selects the active cluster's pods whose proxy is
    # healthy, so an upgrade sends no request to a new cluster before its Serve app runs.
    http = rayservice["spec"]["serveService"]
    assert http["metadata"]["name"] == "slos-slos-serve-http"
    assert "selector" not in http["spec"]
    (http_port,) = http["spec"]["ports"]
    assert (http_port["name"], http_port["port"], http_port["targetPort"]) == (
        "serve",  # KubeRay keeps a port named as its head container's serve port
        8000,
        "serve",
    )
    grpc = one(objects, "Service", "-grpc")
    (grpc_port,) = grpc["spec"]["ports"]
    assert (grpc_port["port"], grpc_port["targetPort"]) == (50051, "grpc")
    selector = dict(grpc["spec"]["selector"])
    assert selector.pop("ray.io/node-type") == "head"  # where the front door runs
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        (container,) = template["spec"]["containers"]
        assert {"serve", "grpc"} <= {p["name"] for p in container["ports"]}
    (app,) = serve_config(rayservice)["applications"]
    assert app["args"]["grpc"]["host"] == "0.0.0.0"


@pytest.mark.parametrize("ports", [{}, {"dashboard": 8266, "metrics": 9090}])
def test_ray_listens_on_the_container_ports(render: Render, ports: dict[str, int]) -> None:
    """KubeRay reaches the dashboard, and Prometheus the metrics, through the container ports:
    Ray must listen on the same numbers."""
    cluster = one(render({"ports": ports}), "RayService")["spec"]["rayClusterConfig"]
    head, *workers = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in (head, *workers):
        (container,) = group["template"]["spec"]["containers"]
        named = {p["name"]: str(p["containerPort"]) for p in container["ports"]}
        assert group["rayStartParams"]["metrics-export-port"] == named["metrics"]
    (container,) = head["template"]["spec"]["containers"]
    named = {p["name"]: str(p["containerPort"]) for p in container["ports"]}
    assert head["rayStartParams"]["dashboard-port"] == named["dashboard"]
    assert (named["dashboard"], named["metrics"]) == (
        str(ports.get("dashboard", 8265)),
        str(ports.get("metrics", 8080)),
    )


def cpus(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_replicas_run_on_the_worker_groups(render: Render, name: str) -> None:
    """The head offers Ray no CPU (what runs there asks for none: the front door, pinned to it),
    so each value set's worker groups must hold its replicas, every replica within one pod."""
    assert FrontDoorDeployment.ray_actor_options["num_cpus"] == 0
    rayservice = one(render(values_for(name)), "RayService")
    config = rayservice["spec"]["rayClusterConfig"]
    assert config["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (app,) = serve_config(rayservice)["applications"]
    cluster = ClusterConfig.from_dict(app["args"]["cluster"])
    held = 0
    for group in config["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        fits = [cpus(limits["cpu"]) // cluster.num_cpus_per_replica]
        if cluster.num_gpus_per_replica:
            fits.append(limits.get("nvidia.com/gpu", 0) // cluster.num_gpus_per_replica)
        held += group["replicas"] * int(min(fits))
    assert held >= cluster.replicas


def test_the_head_cpus_can_be_given_to_ray(render: Render) -> None:
    for params, expected in [({"num-cpus": "2"}, {"num-cpus": "2"}), ({"num-cpus": None}, {})]:
        head = one(render({"head": {"rayStartParams": params}}), "RayService")["spec"][
            "rayClusterConfig"
        ]["headGroupSpec"]
        given = {k: v for k, v in head["rayStartParams"].items() if not k.endswith("-port")}
        assert given == expected


def test_tensor_parallel_on_cpu_installs(render: Render) -> None:
    """On CPU a replica's ranks are processes on one node: no worker group needs GPUs."""
    cluster = {"tensor_parallel_size": 2, "profile": "deploy/profiles/cpu-demo-tp2.json"}
    (app,) = serve_config(one(render({"cluster": cluster}), "RayService"))["applications"]
    config = ClusterConfig.from_dict(app["args"]["cluster"])
    assert (config.tensor_parallel_size, config.num_gpus_per_replica) == (2, 0.0)
    assert json.loads((ROOT / config.profile).read_text())["tp"] == 2


def test_the_front_door_defaults_reach_the_front_door(render: Render) -> None:
    for slo, expected in [("code", "code"), ({"ttft_ms": 500, "tpot_ms": 50}, SLO(500, 50))]:
        values = {"defaultSlo": slo, "defaultChatMaxTokens": 1024}
        (app,) = serve_config(one(render(values), "RayService"))["applications"]
        config = FrontDoorConfig.from_args(app["args"])
        assert (config.default_slo, config.default_chat_max_tokens) == (expected, 1024)


def test_an_http_timeout_reaches_serve_on_a_new_ray_cluster(render: Render) -> None:
    """Serve keeps the http_options it started with, so a change must change the pod template
    (KubeRay then starts a new RayCluster) and not the Serve config alone."""
    before, after = (one(render(v), "RayService") for v in ({}, {"httpRequestTimeoutS": 30}))
    config = serve_config(after)
    ServeDeploySchema.model_validate(config)
    assert config["http_options"]["request_timeout_s"] == 30
    old_head, *old_workers = pod_templates(before)
    new_head, *new_workers = pod_templates(after)
    assert old_head != new_head
    assert old_workers == new_workers


def test_disruption_budget_covers_workers_only(render: Render) -> None:
    objects = render()
    selector = one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    head, *workers = pod_templates(one(objects, "RayService"))
    assert workers
    assert not selector.items() <= head["metadata"]["labels"].items()
    for worker in workers:
        assert selector.items() <= worker["metadata"]["labels"].items()


@pytest.mark.parametrize("name", GPU_SETS)
def test_gpu_worker_groups_carry_values(render: Render, name: str) -> None:
    values = values_for(name)
    assert values is not None
    cluster = one(render(values), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["upscalingMode"] == "Default"
    for group, spec in zip(values["workerGroups"], cluster["workerGroupSpecs"], strict=True):
        assert spec["groupName"] == group["name"]
        assert (spec["minReplicas"], spec["replicas"], spec["maxReplicas"]) == (
            group["minReplicas"],
            group["replicas"],
            group["maxReplicas"],
        )
        assert group["gpus"] % values["cluster"]["tensor_parallel_size"] == 0
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == group["gpus"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == group["gpus"]
        assert container["resources"]["limits"]["cpu"] == group["resources"]["limits"]["cpu"]
        assert container["image"].endswith("-cuda")
        assert pod["nodeSelector"] == group["nodeSelector"]
        assert pod["tolerations"] == group["tolerations"]
        env = {e["name"] for e in container["env"]}
        assert "HF_HOME" in env


def test_optional_objects_render_and_validate(
    render: Render, rayservice_validator: jsonschema.Draft4Validator
) -> None:
    objects = render(OPTIONS_ON)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "NetworkPolicy",
        "PodDisruptionBudget",
        "RayService",
        "Service",
        "Service",
        "Service",
        "ServiceMonitor",
    ]
    for obj in objects:
        if obj["kind"] not in {"RayService", "ServiceMonitor"}:
            validate_core(obj)
    rayservice = one(objects, "RayService")
    assert list(rayservice_validator.iter_errors(rayservice)) == []

    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]
    (components,) = selector["matchExpressions"]
    scraped = {}
    for component in components["values"]:
        (service,) = [
            o
            for o in objects
            if o["kind"] == "Service"
            and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
        ]
        labels = service["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        assert (components["key"], components["operator"]) == ("app.kubernetes.io/component", "In")
        ((name, port),) = [(p["name"], p) for p in service["spec"]["ports"]]
        scraped[name] = (port, service["spec"]["selector"])
    assert {e["port"]: e["path"] for e in monitor["spec"]["endpoints"]} == {
        "metrics": "/metrics",
        "door-metrics": "/metrics",
    }
    # Ray's metrics on every pod; the front door's (slos_serve:*) on the head pod's Serve
    # port only, where the one front door runs: through every pod it would count twice.
    port, pods = scraped["metrics"]
    assert port["targetPort"] == "metrics" and "ray.io/node-type" not in pods
    port, pods = scraped["door-metrics"]
    assert (port["port"], port["targetPort"]) == (8000, "serve")
    assert pods["ray.io/node-type"] == "head"

    rules = one(objects, "NetworkPolicy")["spec"]["ingress"]
    policy_ports = {p["port"] for rule in rules for p in rule.get("ports", [])}
    assert {8000, 50051, 8265, 8080} <= policy_ports
    (prometheus,) = [r for r in rules if "monitoring" in str(r.get("from"))]
    assert {p["port"] for p in prometheus["ports"]} == {8080, 8000}


def mounted_secret(template: dict[str, Any], secret: str) -> dict[Path, str]:
    """Where each file of `secret` is in the pod's container: path -> the Secret's key."""
    (volume,) = [
        v for v in template["spec"]["volumes"] if v.get("secret", {}).get("secretName") == secret
    ]
    (container,) = template["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"]
    return {Path(mount["mountPath"]) / i["path"]: i["key"] for i in volume["secret"]["items"]}


def test_api_keys_secret_is_mounted_where_the_app_reads_it(render: Render) -> None:
    rayservice = one(render(OPTIONS_ON), "RayService")
    (app,) = serve_config(rayservice)["applications"]
    keys_file = Path(app["args"]["api_keys_file"])
    assert keys_file == Path("/etc/slos-serve/api-keys/api-keys")
    for template in pod_templates(rayservice):
        assert mounted_secret(template, "slos-api-keys") == {keys_file: "api-keys"}


def test_the_grpc_tls_secret_is_mounted_where_the_app_reads_it(render: Render) -> None:
    rayservice = one(render(OPTIONS_ON), "RayService")
    (app,) = serve_config(rayservice)["applications"]
    config = FrontDoorConfig.from_args(app["args"])
    assert config.grpc_tls_cert_file is not None and config.grpc_tls_key_file is not None
    files = {Path(config.grpc_tls_cert_file): "tls.crt", Path(config.grpc_tls_key_file): "tls.key"}
    for template in pod_templates(rayservice):
        assert mounted_secret(template, "slos-grpc-tls") == files


def test_no_api_keys_by_default(render: Render) -> None:
    (app,) = serve_config(one(render(), "RayService"))["applications"]
    assert app["args"]["api_keys_file"] is None
    assert app["args"]["grpc"] == {"host": "0.0.0.0", "port": 50051}
    assert app["args"]["tool_call_parser"] is None
    assert app["args"]["reasoning_parser"] is None
    assert FrontDoorConfig.from_args(app["args"]).max_request_mb == 16
    (app,) = serve_config(one(render({"maxRequestMb": 64}), "RayService"))["applications"]
    assert FrontDoorConfig.from_args(app["args"]).max_request_mb == 64


def test_a_tool_call_parser_reaches_the_front_door(render: Render) -> None:
    (app,) = serve_config(one(render({"toolCallParser": "hermes"}), "RayService"))["applications"]
    assert FrontDoorConfig.from_args(app["args"]).tool_parser is PARSERS["hermes"]


def test_a_tier_with_stages_reaches_the_front_door(render: Render, target_dir: Path) -> None:
    stages = [{"name": "thinking", "tpot_ms": 50, "until": ":"}, {"tpot_ms": 100}]
    tier = {"name": "reasoning", "ttft_ms": 3000, "tpot_ms": 100, "stages": stages}
    (app,) = serve_config(one(render({"cluster": {"tiers": [tier]}}), "RayService"))["applications"]
    args = {**app["args"], "cluster": {**app["args"]["cluster"], "model": str(target_dir)}}
    tiers, _ = FrontDoorConfig.from_args(args).slos(TextCodec.from_dir(target_dir))
    assert [s.name for s in tiers["reasoning"].stages] == ["thinking", ""]
    assert tiers["reasoning"].stages[0].end_token_ids


def test_a_reasoning_parser_reaches_the_front_door(render: Render) -> None:
    (app,) = serve_config(one(render({"reasoningParser": "qwen3"}), "RayService"))["applications"]
    assert FrontDoorConfig.from_args(app["args"]).reasoning_parser is REASONING["qwen3"]
    markers = {"start": "[think]", "end": "[/think]", "starts_open": False}
    (app,) = serve_config(one(render({"reasoningParser": markers}), "RayService"))["applications"]
    parser = FrontDoorConfig.from_args(app["args"]).reasoning_parser
    assert parser == ReasoningParser("[think]", "[/think]", starts_open=False)


def gpu_group(gpus: int) -> dict[str, Any]:
    return {"name": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 2, "gpus": gpus}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"cluster": {"replicas": -1}}, r"/cluster/replicas': minimum: got -1, want 1"),
        (
            {"workerGroups": [{**gpu_group(0), "replicas": -2}]},
            r"/workerGroups/0/replicas': minimum: got -2, want 0",
        ),
        (
            {
                "cluster": {"tensor_parallel_size": 4, "num_gpus_per_replica": 4.0},
                "workerGroups": [gpu_group(6)],
            },
            r"/workerGroups/0/gpus': multipleOf: got 6, want 4",
        ),
        (
            {
                "cluster": {"tensor_parallel_size": 2, "num_gpus_per_replica": 2.0},
                "workerGroups": [gpu_group(0)],
            },
            r"/workerGroups/0/gpus': minimum: got 0, want 2",
        ),
        ({"cluster": {"tensor_parallel_size": 3}}, r"/cluster/tensor_parallel_size'"),
        ({"cluster": {"profile": ""}}, r"/cluster/profile': minLength"),
        (
            {"cluster": {"backup_policy": "drop"}},
            r"/cluster/backup_policy': value must be one of 'best_effort', 'reject'",
        ),
        ({"cluster": {"spec_policy": "fixed:0"}}, r"/cluster/spec_policy'"),
        ({"cluster": {"scheduler": "vllm"}}, r"/cluster/spec_policy'"),  # slos: a baseline's none
        ({"cluster": {"scheduler": "orca"}}, r"/cluster/scheduler'"),
        ({"cluster": {"adaserve": {"max_width": 6}}}, r"/cluster/spec_policy'"),
        (
            {"cluster": {"spec_policy": "adaserve", "adaserve": {"max_nodes": 0}}},
            r"/cluster/adaserve/max_nodes'",
        ),
        ({"cluster": {"autoscale": {"signal": "queue"}}}, r"/cluster/autoscale/signal'"),
        ({"cluster": {"autoscale": {"max_replicas": 0}}}, r"/cluster/autoscale/max_replicas'"),
        (
            {"cluster": {"tiers": [{"name": "r", "ttft_ms": 1, "tpot_ms": 1, "stages": [{}]}]}},
            r"/cluster/tiers/0/stages/0'",
        ),
        ({"reasoningParser": "granite"}, r"/reasoningParser'"),
        ({"reasoningParser": {"start": "<think>"}}, r"/reasoningParser'"),
        ({"clusterr": {}}, r"additional properties 'clusterr' not allowed"),
        ({"head": {"rayStartParams": {"num-cpus": 0}}}, r"/head/rayStartParams/num-cpus'"),
        (  # the ports values set them, where the container ports say
            {"head": {"rayStartParams": {"dashboard-port": "8266"}}},
            r"/head/rayStartParams/dashboard-port'",
        ),
        (
            {"workerGroups": [{**gpu_group(0), "rayStartParams": {"metrics-export-port": "9"}}]},
            r"/workerGroups/0/rayStartParams/metrics-export-port'",
        ),
        ({"defaultSlo": {"ttft_ms": 100}}, r"/defaultSlo'"),
        ({"defaultSlo": ""}, r"/defaultSlo'"),
        ({"defaultChatMaxTokens": 0}, r"/defaultChatMaxTokens': minimum: got 0, want 1"),
        ({"httpRequestTimeoutS": 0}, r"/httpRequestTimeoutS': exclusiveMinimum"),
        *(
            ({"cluster": {"spec_policy": policy, "draft": None}}, r"/cluster': missing .*'draft'")
            for policy in ("slos", "goodspeed", "specserve", "adaserve", "fixed:3")
        ),
        (
            {"cluster": {"scheduler": "vllm", "spec_policy": "none", "autoscale": {}}},
            r"/cluster/autoscale': missing property 'signal'",  # its default is slo
        ),
        (
            {
                "cluster": {
                    "scheduler": "sarathi",
                    "spec_policy": "none",
                    "autoscale": {"signal": "slo", "max_replicas": 2},
                }
            },
            r"/cluster/autoscale/signal': value must be 'ongoing'",
        ),
    ],
)
def test_bad_values_are_refused_at_install_time(
    render: Render, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmValuesError, match=message):
        render(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"cluster": {"replicas": 2, "autoscale": {"min_replicas": 3, "max_replicas": 2}}},
            r"cluster.autoscale.min_replicas \(3\) must be <= max_replicas \(2\)",
        ),
        (
            {"cluster": {"replicas": 5, "autoscale": {"max_replicas": 4}}},
            r"cluster.replicas \(5\) must be within cluster.autoscale's .* = \[1, 4\]",
        ),
        (  # the app's defaults: replicas 2, max_replicas 1
            {"cluster": {"autoscale": {"signal": "slo"}}},
            r"cluster.replicas \(2\) must be within cluster.autoscale's .* = \[1, 1\]",
        ),
        (
            {"cluster": {"tiers": [{"name": "a", "ttft_ms": 1, "tpot_ms": 1}] * 2}},
            "cluster.tiers: names must be unique, got a, a",
        ),
        ({"ports": {"http": 8000, "grpc": 8000}}, r"ports: http \(8000\), grpc \(8000\)"),
        ({"ports": {"metrics": 6379}}, r"from Ray's GCS and client ports \(6379, 10001\)"),
        (
            {"workerGroups": [{**gpu_group(0), "minReplicas": 3, "maxReplicas": 2}]},
            r"workerGroups\[gpu\]: minReplicas \(3\) must be <= maxReplicas \(2\)",
        ),
        (
            {"workerGroups": [{**gpu_group(0), "replicas": 0}]},
            r"workerGroups\[gpu\]: replicas \(0\) must be within .* = \[1, 2\]",
        ),
        (
            {"workerGroups": [{**gpu_group(0), "replicas": 3}]},
            r"workerGroups\[gpu\]: replicas \(3\) must be within .* = \[1, 2\]",
        ),
        (
            {"workerGroups": [gpu_group(0), gpu_group(0)]},
            "workerGroups: names must be unique, got gpu, gpu",
        ),
        ({"defaultSlo": "batch"}, r"defaultSlo: batch is not a tier of cluster.tiers \(chat, "),
    ],
)
def test_values_the_app_or_kuberay_would_refuse_fail_the_install(
    render: Render, values: dict[str, Any], message: str
) -> None:
    """Rules between two values, which the schema cannot state, are the templates' to check."""
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


def test_names_fit_kuberay_and_kubernetes(render: Render) -> None:
    """A long fullnameOverride is cut to the 47 characters KubeRay takes for a RayService's
    name (MaxRayServiceNameLength); the names with a suffix fit Kubernetes' 63 then too."""
    objects = render({**OPTIONS_ON, "fullnameOverride": "x" * 80})
    (service,) = [o for o in objects if o["kind"] == "RayService"]
    assert service["metadata"]["name"] == "x" * 47
    names = {o["metadata"]["name"] for o in objects}
    names.add(service["spec"]["serveService"]["metadata"]["name"])
    suffixes = ("-http", "-grpc", "-workers", "-metrics", "-door-metrics")
    assert {"x" * 47 + suffix for suffix in suffixes} <= names
    assert max(len(name) for name in names) == 60


@pytest.mark.parametrize(
    "cluster",
    [
        {"scheduler": "vllm", "spec_policy": "none"},
        {
            "scheduler": "vllm",
            "spec_policy": "none",
            "autoscale": {"max_replicas": 3, "signal": "ongoing"},
        },
        {"scheduler": "sarathi", "spec_policy": "none"},
        {"calibrate": True},
        {"resource_wait_s": 600.0},
        {"spec_policy": "adaserve", "adaserve": {"max_width": 6, "max_nodes": 24}},
        {"replicas": 1, "autoscale": {"min_replicas": 1, "max_replicas": 4, "signal": "slo"}},
    ],
)
def test_every_cluster_config_field_is_a_value(render: Render, cluster: dict[str, Any]) -> None:
    """`cluster` is ClusterConfig field for field: baselines and calibration install too."""
    (app,) = serve_config(one(render({"cluster": cluster}), "RayService"))["applications"]
    assert cluster.items() <= app["args"]["cluster"].items()


def test_the_cluster_schema_has_every_cluster_config_field() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    assert set(schema["properties"]["cluster"]["properties"]) == fields


def test_values_readme_lists_every_value() -> None:
    readme = (CHART / "README.md").read_text()

    def keys(node: Any, path: str) -> list[str]:
        """Dotted paths of the values; a resources block (ResourceRequirements) and a
        rayStartParams block (`ray start` flags) are one value each."""
        if isinstance(node, dict) and node and not path.endswith(("resources", "rayStartParams")):
            return [k for key, value in node.items() for k in keys(value, f"{path}.{key}")]
        return [path.lstrip(".")]

    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    listed = keys(defaults, "") + [f"workerGroups[].{k}" for k in defaults["workerGroups"][0]]
    missing = [k for k in listed if f"`{k}`" not in readme]
    assert missing == []
