"""Kubernetes manifests: schema-valid (kubernetes-validate --strict), yamllint-clean, the
overlays render (our renderer; `kubectl kustomize` too where present, and both agree), and
what the deployment promises holds in the rendered objects."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter

from tests.deploy.kustomize_lite import apply_json_patch, load_docs, render
from tests.deploy.test_metrics import exported_sample_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("overlays/cpu", "overlays/gpu")
RENDERED = (*OVERLAYS, "overlays/cpu-tls", "overlays/gpu-multihost", "monitoring")


def shipped_versions() -> tuple[str, ...]:
    """The oldest and the newest Kubernetes versions kubernetes-validate ships strict
    schemas for (1.34 .. 1.37 with kubernetes-validate 1.37)."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    found = sorted(
        (tuple(int(x) for x in m.group(1).split(".")), m.group(1))
        for d in schemas.iterdir()
        if (m := re.fullmatch(r"v(\d+\.\d+\.\d+)-local-strict", d.name))
    )
    assert found, "kubernetes-validate ships no strict schemas"
    return tuple(dict.fromkeys((found[0][1], found[-1][1])))


K8S_VERSIONS = shipped_versions()
WORKERS = ("tandem-prefill", "tandem-decode")
Obj = dict[str, Any]


def by_key(objs: list[Obj]) -> dict[tuple[str, str], Obj]:
    out = {}
    for o in objs:
        key = (o["kind"], o["metadata"]["name"])
        assert key not in out, f"duplicate {key}"
        out[key] = o
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[tuple[str, str], Obj]]:
    return {name: by_key(render(K8S / name)) for name in RENDERED}


def resource_files() -> list[Path]:
    """Every manifest file that is a whole object (not kustomizations, not patches)."""
    files = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = load_docs(path)
        if docs and all(isinstance(d, dict) and "kind" in d for d in docs):
            files.append(path)
    return files


def container(obj: Obj, name: str | None = None) -> Obj:
    containers = obj["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


# ----------------------------------------------------------------------------- validity


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_passes_kubernetes_validate_strict(
    version: str, rendered: dict[str, dict[tuple[str, str], Obj]]
) -> None:
    objs = [o for path in resource_files() for o in load_docs(path)]
    objs += [o for r in rendered.values() for o in r.values()]
    assert len(objs) > 30
    failures = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_kubernetes_validate_strict_rejects_an_unknown_field(
    rendered: dict[str, dict[tuple[str, str], Obj]],
) -> None:
    """The validation above can fail: a misspelt field does."""
    import copy

    bad = copy.deepcopy(rendered["overlays/gpu"]["Deployment", "tandem-decode"])
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_yamllint_clean() -> None:
    conf = yamllint_config.YamlLintConfig(file=str(ROOT / "tests/deploy/yamllint.yaml"))
    compose = ("compose.yaml", "compose.cpu.yaml", "compose.tls.yaml")
    paths = [*sorted(K8S.rglob("*.yaml")), *(ROOT / name for name in compose)]
    problems = []
    for path in paths:
        for p in linter.run(path.read_text(), conf, str(path)):
            problems.append(f"{path.relative_to(ROOT)}:{p.line}:{p.column} {p.desc} ({p.rule})")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", RENDERED)
def test_our_renderer_agrees_with_kubectl_kustomize(
    name: str, rendered: dict[str, dict[tuple[str, str], Obj]]
) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / name)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert by_key([d for d in yaml.safe_load_all(out) if d]) == rendered[name]


def test_json_patch_subset() -> None:
    obj = {"a": {"list": [1, 2], "x": 1}}
    apply_json_patch(
        obj,
        [
            {"op": "add", "path": "/a/list/-", "value": 3},
            {"op": "add", "path": "/a/list/0", "value": 0},
            {"op": "replace", "path": "/a/x", "value": {"y": 2}},
            {"op": "remove", "path": "/a/list/1"},
            {"op": "add", "path": "/a/new~1key", "value": True},
        ],
    )
    assert obj == {"a": {"list": [0, 2, 3], "x": {"y": 2}, "new/key": True}}
    with pytest.raises(ValueError):
        apply_json_patch(obj, [{"op": "replace", "path": "/a/missing", "value": 1}])


