"""The recipe's Kubernetes manifests (recipes/dsv41-flash-tp4-dspark/k8s/), without a cluster:
every object against the Kubernetes API's own schemas (kubernetes-validate, strict: unknown
fields refused), the LeaderWorkerSet against its CRD's schema (tests/schemas, whose pod
templates are Kubernetes' own PodTemplateSpec), and what the recipe asks of them: the image's
entrypoint kept, no service links, /health_generate probes, the recipe's flags and arguments,
and the service links the pods would get if they were on still not stopping the pack."""

from __future__ import annotations

import copy
import ipaddress
import json
import re

import pytest

from sglang_dsv41_adapters.framework import runtime
from harness.engines import ROOT
from tests.test_image import ENV_FILE, read_env_file, read_server_args

K8S = ROOT / "recipes" / "dsv41-flash-tp4-dspark" / "k8s"
LWS_SCHEMA = ROOT / "tests" / "schemas" / "leaderworkerset-v1.json"
# The oldest Kubernetes release still maintained when this was written, and the newest the
# pinned kubernetes-validate knows.
KUBERNETES = ("1.32.0", "1.37.0")
SERVER = ["python3", "-m", "sglang.launch_server"]
MULTI_NODE = ["--nnodes=$(LWS_GROUP_SIZE)", "--node-rank=$(LWS_WORKER_INDEX)",
              "--dist-init-addr=$(LWS_LEADER_ADDRESS):20000"]

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate.utils", reason="kubernetes-validate is not installed (scripts/setup.sh pins it)")


def manifests() -> dict[str, list[dict]]:
    import yaml

    return {path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc] for path in sorted(K8S.glob("*.yaml"))}


def objects(kind: str) -> list[dict]:
    return [doc for docs in manifests().values() for doc in docs if doc["kind"] == kind]


def lws_errors(document: dict, version: str) -> list[str]:
    """The LeaderWorkerSet against its schema, with Kubernetes' definitions (strict) beside it."""
    import jsonschema
    from referencing import Registry, Resource

    schema_dir = f"v{version}-local-strict"
    definitions = kubernetes_validate.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", version)
    schema = json.loads(LWS_SCHEMA.read_text())
    registry = Registry().with_resources([(definitions["$id"], Resource.from_contents(definitions))])
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return sorted(f"{e.json_path}: {e.message}" for e in validator.iter_errors(document))


def errors(document: dict, version: str) -> list[str]:
    if document["kind"] == "LeaderWorkerSet":
        return lws_errors(document, version)
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"$.{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


@pytest.mark.parametrize("version", KUBERNETES)
def test_every_object_is_valid_kubernetes(version):
    found = manifests()
    assert sorted(found) == ["configmap.yaml", "deployment.yaml", "leaderworkerset.yaml"]
    kinds = sorted(doc["kind"] for docs in found.values() for doc in docs)
    assert kinds == ["ConfigMap", "Deployment", "LeaderWorkerSet", "Service", "Service"]
    for name, docs in found.items():
        for doc in docs:
            assert errors(doc, version) == [], (name, doc["kind"])


@pytest.mark.parametrize("kind,edit,error", [
    ("Deployment", lambda d: d["spec"]["template"]["spec"].update(enableServiceLink=False), "enableServiceLink"),
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(args="python3"), "args"),
    ("LeaderWorkerSet", lambda d: d["spec"]["leaderWorkerTemplate"].update(sise=2), "sise"),
    ("LeaderWorkerSet", lambda d: d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
     .update(readinesProbe={}), "readinesProbe"),
    ("LeaderWorkerSet", lambda d: d["spec"].update(startupPolicy="LeaderUp"), "LeaderUp"),
])
def test_the_validation_can_fail(kind, edit, error):
    (document,) = [copy.deepcopy(d) for d in objects(kind)]
    edit(document)
    found = errors(document, KUBERNETES[-1])
    assert found and error in " ".join(found), found


