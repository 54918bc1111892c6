"""The recipe's Kubernetes manifests (recipes/dsv41-flash-tp4-dspark/k8s/), without a cluster:
every object against the Kubernetes API's own schemas (kubernetes-validate, strict: unknown
fields refused), the LeaderWorkerSet and the Argo Rollouts AnalysisTemplate against their CRDs'
schemas (tests/schemas, whose pod templates and Job spec are Kubernetes' own), the analysis's
exit statuses mapped as the canary gives them (run against stand-in servers), and what the
recipe asks of them: the image's
entrypoint kept, no service links, /health_generate probes, the recipe's flags and arguments,
and the service links the pods would get if they were on still not stopping the pack."""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import re
import sys

import pytest

from sglang_dsv41_adapters.framework import runtime
from harness import zygote
from harness.engines import ROOT
from tests.deployment_image import ENV_FILE, read_env_file, read_server_args

K8S = ROOT / "recipes" / "dsv41-flash-tp4-dspark" / "k8s"
CRD_SCHEMAS = {"LeaderWorkerSet": ROOT / "tests" / "schemas" / "leaderworkerset-v1.json",
               "AnalysisTemplate": ROOT / "tests" / "schemas" / "argo-analysistemplate-v1alpha1.json"}
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


def crd_errors(document: dict, version: str) -> list[str]:
    """A custom resource against its CRD's schema, with Kubernetes' definitions (strict) beside it."""
    import jsonschema
    from referencing import Registry, Resource

    schema_dir = f"v{version}-local-strict"
    definitions = kubernetes_validate.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", version)
    schema = json.loads(CRD_SCHEMAS[document["kind"]].read_text())
    registry = Registry().with_resources([(definitions["$id"], Resource.from_contents(definitions))])
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return sorted(f"{e.json_path}: {e.message}" for e in validator.iter_errors(document))


def errors(document: dict, version: str) -> list[str]:
    if document["kind"] in CRD_SCHEMAS:
        return crd_errors(document, version)
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"$.{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


@pytest.mark.parametrize("version", KUBERNETES)
def test_every_object_is_valid_kubernetes(version):
    found = manifests()
    assert sorted(found) == ["analysistemplate.yaml", "configmap.yaml", "deployment.yaml", "leaderworkerset.yaml"]
    kinds = sorted(doc["kind"] for docs in found.values() for doc in docs)
    assert kinds == ["AnalysisTemplate", "ConfigMap", "Deployment", "LeaderWorkerSet", "Service", "Service"]
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
    ("AnalysisTemplate", lambda d: d["spec"]["metrics"][0].update(failureLimt=0), "failureLimt"),
    ("AnalysisTemplate", lambda d: d["spec"]["metrics"][0]["provider"].update(jobs={}), "jobs"),
    ("AnalysisTemplate", lambda d: job_spec(d)["podFailurePolicy"]["rules"][0].update(onExitCode={}), "onExitCode"),
    ("AnalysisTemplate", lambda d: job_spec(d)["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values="1 3"),
     "'1 3' is not of type 'array'"),
    ("AnalysisTemplate", lambda d: job_spec(d).update(backoffLimit="2"), "'2' is not of type 'integer'"),
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


# --- the Argo Rollouts analysis: the canary as a Job --------------------------------------------------------

def job_spec(template: dict) -> dict:
    return template["spec"]["metrics"][0]["provider"]["job"]["spec"]


def job_outcome(spec: dict, code: int, failures_before: int = 0) -> str:
    """What the Job controller makes of a container exiting `code`, by the Job's podFailurePolicy (rules in
    order, the first that matches; none: the failure counts against backoffLimit), and what Argo's job provider
    makes of that: Successful on Complete, Failed on Failed; "retried" while the backoff allows another pod."""
    if code == 0:
        return "Successful"
    counted = "retried" if failures_before < spec["backoffLimit"] else "Failed"
    for rule in spec["podFailurePolicy"]["rules"]:
        exits = rule.get("onExitCodes")
        if exits and (code in exits["values"]) == (exits["operator"] == "In"):
            return {"FailJob": "Failed", "Ignore": "retried", "Count": counted}[rule["action"]]
    return counted


def test_the_analysis_runs_the_canary_from_the_recipes_image_with_its_statuses_mapped():
    from sglang_dsv41_adapters.rollout import verdict

    (template,) = objects("AnalysisTemplate")
    spec = job_spec(template)
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert "command" not in container and container["image"] == image_of_the_recipe() and container["args"][0] == "canary"
    assert pod["restartPolicy"] == "Never" and pod["enableServiceLinks"] is False  # podFailurePolicy needs Never
    assert {r["onExitCodes"]["containerName"] for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r} == {
        container["name"]}
    statuses = dict(verdict.EXIT_STATUSES)
    assert sorted(statuses) == [verdict.EXIT_PASS, verdict.EXIT_FAIL, verdict.EXIT_INCONCLUSIVE, verdict.EXIT_USAGE,
                                verdict.EXIT_UNREACHABLE]
    outcomes = {code: job_outcome(spec, code) for code in statuses}
    assert outcomes == {0: "Successful", 1: "Failed", 3: "Failed", 64: "Failed", 75: "retried"}
    assert job_outcome(spec, 75, failures_before=spec["backoffLimit"]) == "Failed"
    assert all(outcomes[code] != "Successful" for code in statuses if code != verdict.EXIT_PASS)
    # every argument the Job passes is declared, and those without a value are the Rollout's to give
    used = set(re.findall(r"\{\{args\.([\w-]+)\}\}", json.dumps(spec)))
    declared = {a["name"]: a.get("value") for a in template["spec"]["args"]}
    assert used == set(declared) and {n for n, v in declared.items() if v is None} == {"baseline-url", "canary-url"}


def analysis_args(template: dict, values: dict) -> list[str]:
    """The container's args as Argo substitutes {{args.NAME}}."""
    (container,) = job_spec(template)["template"]["spec"]["containers"]
    given = {a["name"]: a.get("value") for a in template["spec"]["args"]} | values
    return [re.sub(r"\{\{args\.([\w-]+)\}\}", lambda m: given[m[1]], arg) for arg in container["args"]]


@pytest.mark.parametrize("case,canary,want", [
    ("pass", {}, "Successful"),
    ("fail", {"accept": 2.9}, "Failed"),
    ("inconclusive", {"baseline_verify_step": 0}, "Failed"),
])
def test_the_analysis_job_gives_argo_the_canarys_verdict(servers, case, canary, want):
    """The Job's args, substituted as Argo does, run through the pack's entrypoint (the image's) against stand-in
    servers; the exit status through the Job's podFailurePolicy to the metric's phase."""
    from tests.standin_server import metrics

    (template,) = objects("AnalysisTemplate")
    base = servers(metrics=metrics(verify_step=canary.pop("baseline_verify_step", 100)))
    new = servers(metrics=metrics(**canary))
    args = analysis_args(template, {"baseline-url": base.url, "canary-url": new.url, "window": "1"})
    done = zygote.run([sys.executable, str(ROOT / "entrypoint.py"), *args, "--interval", "0.2", "--stall", "0.5",
                       "--identifiers", "40", "--long", "1"], capture_output=True, text=True, timeout=300,
                      env={**os.environ, "PYTHONPATH": str(ROOT)})  # from a warm parent (harness.zygote)
    code = {"pass": 0, "fail": 1, "inconclusive": 3}[case]
    assert done.returncode == code, done.stdout + done.stderr
    assert re.search(rf"^canary {case.upper()}: compared ", done.stdout, re.M), done.stdout
    assert job_outcome(job_spec(template), done.returncode) == want