# ----------------------------------------------------------------------------- shape


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_hold_every_component(
    overlay: str, rendered: dict[str, dict[tuple[str, str], Obj]]
) -> None:
    r = rendered[overlay]
    for name in ("tandem-frontend", "tandem-scheduler", "tandem-prefill", "tandem-decode"):
        assert ("Deployment", name) in r and ("Service", name) in r
    assert ("Deployment", "tandem-redis") in r and ("Service", "tandem-redis") in r
    assert ("ConfigMap", "tandem-config") in r
    for name in ("tandem-frontend", *WORKERS):
        assert ("PodDisruptionBudget", name) in r
    for name in WORKERS:
        assert ("HorizontalPodAutoscaler", name) in r
    assert all(o["metadata"].get("namespace") == "tandem" for o in r.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_grpc_health_on_the_serving_port(
    overlay: str, rendered: dict[str, dict[tuple[str, str], Obj]]
) -> None:
    for name in ("tandem-frontend", "tandem-scheduler", *WORKERS):
        c = container(rendered[overlay]["Deployment", name])
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port, (name, probe)
        # The port the service listens on is the one probed.
        args = c["args"]
        flag = "--grpc-port" if name == "tandem-frontend" else "--port"
        assert args[args.index(flag) + 1] == str(grpc_port)
        metrics = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        assert args[args.index("--metrics-port") + 1] == str(metrics)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_find_the_scheduler_by_service_name_and_drain_before_stopping(
    overlay: str, rendered: dict[str, dict[tuple[str, str], Obj]]
) -> None:
    r = rendered[overlay]
    config = r["ConfigMap", "tandem-config"]["data"]
    scheduler_port = r["Service", "tandem-scheduler"]["spec"]["ports"][0]["port"]
    assert config["TANDEM_SCHEDULER_ADDRESS"] == f"tandem-scheduler:{scheduler_port}"
    for name in WORKERS:
        pod = r["Deployment", name]["spec"]["template"]["spec"]
        c = container(r["Deployment", name])
        args = c["args"]
        assert args[args.index("--scheduler") + 1] == "$(TANDEM_SCHEDULER_ADDRESS)"
        assert args[args.index("--advertise-address") + 1] == "$(POD_IP):50060"
        assert args[args.index("--worker-id") + 1] == "$(POD_NAME)"
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
        assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[:4] == ["python", "-m", "tandem_services.common.entrypoint", "drain"]
        timeout = float(pre_stop[pre_stop.index("--timeout-s") + 1])
        grace = float(config["TANDEM_GRACE_PERIOD_S"])
        assert pod["terminationGracePeriodSeconds"] > timeout + grace
        assert "replicas" not in r["Deployment", name]["spec"], "the HPA owns the count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_in_args_resolves(
    overlay: str, rendered: dict[str, dict[tuple[str, str], Obj]]
) -> None:
    """$(VAR) in args expands only to variables the container has (else it stays literal)."""
    config = rendered[overlay]["ConfigMap", "tandem-config"]["data"]
    refs = 0
    for obj in rendered[overlay].values():
        if obj["kind"] != "Deployment":
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            known = {e["name"] for e in c.get("env", [])}
            if any(e["configMapRef"]["name"] == "tandem-config" for e in c.get("envFrom", [])):
                known |= set(config)
            for arg in c.get("args", []):
                for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert name in known, (obj["metadata"]["name"], arg)
                    refs += 1
    assert refs >= 15


