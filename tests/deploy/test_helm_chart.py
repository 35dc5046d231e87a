"""The Helm chart in helm/kuangchao: lint, render, validate every manifest, and
check what the chart promises (secrets, topology, NetworkPolicies, dashboards,
least privilege). Offline: helm-python-sdk carries Helm's own Go library, so
no helm binary and no cluster are involved (`lookup` finds nothing there).
"""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from kuangchao.platform.jobs.redis_sizing import RedisSizing, parse_memory, size_of, sizing

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kuangchao"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
# The KubeRay CRD schemas the workplace provides beside the checkout (a clean
# clone elsewhere finds them at the workplace's own path); KC_KUBERAY_CRDS
# names another folder.
CRD_DIRS = [Path(p) for p in (os.environ.get("KC_KUBERAY_CRDS"),) if p] + [
    ROOT.parent / "shared" / "data" / "kuberay", Path("/work/shared/data/kuberay")]
K8S_VERSION = "1.34.0"
GPU_VALUES = yaml.safe_load((CHART / "ci" / "gpu-values.yaml").read_text())
# Checkpoints and data on an object store, no shared volume.
OBJECT_VALUES = yaml.safe_load((CHART / "ci" / "object-store-values.yaml").read_text())
CI_FILES = sorted((CHART / "ci").glob("*.yaml"))
# yaml.safe_load_all's loader, in C when PyYAML has it: the dashboards' JSON strings take
# the pure-Python scanner seconds.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# The other branches: a Secret of the operator's, no PVC, no policies, no dashboards, queues.
OTHER_VALUES = {"secrets": {"existingSecret": "my-kc"}, "redis": {"persistence": {"enabled": False}},
                "networkPolicy": {"enabled": False}, "grafana": {"dashboards": {"enabled": False}},
                "api": {"replicas": 1, "serviceAccount": {"create": False}}, "monitoring": {"enabled": True},
                "controlPlane": {"queues": {"queues": [{"name": "a", "guaranteed_gpus": 8}]}}}
ADMIN_KEY = re.compile(r"^kc_[0-9a-f]{16}_[A-Za-z0-9_-]{43}$")


def render_files(values: dict[str, Any] | None = None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name="kc", namespace="ml")


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = render_files(values)
    return [doc for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.load_all(text, Loader=SAFE_LOADER) if doc]


