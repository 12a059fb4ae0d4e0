"""deploy/, offline: the Helm chart (deploy/helm/myserve) and the plain manifests rendered from it
(deploy/kubernetes, one per values file in deploy/examples).

Every object of the plain manifests is validated always: built-in kinds by kubernetes-validate
(strict: unknown fields fail) at the chart's lowest Kubernetes version and its newest, KEDA's
ScaledObject and the inference extension's InferencePool by jsonschema against their CRDs' schemas
(deploy/schemas). With helm-python-sdk (the Helm v4 Go library, no helm binary) the chart is linted
and rendered, and each render must equal its plain manifest; other values are rendered and
validated too. Regenerate the plain manifests: python tests/test_deploy.py
"""

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "myserve"
# plain manifest -> (release name, values file in deploy/examples; None: the chart's defaults)
RENDERS = {
    "smollm2-cpu.yaml": ("smollm2", None),
    "llama-3.1-8b-h100.yaml": ("llama-8b-h100", "llama-3.1-8b-h100.yaml"),
    "llama-3.1-8b-tpu-v5e-8.yaml": ("llama-8b-tpu", "llama-3.1-8b-tpu-v5e-8.yaml"),
}
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobject_v1alpha1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepool_v1.json",
}
_min = re.match(r">=\s*(\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])
KUBE_VERSIONS = (_min.group(1), kubernetes_validate.utils.latest_version())
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def problems(doc: dict) -> list[str]:
    """Why the API server would refuse ``doc`` (as far as a schema tells), or []."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    name = (doc.get("metadata") or {}).get("name", "")
    found = [] if DNS_LABEL.match(name) else [f"{key} metadata.name {name!r} is not a DNS label"]
    if key in CRDS:
        schema = json.loads((DEPLOY / "schemas" / CRDS[key]).read_text())
        errors = jsonschema.Draft202012Validator(schema).iter_errors(doc)
        return found + [f"{key[1]} {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            found.append(f"{key} on Kubernetes {version}: {e.message if hasattr(e, 'message') else e}")
    return found


def documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def check_consistent(docs: list[dict]) -> None:
    """What the objects must agree on with each other, the image and the server."""
    objs = by_kind(docs)
    pod = objs["Deployment"]["spec"]["template"]
    (server,) = [c for c in pod["spec"]["containers"] if c["name"] == "myserve"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "command" not in server  # the image's entrypoint is the server; args are its flags
    assert re.search(r'^ENTRYPOINT \["python", "-m", "myserve.serve"', dockerfile, re.M)
    args, (port,) = server["args"], server["ports"]
    assert args[args.index("--port") + 1] == str(port["containerPort"]) and port["name"] == "http"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert server["startupProbe"]["failureThreshold"] * server["startupProbe"]["periodSeconds"] >= 600
    volume = re.search(r"^VOLUME (\S+)$", dockerfile, re.M).group(1)
    assert "cache" in {m["name"] for m in server["volumeMounts"] if m["mountPath"] == volume}
    chips = {k: v for k, v in server["resources"].get("limits", {}).items() if k.endswith(("/gpu", "/tpu"))}
    if chips:
        assert args[args.index("--tensor-parallel-size") + 1] == str(*chips.values())
    if "google.com/tpu" in chips:
        assert {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"} <= set(
            pod["spec"]["nodeSelector"]
        )
    for env in server.get("env", []):
        if env["name"] == "MYSERVE_API_KEY":
            assert "secretKeyRef" in env["valueFrom"]
    service = objs["Service"]["spec"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["ports"][0]["targetPort"] == "http"
    if "ScaledObject" in objs:
        scaled = objs["ScaledObject"]["spec"]
        assert scaled["scaleTargetRef"]["name"] == objs["Deployment"]["metadata"]["name"]
        assert "replicas" not in objs["Deployment"]["spec"]  # the HPA's
        name = args[args.index("--served-model-name") + 1]
        (trigger,) = scaled["triggers"]
        assert trigger["metadata"]["query"] == f'sum(vllm:num_requests_waiting{{model_name="{name}"}})'
        assert scaled["minReplicaCount"] >= 1
    if "InferencePool" in objs:
        pool = objs["InferencePool"]["spec"]
        assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert pool["targetPorts"] == [{"number": port["containerPort"]}]
        assert pool["endpointPickerRef"]["port"]["number"] > 0


def test_the_server_serves_what_the_manifests_use():
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "myserve").rglob("*.py"))
    assert '"vllm:num_requests_waiting"' in source and '"/health"' in source
    guard = (ROOT / "src" / "myserve" / "frontend" / "guard.py").read_text()
    assert re.search(r'OPEN_PATHS = \(.*"/health".*"/metrics"', guard)  # probes and scrapes need no key


def test_vendored_crd_schemas():
    for key, name in CRDS.items():
        schema = json.loads((DEPLOY / "schemas" / name).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["apiVersion"]["enum"] == [key[0]] and "from github.com/" in schema["$comment"]


@pytest.mark.parametrize("manifest", sorted(RENDERS))
def test_plain_manifest_is_valid(manifest):
    docs = documents((DEPLOY / "kubernetes" / manifest).read_text())
    assert [p for d in docs for p in problems(d)] == []
    check_consistent(docs)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service"} <= kinds
    if manifest != "smollm2-cpu.yaml":
        assert "ScaledObject" in kinds


def test_the_examples_cover_every_kind():
    kinds = {d["kind"] for m in RENDERS for d in documents((DEPLOY / "kubernetes" / m).read_text())}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "ScaledObject", "InferencePool"} <= kinds


def test_broken_documents_are_rejected():
    docs = by_kind(documents((DEPLOY / "kubernetes" / "llama-3.1-8b-h100.yaml").read_text()))
    breakages = {
        "Deployment": [
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="8000"),
            lambda d: d["spec"].update(replica=2),  # a misspelt field
            lambda d: d["spec"].pop("selector"),
        ],
        "Service": [lambda d: d["metadata"].update(name="Llama_8B")],
        "ScaledObject": [
            lambda d: d["spec"].update(minReplicaCount="1"),
            lambda d: d["spec"]["triggers"][0].pop("type"),
            lambda d: d["spec"].update(scaleTargetRef={}),
            lambda d: d.update(apiVersion="keda.sh/v1beta9"),
        ],
        "InferencePool": [
            lambda d: d["spec"].pop("targetPorts"),
            lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
            lambda d: d["spec"]["targetPorts"][0].update(number=70000),
        ],
    }
    for kind, breaks in breakages.items():
        assert problems(docs[kind]) == []
        for i, brk in enumerate(breaks):
            doc = copy.deepcopy(docs[kind])
            brk(doc)
            assert problems(doc), f"{kind} breakage {i} was not caught"
    with pytest.raises(AssertionError):
        broken = copy.deepcopy(list(docs.values()))
        by_kind(broken)["InferencePool"]["spec"]["targetPorts"] = [{"number": 9000}]
        check_consistent(broken)


def test_the_examples_set_only_the_charts_values():
    def unknown(values: dict, defaults: dict, at: str = "") -> list[str]:
        bad = []
        for key, value in values.items():
            if key not in defaults:
                bad.append(at + key)
            elif isinstance(value, dict) and defaults[key] and key != "resources":
                bad += unknown(value, defaults[key], f"{at}{key}.")
        return bad

    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for example in sorted((DEPLOY / "examples").glob("*.yaml")):
        assert unknown(yaml.safe_load(example.read_text()), defaults) == [], example.name


# --- the chart itself, where helm-python-sdk (the Helm v4 library) is installed ---

# In a child process: the Go runtime (its threads, its signal handlers) stays out of the test worker.
HELM = """
import json, sys
import helm_python as helm
job = json.load(sys.stdin)
try:
    if job.pop("op") == "lint":
        out = helm.lint(job.pop("chart"), strict=True, **job)
    else:
        out = helm.Chart.load(job.pop("chart")).render(namespace="default", **job)
    json.dump({"ok": out}, sys.stdout)
except helm.HelmError as e:
    json.dump({"error": f"{type(e).__name__}: {e}"}, sys.stdout)
"""


class HelmError(Exception):
    pass


def helm_call(**job):
    done = subprocess.run(
        [sys.executable, "-c", HELM], input=json.dumps(job), capture_output=True, text=True, timeout=120, check=True
    )
    answer = json.loads(done.stdout)
    if "error" in answer:
        raise HelmError(answer["error"])
    return answer["ok"]


@pytest.fixture(scope="module")
def helm():
    if importlib.util.find_spec("helm_python") is None:
        pytest.skip("helm-python-sdk is not installed")
    return helm_call


def render(helm, release: str, values: dict | None = None) -> str:
    manifests = helm(op="render", chart=str(CHART), values=values, name=release)
    return "".join(f"---\n# Source: {k}\n{v.strip()}\n" for k, v in sorted(manifests.items()) if v.strip())


def example(name: str | None) -> dict | None:
    return yaml.safe_load((DEPLOY / "examples" / name).read_text()) if name else None


def canonical(docs: list[dict]) -> list[str]:
    return sorted(json.dumps(d, sort_keys=True) for d in docs)


def test_chart_lints(helm):
    report = helm(op="lint", chart=str(CHART), kube_version=f"v{KUBE_VERSIONS[0]}.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("manifest", sorted(RENDERS))
def test_chart_renders_the_plain_manifest(helm, manifest):
    release, values = RENDERS[manifest]
    rendered = documents(render(helm, release, example(values)))
    assert canonical(rendered) == canonical(documents((DEPLOY / "kubernetes" / manifest).read_text())), (
        f"deploy/kubernetes/{manifest} is stale: python tests/test_deploy.py"
    )


@pytest.mark.parametrize(
    "values",
    [
        {"apiKey": {"value": "s3cret"}, "model": {"volume": {"hostPath": {"path": "/models"}}, "path": "/models/x"}},
        {"accelerator": {"type": "gpu", "count": 4}, "autoscaling": {"enabled": True}, "port": 9000},
        {"accelerator": {"type": "tpu", "count": 4, "tpu": {"topology": "2x2"}}, "inferencePool": {"enabled": True}},
        {"cache": {"persistentVolumeClaim": {"enabled": True, "existingClaim": "shared"}, "initOwnership": False}},
        {"strategy": {"type": "Recreate"}, "extraArgs": ["--max-model-len", "4096"], "replicas": 3},
    ],
)
def test_chart_values_render_valid_consistent_objects(helm, values):
    docs = documents(render(helm, "m", values))
    assert [p for d in docs for p in problems(d)] == []
    check_consistent(docs)
    objs = by_kind(docs)
    server = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    if "apiKey" in values:
        ref = server["env"][0]["valueFrom"]["secretKeyRef"]
        assert objs["Secret"]["metadata"]["name"] == ref["name"] and ref["key"] in objs["Secret"]["stringData"]
        assert server["args"][server["args"].index("--model") + 1] == "/models/x"
    if "accelerator" in values:
        resource = {"gpu": "nvidia.com/gpu", "tpu": "google.com/tpu"}[values["accelerator"]["type"]]
        assert server["resources"]["limits"][resource] == 4
    if "cache" in values:
        spec = objs["Deployment"]["spec"]["template"]["spec"]
        assert "initContainers" not in spec and "PersistentVolumeClaim" not in objs
        assert {"name": "cache", "persistentVolumeClaim": {"claimName": "shared"}} in spec["volumes"]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"accelerator": {"type": "fpga"}}, "accelerator.type must be cpu, gpu or tpu"),
        ({"autoscaling": {"enabled": True, "minReplicas": 0}}, "minReplicas must be at least 1"),
        ({"autoscaling": {"enabled": True}, "model": {"servedName": ""}}, "autoscaling needs model.servedName"),
    ],
)
def test_chart_refuses_bad_values(helm, values, message):
    with pytest.raises(HelmError, match="HelmRenderError: .*" + re.escape(message)):
        render(helm, "m", values)


if __name__ == "__main__":  # regenerate deploy/kubernetes from the chart
    for manifest, (release, values) in RENDERS.items():
        head = f"# helm template {release} deploy/helm/myserve" + (f" -f deploy/examples/{values}" if values else "")
        text = f"{head}\n# (generated by python tests/test_deploy.py; tests/test_deploy.py checks it)\n"
        (DEPLOY / "kubernetes" / manifest).write_text(text + render(helm_call, release, example(values)))
        print(manifest, file=sys.stderr)