def test_gpu_overlay_requests_one_gpu_per_worker_and_cpu_overlay_none(
    rendered: dict[str, dict[tuple[str, str], Obj]],
) -> None:
    for name in WORKERS:
        gpu = container(rendered["overlays/gpu"]["Deployment", name])
        assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert gpu["args"][-4:] == ["--device", "cuda", "--gpu-memory-utilization", "0.90"]
        assert gpu["image"] == "tandem:latest"
        cpu = container(rendered["overlays/cpu"]["Deployment", name])
        assert "nvidia.com/gpu" not in str(cpu["resources"])
        threads = cpu["args"][cpu["args"].index("--num-threads") + 1]
        assert threads == cpu["resources"]["limits"]["cpu"], "one thread per requested core"
        assert cpu["image"] == "tandem:cpu"
        assert rendered["overlays/gpu"]["Deployment", name]["spec"]["template"]["spec"]["hostIPC"]
        assert (
            "hostIPC"
            not in rendered["overlays/cpu"]["Deployment", name]["spec"]["template"]["spec"]
        )
        volumes = rendered["overlays/gpu"]["Deployment", name]["spec"]["template"]["spec"]
        cache = next(v for v in volumes["volumes"] if v["name"] == "model-cache")
        assert cache["persistentVolumeClaim"]["claimName"] == "tandem-model-cache"
    assert ("PersistentVolumeClaim", "tandem-model-cache") in rendered["overlays/gpu"]
    for r in rendered.values():
        for obj in r.values():
            if obj["kind"] != "Deployment" or obj["metadata"]["name"].startswith("tandem-prom"):
                continue
            security = obj["spec"]["template"]["spec"]["securityContext"]
            assert security["runAsNonRoot"] is True and security["runAsUser"] != 0


def adapter_series(series_query: str) -> set[str]:
    """Series names a prometheus-adapter seriesQuery selects (the forms our rules use)."""
    alternatives = re.search(r'__name__=~"([a-z_]*)\(([a-z_|]+)\)"', series_query)
    if alternatives:
        return {alternatives.group(1) + alt for alt in alternatives.group(2).split("|")}
    return {series_query.split("{")[0].strip()}


def test_hpas_scale_on_metrics_the_adapter_serves_from_series_we_export(
    rendered: dict[str, dict[tuple[str, str], Obj]],
) -> None:
    """Each HPA metric comes out of an adapter rule, and every rule reads series a tandem
    service exports."""
    adapter = rendered["monitoring"]["ConfigMap", "tandem-prometheus-adapter"]
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    exported = exported_sample_names()
    served: set[tuple[str, str]] = set()  # (custom metric name, resource)
    for rule in rules:
        names = adapter_series(rule["seriesQuery"])
        assert names <= exported, f"adapter reads {names - exported}, which nothing exports"
        pattern, as_ = rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1")
        for resource in {v["resource"] for v in rule["resources"]["overrides"].values()}:
            served |= {(re.sub(pattern, as_, n), resource) for n in names if re.match(pattern, n)}
    seen = 0
    for overlay in OVERLAYS:
        for name in WORKERS:
            hpa = rendered[overlay]["HorizontalPodAutoscaler", name]
            assert hpa["spec"]["scaleTargetRef"] == {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": name,
            }
            for m in hpa["spec"]["metrics"]:
                if m["type"] == "Pods":
                    assert (m["pods"]["metric"]["name"], "pod") in served, m
                else:
                    assert m["type"] == "Object", m
                    target = m["object"]["describedObject"]
                    assert (target["kind"], target["name"]) in rendered[overlay]
                    assert (m["object"]["metric"]["name"], target["kind"].lower()) in served, m
                seen += 1
    assert seen == 8
    decode = rendered["overlays/gpu"]["HorizontalPodAutoscaler", "tandem-decode"]["spec"]
    prefill = rendered["overlays/gpu"]["HorizontalPodAutoscaler", "tandem-prefill"]["spec"]
    assert {m["pods"]["metric"]["name"] for m in decode["metrics"]} == {
        "tandem_worker_kv_cache_usage_ratio",
        "tandem_worker_running_requests",
    }
    assert {m["type"] for m in prefill["metrics"]} == {"Pods", "Object"}