def find(docs: list[dict], kind: str, name_suffix: str = "") -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = find(docs, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {len(found)}"
    return found[0]


def secret_data(doc: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod template the render creates, as {name: template} (metadata + spec)."""
    pods = {d["metadata"]["name"]: d["spec"]["template"]
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for rc in find(docs, "RayCluster"):
        pods["ray-head"] = rc["spec"]["headGroupSpec"]["template"]
        for g in rc["spec"]["workerGroupSpecs"]:
            pods[f"ray-worker-{g['groupName']}"] = g["template"]
    return pods


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def gpu_docs() -> list[dict]:
    return render(GPU_VALUES)


@pytest.fixture(scope="module")
def object_docs() -> list[dict]:
    return render(OBJECT_VALUES)


@pytest.mark.parametrize("values", [None, *CI_FILES], ids=lambda v: v.name if v else "default")
def test_helm_lint_is_clean(values: Path | None) -> None:
    """The default values and every ci/*.yaml example lint clean (strict)."""
    given = yaml.safe_load(values.read_text()) if values is not None else None
    report = helm.lint(CHART, given, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    print(json.dumps(report, indent=1))
    assert not problems, f"helm lint: {problems}"


@functools.cache
def k8s_validator(kind: str, api_version: str) -> jsonschema.Draft202012Validator | None:
    """kubernetes-validate's strict schema for a kind, built once: its own `validate`
    re-reads the multi-megabyte definitions on every call (seconds per manifest)."""
    folder = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    try:
        schema = schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", K8S_VERSION)
    except FileNotFoundError:
        return None
    definitions = Resource.from_contents(schema_contents(f"{folder}/_definitions.json", K8S_VERSION))
    registry = definitions @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def k8s_validate(doc: dict) -> bool:
    """Validate against the Kubernetes schemas; False when they do not know the kind."""
    validator = k8s_validator(doc["kind"], doc["apiVersion"])
    if validator is not None:
        validator.validate(doc)
    return validator is not None


def _no_unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """The API server would prune fields a CRD schema does not declare; flag them instead."""
    bad: list[str] = []
    if isinstance(obj, dict) and "properties" in schema and not (
            schema.get("additionalProperties") or schema.get("x-kubernetes-preserve-unknown-fields")):
        for key, value in obj.items():
            if key not in schema["properties"]:
                bad.append(f"{path}.{key}")
            elif path.endswith(".template") and key == "metadata":
                continue  # ObjectMeta is checked by kubernetes-validate below
            else:
                bad += _no_unknown_fields(value, schema["properties"][key], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            bad += _no_unknown_fields(item, schema["items"], f"{path}[{i}]")
    return bad


@functools.cache
def raycluster_schema() -> dict:
    found = [d / "ray.io_rayclusters.yaml" for d in CRD_DIRS if (d / "ray.io_rayclusters.yaml").exists()]
    assert found, (f"no KubeRay CRD schema (ray.io_rayclusters.yaml) in {[str(d) for d in CRD_DIRS]}; "
                   "set KC_KUBERAY_CRDS to the folder holding it")
    crd = yaml.load(found[0].read_text(), Loader=SAFE_LOADER)
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def validate_raycluster(doc: dict) -> None:
    schema = raycluster_schema()
    assert doc["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(schema).validate(doc)  # not jsonschema.validate: no meta-check of 1 MB
    assert not _no_unknown_fields(doc["spec"], schema["properties"]["spec"], "spec")
    # The pod templates inside are core PodTemplateSpecs: strict Kubernetes schemas apply.
    spec = doc["spec"]
    for tpl in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        assert k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                             "template": tpl})
    # KubeRay's own admission rules (ray-operator utils/validation.go) that a schema cannot say.
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert "labels" not in group.get("rayStartParams", {}), "KubeRay rejects rayStartParams.labels"
        assert not (group.get("resources") and set(group.get("rayStartParams", {})) &
                    {"num-cpus", "num-gpus", "memory", "resources"}), "resources set twice"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])


def validate_monitor(doc: dict) -> None:
    # The Prometheus Operator ships no offline JSON schema we can use here, so
    # the fields Prometheus needs are checked by hand.
    spec = doc["spec"]
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and spec["selector"]["matchLabels"]
    key = "endpoints" if doc["kind"] == "ServiceMonitor" else "podMetricsEndpoints"
    for ep in spec[key]:
        assert isinstance(ep["port"], str) and ep["path"] == "/metrics"
        assert set(ep) <= {"port", "path", "interval", "honorLabels", "authorization", "relabelings"}
    if doc["kind"] == "ServiceMonitor":
        auth = spec["endpoints"][0]["authorization"]
        assert auth["type"] == "Bearer" and set(auth["credentials"]) == {"name", "key"}


CRD_VALIDATORS = {"RayCluster": validate_raycluster, "ServiceMonitor": validate_monitor,
                  "PodMonitor": validate_monitor}


@pytest.mark.parametrize("which", ["default", "gpu", "object", "other"])
def test_every_manifest_validates(which: str, request: pytest.FixtureRequest) -> None:
    docs = render(OTHER_VALUES) if which == "other" else request.getfixturevalue(f"{which}_docs")
    assert docs
    for doc in docs:
        if not k8s_validate(doc):
            assert doc["kind"] in CRD_VALIDATORS, f"{doc['kind']} is validated by nothing"
            CRD_VALIDATORS[doc["kind"]](doc)


def group(**kw: Any) -> dict:
    """Values with one worker group: a valid one, changed by `kw`."""
    g = {"name": "g", "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "gpus": 0, "cpu": 2,
         "memory": "4Gi", "leaf": "l0"}
    return {"ray": {"workerGroups": [{**g, **kw}]}}


@pytest.mark.parametrize(("values", "field"), [
    (group(gpus=-1), "gpus"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"api": {"replicaCount": 3}}, "replicaCount"),
    ({"secrets": {"adminKey": "kc_short"}}, "adminKey"),
    ({"monitoring": {"enabled": "yes"}}, "enabled"),
    (group(gpus=8, nvlink="0-1"), "nvlink"),
    # Checks the templates make (the schema cannot compare two fields).
    (group(replicas=5, maxReplicas=2), "maxReplicas"),
    (group(gpus=8, nvlink="0.1.2.3_4.5.6"), "nvlink"),
    ({"redis": {"external": {"url": "redis://a:b@r:6379/0", "existingSecret": "x"}}}, "existingSecret"),
])
def test_bad_values_are_refused_naming_the_field(values: dict, field: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert field in str(err.value), str(err.value)


def kc_secrets(docs: list[dict]) -> dict[str, str]:
    """The chart's two Secrets of generated values, merged (the Redis one only when bundled)."""
    return {**secret_data(one(docs, "Secret", "-secrets")),
            **{k: v for d in find(docs, "Secret", "-redis") for k, v in secret_data(d).items()}}


def test_secrets_are_generated_random_and_well_formed(default_docs: list[dict]) -> None:
    first = kc_secrets(default_docs)
    assert set(first) == {"signing-key.pem", "admin-key", "metrics-token", "ray-token", "password",
                          "users.acl", "url"}
    assert all(v.strip() for v in first.values())
    second = kc_secrets(render())
    for key in ("signing-key.pem", "admin-key", "metrics-token", "ray-token", "password"):
        assert first[key] != second[key], f"{key} is a constant, not generated"
    # The formats the deploy contract asks for.
    key = ser.load_pem_private_key(first["signing-key.pem"].encode(), password=None)
    assert isinstance(key, Ed25519PrivateKey)
    assert ADMIN_KEY.match(first["admin-key"]), first["admin-key"]
    pw = first["password"]
    assert first["url"] == f"redis://kc-admin:{pw}@kc-kuangchao-redis.ml.svc.cluster.local:6379/0"
    assert first["users.acl"].splitlines() == ["user default off", f"user kc-admin on >{pw} ~* &* +@all"]


def test_values_yaml_holds_no_secret() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    assert values["secrets"] == {"existingSecret": "", "signingKey": "", "adminKey": "", "metricsToken": "",
                                 "rayToken": ""}
    assert values["redis"]["password"] == "" and values["redis"]["external"]["url"] == ""
    assert "PRIVATE KEY" not in text and not re.search(r"kc_[0-9a-f]{16}_", text)
    # Comments may show the URL's shape (USER:PASSWORD); the values themselves hold none.
    assert not re.search(r"rediss?://[^\s\"']*:[^\s\"'@]+@", yaml.safe_dump(values))


def test_given_secrets_are_used_as_given() -> None:
    pem = Ed25519PrivateKey.generate().private_bytes(
        ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()).decode()
    given = {"signingKey": pem, "adminKey": "kc_0123456789abcdef_" + "A" * 20 + "b-_" + "9" * 20,
             "metricsToken": "m" * 32}
    docs = render({"secrets": given, "redis": {"password": "p" * 24}})
    s = kc_secrets(docs)
    assert (s["signing-key.pem"], s["admin-key"], s["metrics-token"]) == (
        given["signingKey"], given["adminKey"], given["metricsToken"])
    assert ":" + "p" * 24 + "@" in s["url"]
    scrape = one(docs, "Secret", "-kc-workers")["stringData"]["kc-workers.yaml"]
    assert yaml.safe_load(scrape)[0]["http_sd_configs"][0]["authorization"]["credentials"] == "m" * 32


def test_one_generated_value_per_render_and_checksums_follow_it(default_docs: list[dict]) -> None:
    s = kc_secrets(default_docs)
    scrape = yaml.safe_load(one(default_docs, "Secret", "-kc-workers")["stringData"]["kc-workers.yaml"])
    sd = scrape[0]["http_sd_configs"][0]
    assert sd["authorization"]["credentials"] == s["metrics-token"]
    assert sd["url"] == "http://kc-kuangchao-api.ml.svc.cluster.local:8000/v1/metrics/targets"
    # A rank's endpoint runs the job's code: its labels are not honoured, only kc_worker_* kept.
    assert scrape[0]["honor_labels"] is False
    assert scrape[0]["metric_relabel_configs"] == [
        {"source_labels": ["__name__"], "regex": "kc_worker_.*", "action": "keep"}]
    sha = lambda v: hashlib.sha256(v.encode()).hexdigest()  # noqa: E731
    url = s["url"]
    api = one(default_docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    head = one(default_docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert api == {"checksum/redis": sha(url), "checksum/metrics-token": sha(s["metrics-token"])}
    assert head == {"checksum/redis": sha(url), "checksum/signing-key": sha(s["signing-key.pem"]),
                    "checksum/admin-key": sha(s["admin-key"])}


def test_control_plane_sidecar_and_head(default_docs: list[dict]) -> None:
    rc = one(default_docs, "RayCluster")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head_group = rc["spec"]["headGroupSpec"]
    # The head takes no user work: no CPUs or GPUs, the control plane's resource.
    assert head_group["rayStartParams"] == {"num-cpus": "0", "num-gpus": "0",
                                            "resources": '"{\\"kc_control_plane\\": 10000}"',
                                            "dashboard-host": "0.0.0.0",
                                            "metrics-export-port": "8080"}
    assert head_group["labels"] == {"kc.io/role": "head"}
    pod = head_group["template"]["spec"]
    head, cp = pod["containers"]
    # `args`, not `command`: the image's entrypoint (tini) runs first.
    assert "command" not in head and "command" not in cp
    assert head["name"] == "ray-head" and head["args"][:3] == ["ray", "start", "--head"]
    assert {"--labels=kc.io/role=head", "--num-cpus=0", "--num-gpus=0",
            '--resources={"kc_control_plane": 10000}', "--metrics-export-port=8080", "--block"} <= set(
        head["args"])
    assert "kc control-plane start --address 127.0.0.1:6379 --watch 30" in cp["args"][-1]
    assert pod["shareProcessNamespace"] is True  # a Ray driver looks for the raylet's process
    volumes = {v["name"]: v for v in pod["volumes"]}
    # Secrets as files, never variables: the raylet's environment is every worker's
    # and driver's on the head, and the pod shares one process namespace.
    for container, names in ((head, {"KC_REDIS_URL_FILE", "RAY_AUTH_TOKEN_PATH"}),
                             (cp, {"KC_REDIS_URL_FILE", "RAY_AUTH_TOKEN_PATH", "KC_SIGNING_KEY_FILE",
                                   "KC_ADMIN_KEY_FILE"})):
        env = env_of(container)
        assert "KC_REDIS_URL" not in env and env["RAY_AUTH_MODE"]["value"] == "token"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for name in names:  # the file the variable names is where a Secret item lands
            folder, file = env[name]["value"].rsplit("/", 1)
            items = volumes[mounts[folder]]["secret"]["items"]
            assert [i["path"] for i in items] == [file]
        url = volumes[mounts[env["KC_REDIS_URL_FILE"]["value"].rsplit("/", 1)[0]]]["secret"]
        assert url["secretName"] == "kc-kuangchao-redis" and url["items"][0]["key"] == "url"
    # The signing key is not in the head container at all: the authority gets it
    # from the control-plane container, as its creation argument.
    assert "KC_ADMIN_KEY_FILE" not in env_of(head) and "KC_SIGNING_KEY_FILE" not in env_of(head)
    assert "signing-key" not in {m["name"] for m in head["volumeMounts"]}


def test_api_deployment(default_docs: list[dict], gpu_docs: list[dict]) -> None:
    dep = one(default_docs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (api,) = pod["containers"]
    assert api["args"] == ["python", "-m", "kuangchao.api.server", "--host", "0.0.0.0", "--port", "8000"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert api[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert api["ports"] == [{"name": "http", "containerPort": 8000}]
    assert api["securityContext"]["readOnlyRootFilesystem"] is True
    home = next(m for m in api["volumeMounts"] if m["mountPath"] == env_of(api)["KC_HOME"]["value"])
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == home["name"])
    assert env_of(api)["KC_RAY_ADDRESS"]["value"] == "kc-kuangchao-head-svc.ml.svc.cluster.local:6379"
    assert pod["automountServiceAccountToken"] is False
    assert one(default_docs, "ServiceAccount")["automountServiceAccountToken"] is False
    assert not find(default_docs, "Ingress") and one(gpu_docs, "Ingress")["spec"]["tls"]


def test_the_api_audit_file_is_on_a_claim_that_outlives_pods(default_docs: list[dict]) -> None:
    pod = one(default_docs, "Deployment")["spec"]["template"]["spec"]
    (api,) = pod["containers"]
    env = env_of(api)
    assert env["KC_AUDIT_FILE"]["value"] == "/var/lib/kuangchao-audit/$(POD_NAME).jsonl"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mount = next(m for m in api["volumeMounts"] if m["mountPath"] == "/var/lib/kuangchao-audit")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = one(default_docs, "PersistentVolumeClaim", "-audit")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    off = render({"api": {"audit": {"persistence": False}}})
    assert not find(off, "PersistentVolumeClaim", "-audit")
    pod = one(off, "Deployment")["spec"]["template"]["spec"]
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == mount["name"])


def test_external_redis_renders_no_redis_and_reaches_api_and_head(gpu_docs: list[dict]) -> None:
    for docs, ref in ((gpu_docs, {"name": "kc-redis", "key": "url"}),
                      (render({"redis": {"external": {"url": "redis://kc-admin:x@r.example:6379/0"}}}),
                       {"name": "kc-kuangchao-redis", "key": "url"})):
        assert not find(docs, "StatefulSet") and not find(docs, "NetworkPolicy", "-redis")
        pods = pod_specs(docs)
        for c in pods["kc-kuangchao-api"]["spec"]["containers"]:
            assert env_of(c)["KC_REDIS_URL"]["valueFrom"]["secretKeyRef"] == ref
        url = next(v["secret"] for v in pods["ray-head"]["spec"]["volumes"] if v["name"] == "redis-url")
        assert {"name": url["secretName"], "key": url["items"][0]["key"]} == ref
        # Workers get no admin Redis URL: ranks use the per-job users the authority mints.
        assert all("KC_REDIS_URL" not in env_of(c) for n, p in pods.items() if n.startswith("ray-worker")
                   for c in p["spec"]["containers"])
    assert secret_data(one(docs, "Secret", "-redis")) == {"url": "redis://kc-admin:x@r.example:6379/0"}


def test_workers_carry_topology_and_gpus(gpu_docs: list[dict]) -> None:
    groups = {g["groupName"]: g for g in one(gpu_docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    assert set(groups) == {g["name"] for g in GPU_VALUES["ray"]["workerGroups"]}
    for want in GPU_VALUES["ray"]["workerGroups"]:
        g = groups[want["name"]]
        (c,) = g["template"]["spec"]["containers"]
        cmd = c["args"]
        arg = functools.partial(lambda cmd, flag: cmd[cmd.index(flag) + 1], cmd)
        assert "command" not in c and cmd[:3] == ["kc", "node", "join"] and cmd[-1] == "--block"
        assert arg("--address") == "$(RAY_HEAD):6379" and arg("--name") == "$(POD_NAME)"
        assert env_of(c)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert (arg("--leaf"), arg("--nvlink"), arg("--gpus"), arg("--spine")) == (
            want["leaf"], want["nvlink"], "8", "spine-0")
        assert g["labels"] == {"kc.io/leaf": want["leaf"], "kc.io/spine": "spine-0",
                               "kc.io/nvlink": want["nvlink"]}
        pod_labels = g["template"]["metadata"]["labels"]
        assert pod_labels["kc.io/leaf"] == want["leaf"] and pod_labels["kc.io/nvlink"] == want["nvlink"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert g["resources"] == {"CPU": str(want["cpu"]), "GPU": "8",
                                  **{f"kc_gpu_{i}": "1" for i in range(8)}}
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert "--ray-arg=--metrics-export-port=8080" in cmd
    assert {"nodeSelector", "tolerations"} <= set(groups["a100-leaf-a"]["template"]["spec"])


def test_default_workers_are_cpu_only_and_checkpoints_shared(default_docs: list[dict],
                                                             gpu_docs: list[dict]) -> None:
    (g,) = one(default_docs, "RayCluster")["spec"]["workerGroupSpecs"]
    (c,) = g["template"]["spec"]["containers"]
    assert "--gpus" not in c["args"] and "--nvlink" not in c["args"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and "GPU" not in g["resources"]
    for docs, kind in ((default_docs, "emptyDir"), (gpu_docs, "persistentVolumeClaim")):
        for name, tpl in pod_specs(docs).items():
            if name.startswith("ray-"):
                vol = next(v for v in tpl["spec"]["volumes"] if v["name"] == "checkpoints")
                assert kind in vol
                mounts = {m["name"]: m["mountPath"] for m in tpl["spec"]["containers"][0]["volumeMounts"]}
                assert mounts["checkpoints"] == "/var/lib/kuangchao/checkpoints"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "the test only evaluates matchLabels"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admitted(policy: dict, pods: dict[str, dict]) -> dict[str, list]:
    """Pods of the release namespace the policy lets in, with the ports of the admitting rule."""
    out: dict[str, list] = {}
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            if set(peer) != {"podSelector"}:
                continue  # other namespaces or IP blocks: not one of the release's pods
            for name, tpl in pods.items():
                if selects(peer["podSelector"], tpl["metadata"]["labels"]):
                    out.setdefault(name, []).append(rule.get("ports", "all"))
    return out


def opens(ports: list[dict] | str, port: int, protocol: str = "TCP") -> bool:
    """Whether a rule's `ports` (or "all") let TCP `port` in."""
    if ports == "all":
        return True
    return any(p.get("protocol", "TCP") == protocol and p["port"] <= port <= p.get("endPort", p["port"])
               for p in ports)  # type: ignore[union-attr]


def test_redis_admits_only_api_and_ray_pods(default_docs: list[dict]) -> None:
    pods = pod_specs(default_docs)
    policy = one(default_docs, "NetworkPolicy", "-redis")
    assert selects(policy["spec"]["podSelector"], pods["kc-kuangchao-redis"]["metadata"]["labels"])
    assert [set(peer) for rule in policy["spec"]["ingress"] for peer in rule["from"]] == [{"podSelector"}] * 2
    let_in = admitted(policy, pods)
    assert set(let_in) == {"kc-kuangchao-api", "ray-head", "ray-worker-cpu"}
    assert all(p == [[{"port": 6379, "protocol": "TCP"}]] for p in let_in.values())


def redis_args(docs: list[dict]) -> dict[str, str]:
    """The bundled Redis's `--flag value` pairs."""
    args = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    return {args[i][2:]: args[i + 1] for i in range(0, len(args), 2)}


def chart_sizing(values: dict[str, Any]) -> RedisSizing:
    """What platform/jobs/redis_sizing.py gives for the cluster `values` declare."""
    autoscaling = values.get("ray", {}).get("autoscaling", {}).get("enabled", False)
    nodes = [(g["gpus"], g["cpu"]) for g in values["ray"]["workerGroups"]
             for _ in range(g["maxReplicas"] if autoscaling else g["replicas"])]
    return sizing(size_of(nodes, values.get("api", {}).get("replicas", 2)))


@pytest.mark.parametrize("values", [
    None,  # the default cpu group: 2 pods of 4 CPUs, 8 slots
    {"ray": {"workerGroups": [{**GPU_VALUES["ray"]["workerGroups"][0], "replicas": 96,
                               "maxReplicas": 128}]}, "api": {"replicas": 3}},
    {"ray": {"autoscaling": {"enabled": True}, "workerGroups": [
        {**g, "replicas": 1, "maxReplicas": 160} for g in GPU_VALUES["ray"]["workerGroups"]]}},
    {"ray": {"workerGroups": [{**GPU_VALUES["ray"]["workerGroups"][0], "gpus": 0, "nvlink": "", "cpu": 96,
                               "replicas": 40, "maxReplicas": 40}]}},
], ids=["default", "96x8-gpus", "autoscaled-2x160x8", "cpu-only-40x96"])
def test_redis_is_sized_for_the_declared_cluster_as_the_sizing_function_says(values) -> None:
    """The chart's integer steps (kuangchao.redisSizing) agree with the Python ones."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    given = values or {}
    want = chart_sizing({"ray": {**defaults["ray"], **given.get("ray", {})},
                         "api": {**defaults["api"], **given.get("api", {})}})
    args = redis_args(render(values))
    assert args["maxclients"] == str(want.maxclients)
    assert parse_memory(args["maxmemory"]) == want.maxmemory
    assert args["maxmemory-policy"] == "noeviction"
    if values is None:  # the floors: Redis's default maxclients and 2 GB
        assert (want.maxclients, args["maxmemory"]) == (10000, "2048mb")
    else:
        assert want.maxclients > 10000 and want.maxmemory > 2 << 30


def test_redis_limits_set_in_the_values_win() -> None:
    args = redis_args(render({"redis": {"maxclients": 20000, "maxmemory": "24gb"}}))
    assert (args["maxclients"], args["maxmemory"]) == ("20000", "24gb")


def test_ray_and_api_policies(default_docs: list[dict]) -> None:
    pods = pod_specs(default_docs)
    ray = one(default_docs, "NetworkPolicy", "-ray")
    # Ray pods reach each other on every port but the dashboard's (8265: the job API,
    # which a rank's code must not reach); the API only the GCS port of KC_RAY_ADDRESS.
    let_in = admitted(ray, pods)
    assert set(let_in) == {"ray-head", "ray-worker-cpu", "kc-kuangchao-api"}
    assert let_in["kc-kuangchao-api"] == [[{"port": 6379, "protocol": "TCP"}]]
    for name in ("ray-head", "ray-worker-cpu"):
        (ports,) = let_in[name]
        assert all(opens(ports, p) for p in (6379, 8080, 10002, 40000, 65535))
        assert not opens(ports, 8265), f"{name} reaches the job API"
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    # Prometheus reaches what the Ray pods do (8080 and the ranks' ephemeral ports).
    (rule,) = [r for r in ray["spec"]["ingress"] if prometheus in r["from"]]
    assert opens(rule["ports"], 8080) and opens(rule["ports"], 45000) and not opens(rule["ports"], 8265)
    assert all("ports" in r for r in ray["spec"]["ingress"]), "a rule without ports opens 8265"
    api = one(default_docs, "NetworkPolicy", "-api")
    rule = next(r for r in api["spec"]["ingress"] if r.get("ports"))
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}] and prometheus in rule["from"]
    opened = render({"networkPolicy": {"rayDashboardFrom": [{"podSelector": {"matchLabels": {"a": "b"}}}],
                                       "apiFrom": [], "prometheus": None}})
    ray = one(opened, "NetworkPolicy", "-ray")
    assert {"from": [{"podSelector": {"matchLabels": {"a": "b"}}}],
            "ports": [{"port": 8265, "protocol": "TCP"}]} in ray["spec"]["ingress"]
    # No sources for the API port: no rule at all, rather than an empty `from` (= everyone).
    assert one(opened, "NetworkPolicy", "-api")["spec"]["ingress"] == []
    assert not admitted(one(default_docs, "NetworkPolicy", "-api"), pods)


def test_monitors_only_when_enabled(default_docs: list[dict], gpu_docs: list[dict]) -> None:
    # Default "auto": offline there is no monitoring.coreos.com API, so no monitors.
    assert not find(default_docs, "ServiceMonitor") and not find(default_docs, "PodMonitor")
    sm, pm = one(gpu_docs, "ServiceMonitor"), one(gpu_docs, "PodMonitor")
    pods = pod_specs(gpu_docs)
    assert selects(sm["spec"]["selector"], one(gpu_docs, "Service", "-api")["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": "kc-kuangchao-secrets", "key": "metrics-token"}
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The scrape job names deploy/prometheus/alerts.yml and the dashboards expect.
    for mon, job in ((sm["spec"]["endpoints"][0], "kc-api"), (pm["spec"]["podMetricsEndpoints"][0], "ray")):
        assert {"targetLabel": "job", "replacement": job} in mon["relabelings"]
    ray_pods = {n for n, p in pods.items() if selects(pm["spec"]["selector"], p["metadata"]["labels"])}
    assert ray_pods == {n for n in pods if n.startswith("ray-")}
    for n in ray_pods:
        ports = {p["name"]: p["containerPort"] for p in pods[n]["spec"]["containers"][0]["ports"]}
        assert ports[pm["spec"]["podMetricsEndpoints"][0]["port"]] == 8080
    assert one(gpu_docs, "Secret", "-kc-workers")["metadata"]["namespace"] == "monitoring"


def test_dashboard_copies_equal_deploy_dashboards() -> None:
    originals = sorted(p.name for p in DASHBOARDS.glob("*.json"))
    assert len(originals) == 4
    assert sorted(p.name for p in (CHART / "dashboards").glob("*.json")) == originals
    for name in originals:
        assert (CHART / "dashboards" / name).read_bytes() == (DASHBOARDS / name).read_bytes(), (
            f"helm/kuangchao/dashboards/{name} differs from deploy/grafana/dashboards/{name}: copy it")


def test_dashboards_configmap(default_docs: list[dict]) -> None:
    cm = one(default_docs, "ConfigMap", "-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}
    relabelled = render({"grafana": {"dashboards": {"label": "kc_dash", "labelValue": "yes"}}})
    assert one(relabelled, "ConfigMap", "-dashboards")["metadata"]["labels"]["kc_dash"] == "yes"


def test_every_container_is_unprivileged(default_docs: list[dict], gpu_docs: list[dict]) -> None:
    for docs in (default_docs, gpu_docs):
        for name, tpl in pod_specs(docs).items():
            spec = tpl["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert spec["securityContext"]["runAsUser"] > 0, name
            for c in spec["containers"]:
                sc = c["securityContext"]
                assert sc["runAsNonRoot"] is True, (name, c["name"])
                assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
                assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False
                assert c["resources"]["requests"], (name, c["name"])
            if name.startswith("ray-worker") or name.endswith("-api"):
                assert spec["automountServiceAccountToken"] is False, name
        autoscaler = one(docs, "RayCluster")["spec"].get("autoscalerOptions")
        if autoscaler:
            assert autoscaler["securityContext"]["allowPrivilegeEscalation"] is False
            assert autoscaler["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_every_ray_process_presents_rays_token(default_docs: list[dict]) -> None:
    """RAY_AUTH_MODE=token on every container that runs or calls Ray, the token a
    file from the chart's Secret (key ray-token)."""
    pods = pod_specs(default_docs)
    checked = 0
    for name, pod in pods.items():
        if not (name.startswith("ray-") or name == "kc-kuangchao-api"):
            continue
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for c in pod["spec"]["containers"]:
            env = env_of(c)
            assert env["RAY_AUTH_MODE"]["value"] == "token", (name, c["name"])
            folder, file = env["RAY_AUTH_TOKEN_PATH"]["value"].rsplit("/", 1)
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == folder)
            item = volumes[mount["name"]]["secret"]["items"]
            assert item == [{"key": "ray-token", "path": file}] and "RAY_AUTH_TOKEN" not in env
            checked += 1
    assert checked >= 4  # head, control plane, a worker group, the API


# --- object storage (objectStore) ---------------------------------------------------

OBJECT_SETTINGS = {"KC_CHECKPOINT_URLS", "KC_DATA_URLS", "KC_OBJECT_STORE_CREDENTIALS",
                   "KC_OBJECT_STORE_ROLE_ARN", "AWS_ENDPOINT_URL", "AWS_REGION"}
OBJECT_KEYS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
NO_AMBIENT = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
              "AWS_CONFIG_FILE": "/dev/null"}


def refers_to_secret(node: Any, name: str) -> bool:
    """Whether anything in `node` (a pod template) names Secret `name`."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("secretKeyRef", "secretRef") and v.get("name") == name:
                return True
            if k == "secret" and isinstance(v, dict) and v.get("secretName") == name:
                return True
            if refers_to_secret(v, name):
                return True
    elif isinstance(node, list):
        return any(refers_to_secret(v, name) for v in node)
    return False


def test_object_store_settings_reach_the_api_and_the_head(object_docs: list[dict]) -> None:
    pods = pod_specs(object_docs)
    want = {"KC_CHECKPOINT_URLS": "s3://kc-checkpoints/prod", "KC_DATA_URLS": "s3://kc-datasets/tokenized",
            "KC_OBJECT_STORE_CREDENTIALS": "scoped", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": "https://minio.storage.svc.cluster.local:9000"}
    head, cp = pods["ray-head"]["spec"]["containers"]
    (api,) = pods["kc-kuangchao-api"]["spec"]["containers"]
    for c in (head, cp, api):
        env = env_of(c)
        assert {k: env[k]["value"] for k in want} == want, c["name"]
        assert "KC_OBJECT_STORE_ROLE_ARN" not in env  # roleArn empty: no variable
    # The operator's keys from the Secret: the API and the control-plane container only.
    for c in (cp, api):
        env = env_of(c)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "kc-object-store", "key": key}
        assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "kc-object-store", "key": "AWS_SESSION_TOKEN", "optional": True}
    # The raylet's environment is every worker's and driver's on the head: no key there,
    # and no file or instance role of the node to fall back on.
    assert not OBJECT_KEYS & set(env_of(head)) and not refers_to_secret(head, "kc-object-store")
    assert {k: env_of(head)[k]["value"] for k in NO_AMBIENT} == NO_AMBIENT
    assert not set(NO_AMBIENT) & (set(env_of(cp)) | set(env_of(api)))


def test_workers_carry_no_object_store_secret(object_docs: list[dict]) -> None:
    pods = pod_specs(object_docs)
    workers = {n: p for n, p in pods.items() if n.startswith("ray-worker")}
    assert workers
    for name, pod in workers.items():
        assert not refers_to_secret(pod, "kc-object-store"), name
        for c in pod["spec"]["containers"]:
            env = env_of(c)
            # Ranks get their job's credentials, endpoint and region from the authority,
            # and botocore finds nothing of the node's to fall back on.
            assert not (OBJECT_KEYS | OBJECT_SETTINGS) & set(env), (name, set(env))
            assert {k: env[k]["value"] for k in NO_AMBIENT} == NO_AMBIENT
            assert not any("valueFrom" in e and "secretKeyRef" in e["valueFrom"] for e in env.values())
            assert "envFrom" not in c
    # Nor does any other pod but the API and the head (Redis).
    for name, pod in pods.items():
        if name not in ("kc-kuangchao-api", "ray-head"):
            assert not refers_to_secret(pod, "kc-object-store"), name


def test_object_store_needs_no_shared_volume(object_docs: list[dict]) -> None:
    """No PersistentVolumeClaim is rendered and no pod mounts one: the checkpoints
    go to the store, node-local disk stages them."""
    assert not find(object_docs, "PersistentVolumeClaim")
    for name, tpl in pod_specs(object_docs).items():
        for v in tpl["spec"].get("volumes", []):
            assert "persistentVolumeClaim" not in v, (name, v)
        if name.startswith("ray-"):
            ckpt = next(v for v in tpl["spec"]["volumes"] if v["name"] == "checkpoints")
            assert "emptyDir" in ckpt
    (g,) = one(object_docs, "RayCluster")["spec"]["workerGroupSpecs"]
    volumes = {v["name"]: v for v in g["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in g["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["staging"] == "/var/lib/kuangchao/staging"
    assert volumes["staging"] == {"name": "staging", "emptyDir": {"sizeLimit": "100Gi"}}
    # Both ways at once: a claim for relative paths and the store for s3:// ones.
    both = render({**OBJECT_VALUES, "checkpoints": {"existingClaim": "kc-checkpoints"}})
    for name, tpl in pod_specs(both).items():
        if name.startswith("ray-"):
            ckpt = next(v for v in tpl["spec"]["volumes"] if v["name"] == "checkpoints")
            assert ckpt["persistentVolumeClaim"] == {"claimName": "kc-checkpoints"}


def test_without_an_object_store_nothing_of_it_renders(default_docs: list[dict],
                                                       gpu_docs: list[dict]) -> None:
    for docs in (default_docs, gpu_docs):
        for name, pod in pod_specs(docs).items():
            assert "staging" not in {v["name"] for v in pod["spec"].get("volumes", [])}, name
            for c in pod["spec"]["containers"]:
                unwanted = OBJECT_KEYS | OBJECT_SETTINGS | set(NO_AMBIENT)
                assert not unwanted & set(env_of(c)), (name, c["name"])


def test_object_store_role_and_shared_mode() -> None:
    arn = "arn:aws:iam::123456789012:role/kc-checkpoints"
    aws = {"objectStore": {"url": "s3://b/p", "existingSecret": "s", "roleArn": arn}}
    pods = pod_specs(render(aws))
    for c in (*pods["ray-head"]["spec"]["containers"], *pods["kc-kuangchao-api"]["spec"]["containers"]):
        env = env_of(c)
        assert env["KC_OBJECT_STORE_ROLE_ARN"]["value"] == arn
        assert env["KC_OBJECT_STORE_CREDENTIALS"]["value"] == "scoped"
        assert "AWS_ENDPOINT_URL" not in env and "AWS_REGION" not in env  # AWS S3's defaults
        assert "KC_DATA_URLS" not in env
    shared = pod_specs(render({"objectStore": {"url": "s3://b/p", "existingSecret": "s",
                                               "credentialsMode": "shared"}}))
    (api,) = shared["kc-kuangchao-api"]["spec"]["containers"]
    assert env_of(api)["KC_OBJECT_STORE_CREDENTIALS"]["value"] == "shared"
    # Even in shared mode the chart gives no pod but the API and head the keys:
    # the authority hands them to the job's ranks.
    assert not any(refers_to_secret(p, "s") for n, p in shared.items() if n.startswith("ray-worker"))


def test_notes_say_where_checkpoints_go() -> None:
    notes = render_files(OBJECT_VALUES)["kuangchao/templates/NOTES.txt"]
    assert "kc doctor --checkpoint-path s3://kc-checkpoints/prod" in notes and "WARNING" not in notes
    assert "WARNING: neither checkpoints.existingClaim nor objectStore.url" in \
        render_files()["kuangchao/templates/NOTES.txt"]
    assert "WARNING" not in render_files(GPU_VALUES)["kuangchao/templates/NOTES.txt"]


def store(**kw: Any) -> dict:
    """Values with a valid object store, changed by `kw`."""
    return {"objectStore": {"url": "s3://b/p", "existingSecret": "s", **kw}}


@pytest.mark.parametrize(("values", "field"), [
    (store(credentialsMode="none"), "credentialsMode"),
    (store(credentialsMode="Scoped"), "credentialsMode"),
    (store(url="kc-checkpoints/prod"), "url"),
    (store(url="file:///var/lib/kuangchao"), "url"),
    (store(dataUrls=["s3://"]), "dataUrls"),
    (store(endpoint="minio:9000"), "endpoint"),
    (store(roleArn="kc-role"), "roleArn"),
    (store(accessKey="AKIA..."), "accessKey"),
    # Checks the templates make.
    (store(url="file://host/var/lib/kuangchao"), "objectStore.url"),
    (store(url="s3://b/a/../other-job"), "objectStore.url"),
    (store(dataUrls=["s3://d/ok", "s3://d/a//b"]), "objectStore.dataUrls[1]"),
    (store(existingSecret=""), "existingSecret"),
    ({"objectStore": {"dataUrls": ["s3://d"]}}, "existingSecret"),
    (store(credentialsMode="shared", roleArn="arn:aws:iam::1:role/r"), "roleArn"),
])
def test_bad_object_store_values_are_refused(values: dict, field: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert field in str(err.value), str(err.value)


def test_the_chart_takes_the_urls_the_platform_takes() -> None:
    """What objectStore accepts and refuses agrees with the platform's own URL parser."""
    from kuangchao.platform.storage.urls import parse

    for url in ("s3://b", "s3://b/a/", "s3://kc-checkpoints/prod/.x/c.d", "gs://b/p"):
        parse(url)
        render(store(url=url))
    for url in ("s3://b/a/../x", "s3://b/.", "s3://b/a//x"):
        with pytest.raises(ValueError):
            parse(url)
        with pytest.raises(helm.HelmError):
            render(store(url=url))


def test_values_schema_validates_both_ways() -> None:
    """values.schema.json itself: the defaults (shared volume), the GPU example and the
    object-store example pass; a bad credentialsMode does not."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    check = jsonschema.Draft7Validator(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for values in (defaults, GPU_VALUES, OBJECT_VALUES, store(credentialsMode="shared", region="default")):
        assert not list(check.iter_errors(values))
    bad = copy.deepcopy(OBJECT_VALUES)
    bad["objectStore"]["credentialsMode"] = "operator"
    (err,) = check.iter_errors(bad)
    assert list(err.path) == ["objectStore", "credentialsMode"]