def pod_templates() -> list[tuple[str, dict]]:
    (deployment,) = objects("Deployment")
    (lws,) = objects("LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    return [("deployment", deployment["spec"]["template"]), ("leader", group["leaderTemplate"]),
            ("worker", group["workerTemplate"])]


def image_of_the_recipe() -> str:
    return re.search(r"^IMAGE=\$\{IMAGE:-([^}]+)\}$", (K8S.parent / "run.sh").read_text(), re.M)[1]


@pytest.mark.parametrize("where,template", pod_templates())
def test_the_pods_run_the_recipe_through_the_images_entrypoint(where, template):
    spec = template["spec"]
    assert spec["enableServiceLinks"] is False
    (container,) = spec["containers"]
    assert "command" not in container, "command would replace the image's entrypoint (the pack's checks)"
    assert container["image"] == image_of_the_recipe()
    extra = [] if where == "deployment" else MULTI_NODE
    assert container["args"] == SERVER + read_server_args() + extra
    (source,) = container["envFrom"]
    (configmap,) = objects("ConfigMap")
    assert source == {"configMapRef": {"name": configmap["metadata"]["name"]}}
    if where == "worker":  # node rank 1 serves no HTTP
        assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(container)
        return
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health_generate", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800, "30 minutes to load the model"


def test_the_configmap_carries_the_recipes_flags():
    (configmap,) = objects("ConfigMap")
    flags = {k: v for k, v in read_env_file(ENV_FILE).items() if k.startswith("DSV41_")}
    assert configmap["data"] == flags
    decision = runtime.decide(configmap["data"])
    assert not decision.refused, decision.reasons


def service_links(service: dict, address: str) -> dict[str, str]:
    """The variables Kubernetes gives a container for `service` unless enableServiceLinks is false
    (the kubelet's envvars.FromServices, for a ClusterIP `address`)."""
    prefix = service["metadata"]["name"].upper().replace("-", "_")
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    ports = service["spec"]["ports"]
    env = {f"{prefix}_SERVICE_HOST": address, f"{prefix}_SERVICE_PORT": str(ports[0]["port"])}
    for i, port in enumerate(ports):
        number, protocol = port["port"], port.get("protocol", "TCP")
        if "name" in port:
            env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(number)
        base = f"{prefix}_PORT_{number}_{protocol}"
        url = f"{protocol.lower()}://{host}:{number}"
        if i == 0:
            env[f"{prefix}_PORT"] = url
        env |= {base: url, f"{base}_PROTO": protocol.lower(), f"{base}_PORT": str(number), f"{base}_ADDR": address}
    return env


@pytest.mark.parametrize("address", ["10.96.12.7", "fd00:10:96::c"])
def test_the_pods_service_links_would_not_stop_the_pack(address):
    """Were enableServiceLinks left on (its default), the Services of these manifests, `dsv41`
    above all, would give each pod DSV41_* variables: the pack ignores them and starts."""
    (configmap,) = objects("ConfigMap")
    links = {}
    for service in objects("Service"):
        links |= service_links(service, address)
    assert "DSV41_PORT" in links and "DSV41_LEADER_SERVICE_HOST" in links
    environ = configmap["data"] | links
    assert runtime.unknown_flags(environ) == [] and runtime.service_links(environ) == sorted(links)
    assert not runtime.decide(environ).refused


def test_the_engine_reads_the_multi_node_arguments():
    """The LeaderWorkerSet's arguments as its pods get them, read by the engine's own parser."""
    from sglang_dsv41_adapters.framework import topology

    (lws,) = objects("LeaderWorkerSet")
    args = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
    values = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "dsv41-flash-tp4-dspark-0.example"}
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], arg) for arg in args[len(SERVER):]]
    namespace = topology.parse_server_argv(expanded)
    assert (namespace.nnodes, namespace.node_rank, namespace.tp_size) == (2, 1, 4)
    assert namespace.dist_init_addr == "dsv41-flash-tp4-dspark-0.example:20000"