def test_tls_overlay_mounts_the_secret_and_probes_through_tls(
    rendered: dict[str, dict[tuple[str, str], Obj]],
) -> None:
    """overlays/cpu-tls: every service mounts the tandem-tls Secret where tandem-tls-config
    points its flags, and its probes are `entrypoint health` on its gRPC port (reading the
    same environment), not Kubernetes' plaintext gRPC probes."""
    r = rendered["overlays/cpu-tls"]
    env = r["ConfigMap", "tandem-tls-config"]["data"]
    for name in ("tandem-frontend", "tandem-scheduler", *WORKERS):
        deployment = r["Deployment", name]
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        volume = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "tandem-tls"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
        assert mount["readOnly"]
        for key in ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"):
            assert env[key].startswith(mount["mountPath"] + "/"), (name, key)
        assert {"configMapRef": {"name": "tandem-tls-config"}} in c["envFrom"]
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        for probe in ("readinessProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            assert command == [
                "python", "-m", "tandem_services.common.entrypoint", "health",
                f"127.0.0.1:{grpc_port}",
            ], (name, probe)  # fmt: skip
            assert "grpc" not in c[probe]


def test_multihost_worker_spans_two_pods_meeting_at_pod_zero(
    rendered: dict[str, dict[tuple[str, str], Obj]],
) -> None:
    """The multi-host overlay: a StatefulSet of two one-GPU pods, started together, whose
    ranks meet at pod 0's stable name; each pod's node rank is its index, and the entry point
    turns pod 0 into the unified worker and pod 1 into `tandem rank-host`."""
    from tandem_services.common.entrypoint import multihost_argv

    objs = rendered["overlays/gpu-multihost"]
    sts = objs["StatefulSet", "tandem-unified-mh"]
    svc = objs["Service", "tandem-unified-mh"]
    spec = sts["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == "tandem-unified-mh" and svc["spec"]["clusterIP"] == "None"
    worker = container(sts)
    args = worker["args"]
    assert args[0] == "multihost-worker"
    flag = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    tp, nnodes = int(flag["--tensor-parallel-size"]), int(flag["--nnodes"])
    assert nnodes == spec["replicas"] and tp % nnodes == 0
    assert flag["--master-addr"] == "tandem-unified-mh-0.tandem-unified-mh"
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus * nnodes == tp
    env = {e["name"]: e for e in worker["env"]}
    assert "pod-index" in env["TANDEM_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert env["NCCL_NVLS_ENABLE"]["value"] == "0"
    leader = multihost_argv({"TANDEM_NODE_RANK": "0"}, args[1:])
    follower = multihost_argv({"TANDEM_NODE_RANK": "1"}, args[1:])
    assert leader[2:4] == ["tandem_services.decode_worker", "--unified"]
    assert leader[-2:] == ["--node-rank", "0"]
    assert follower[2:4] == ["tandem.cli", "rank-host"] and follower[-2:] == ["--node-rank", "1"]
    # The worker's own flags reach rank-host too: it keeps the engine flags, ignores the rest.
    from tandem.engine_args import EngineArgs
    from tandem.entrypoints.rank_host import build_parser

    # $(VAR) references are the kubelet's to expand: stand in values for them.
    expanded = [re.sub(r"\$\((\w+)\)", "1", a) if a.startswith("$(") else a for a in follower]
    ns, _ = build_parser().parse_known_args(expanded[4:])
    config = EngineArgs.from_cli_args(ns).create_engine_config(resolve=False)
    assert (config.parallel.node_rank, config.parallel.nnodes) == (1, nnodes)
    assert config.parallel.tensor_parallel_size == tp
