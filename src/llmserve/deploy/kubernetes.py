"""``llmserve render --target kubernetes``: the spec as Kubernetes manifests.

Objects (``<d>`` = deployment name, ``<m>`` = model name)::

    Namespace                     kubernetes.namespace
    ConfigMap  <d>-config         llmserve.yaml (the spec) and gateway.yaml
    Secret     <d>-secrets        LLMSERVE_MASTER_KEY, AWS_* (placeholders: fill them)
    per model <m> of the spec (each with the label llmserve.dev/model=<m>):
    StatefulSet <d>-<m>           workers; stable names <d>-<m>-<i>.<d>-<m> so the router
    Service    <d>-<m> (headless)   can list every replica up to replicas.max; readiness,
                                  startup and liveness probes on /health
      (pp > 1: one StatefulSet <d>-<m>-g<i> per replica group, pp pods each, one per node)
    HorizontalPodAutoscaler <d>-<m>   on per-pod custom metrics through prometheus-adapter
                                  (only that model's pods), its own min/max replicas
    PodDisruptionBudget <d>-<m>   that model's workers
    ConfigMap  <d>-prometheus-adapter the adapter rules that expose those metrics
    Deployment+Service <d>-router, <d>-gateway, <d>-redis (unless redis.url); one router
      lists every model's workers and routes by the request's ``model``
    PodDisruptionBudget per component
    NetworkPolicy: default deny; router -> workers; gateway -> router; gateway, router
                   (and workers with worker.kv_store) -> redis; anyone -> gateway;
                   Prometheus -> /metrics

Isolation (``isolation``): ``runtimeClassName`` (Kata Containers; confidential
defaults ``kata-qemu-tdx`` / ``kata-qemu-snp``), node selection on Node Feature
Discovery's ``cpu-security`` labels for Intel TDX / AMD SEV-SNP, non-root,
read-only root filesystem (writable emptyDirs for /tmp and the model cache),
``capabilities: drop [ALL]``, no privilege escalation, RuntimeDefault seccomp.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import yaml

from llmserve.deploy.spec import DeploymentSpec, ModelSpec
from llmserve.deploy.worker_args import worker_args

WORKER_PORT, ROUTER_PORT, GATEWAY_PORT, REDIS_PORT = 8000, 8080, 8081, 6379
CONFIDENTIAL = {  # node label (Node Feature Discovery), default runtime class (CoCo)
    "tdx": ("feature.node.kubernetes.io/cpu-security.tdx.enabled", "kata-qemu-tdx"),
    "sev-snp": ("feature.node.kubernetes.io/cpu-security.sev.snp.enabled", "kata-qemu-snp"),
}
# per-pod metrics the adapter exposes, the same targets the local autoscaler uses:
# HPA name -> (Prometheus series the rule discovers, spec target field, metricsQuery)
_AVG = "avg(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
HPA_METRICS = {
    "llmserve_num_requests_waiting": ("llmserve:num_requests_waiting",
                                      "target_num_requests_waiting", _AVG),
    "llmserve_concurrency": (  # running + waiting (Knative KPA's concurrency)
        "llmserve:num_requests_running", "target_concurrency",
        "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>) + sum("
        "llmserve:num_requests_waiting{<<.LabelMatchers>>}) by (<<.GroupBy>>)"),
    "llmserve_kv_cache_usage_perc": ("llmserve:kv_cache_usage_perc",
                                     "target_kv_cache_usage", _AVG),
    "llmserve_time_to_first_token_seconds_p90": (  # per pod, over the last minute
        "llmserve:time_to_first_token_seconds_bucket", "target_ttft_p90_s",
        "histogram_quantile(0.9, sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) "
        "by (le, <<.GroupBy>>))"),
}


def _labels(spec: DeploymentSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"{spec.name}-{component}",
            "app.kubernetes.io/part-of": spec.name, "app.kubernetes.io/component": component}


def _meta(spec: DeploymentSpec, name: str, component: str) -> dict:
    return {"name": name, "namespace": spec.kubernetes.namespace,
            "labels": _labels(spec, component)}


def _security(spec: DeploymentSpec) -> tuple[dict, dict]:
    """(pod securityContext, container securityContext)."""
    iso = spec.isolation
    pod = {"runAsNonRoot": True, "runAsUser": iso.run_as_user, "runAsGroup": iso.run_as_user,
           "fsGroup": iso.run_as_user, "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "privileged": False,
                 "readOnlyRootFilesystem": iso.read_only_root_filesystem,
                 "capabilities": {"drop": ["ALL"]}}
    return pod, container


def _pod_spec(spec: DeploymentSpec, containers: list[dict], isolate: bool,
              init: list[dict] | None = None, volumes: list[dict] | None = None) -> dict:
    pod_sec, _ = _security(spec)
    out: dict[str, Any] = {"securityContext": pod_sec, "automountServiceAccountToken": False,
                           "enableServiceLinks": False, "containers": containers,
                           "volumes": [{"name": "tmp", "emptyDir": {}}, *(volumes or [])]}
    if init:
        out["initContainers"] = init
    iso = spec.isolation
    if isolate:  # the workers hold the weights and see the prompts
        runtime = iso.runtime_class_name
        if iso.confidential:
            label, default_runtime = CONFIDENTIAL[iso.confidential]
            out["nodeSelector"] = {label: "true"}
            runtime = runtime or default_runtime
        if runtime:
            out["runtimeClassName"] = runtime
    return out


def _container(spec: DeploymentSpec, name: str, args: list[str], port: int,
               env: list[dict] | None = None, mounts: list[dict] | None = None,
               resources: dict | None = None, probes: bool = True) -> dict:
    _, sec = _security(spec)
    c: dict[str, Any] = {
        "name": name, "image": spec.kubernetes.image,
        "imagePullPolicy": spec.kubernetes.image_pull_policy,
        "command": ["llmserve"], "args": args, "securityContext": sec,
        "ports": [{"name": "http", "containerPort": port}],
        "env": [{"name": "HOME", "value": "/tmp"}, *(env or [])],
        "envFrom": [{"secretRef": {"name": f"{spec.name}-secrets", "optional": True}}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *(mounts or [])],
        "resources": resources or {"requests": {"cpu": "250m", "memory": "256Mi"},
                                   "limits": {"memory": "1Gi"}}}
    if probes:
        get = {"httpGet": {"path": "/health", "port": "http"}}
        c["readinessProbe"] = {**get, "periodSeconds": 5, "failureThreshold": 2}
        c["livenessProbe"] = {**get, "periodSeconds": 10, "failureThreshold": 6}
        c["startupProbe"] = {**get, "periodSeconds": 10, "failureThreshold": 180}
    return c


def _worker_labels(spec: DeploymentSpec, m: ModelSpec) -> dict[str, str]:
    return {**_labels(spec, "worker"), "llmserve.dev/model": m.name}


def _workers(spec: DeploymentSpec, m: ModelSpec, redis_url: str
             ) -> tuple[list[dict], list[str]]:
    """Model ``m``'s worker objects and router URLs (every replica up to max)."""
    k = spec.kubernetes
    w = m.worker
    base = f"{spec.name}-{m.name}"
    multi_node = k.accelerator_resource is not None and w.tp * w.pp > k.gpus_per_node
    per_pod = w.tp if multi_node else w.tp * w.pp
    if multi_node and w.tp > k.gpus_per_node:
        raise ValueError(f"models.{m.name}.worker.tp: tp {w.tp} does not fit one node of "
                         f"{k.gpus_per_node} accelerators (kubernetes.gpus_per_node)")
    resources: dict[str, Any] = {"requests": {"cpu": k.worker_cpu, "memory": k.worker_memory},
                                 "limits": {"memory": k.worker_memory}}
    if k.accelerator_resource:
        resources["requests"][k.accelerator_resource] = str(per_pod)
        resources["limits"][k.accelerator_resource] = str(per_pod)
    source_env = [{"name": n, "value": v} for n, v in (
        ("LLMSERVE_S3_BUCKET", spec.s3.bucket), ("LLMSERVE_S3_REGION", spec.s3.region),
        ("LLMSERVE_S3_PREFIX", spec.s3.prefix),
        ("LLMSERVE_S3_ENDPOINT_URL", spec.s3.endpoint_url or ""),
        ("LLMSERVE_REGISTRY_CACHE", "/models"))]
    mounts = [{"name": "models", "mountPath": "/models"}]
    volumes = [{"name": "models", "emptyDir": {}}]
    init = None
    if m.source.startswith("registry://"):  # KServe-style storage initializer
        init = [_container(spec, "storage-initializer",
                           ["registry", "pull", m.source, "--no-progress"], WORKER_PORT,
                           env=source_env, mounts=mounts, probes=False)]
        del init[0]["ports"]
    env = list(source_env)
    if multi_node:
        env += [{"name": "LLMSERVE_NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
                {"name": "LLMSERVE_NNODES", "value": str(w.pp)}]
    container = _container(spec, "worker", ["serve", "--host", "0.0.0.0", "--port",
                                            str(WORKER_PORT), *worker_args(m, None, redis_url)],
                           WORKER_PORT, env=env,
                           mounts=mounts, resources=resources)
    objs: list[dict] = []
    urls: list[str] = []
    groups = [(base, m.replicas.min)] if not multi_node else [
        (f"{base}-g{i}", w.pp) for i in range(max(m.replicas.min, 1))]
    for name, replicas in groups:
        labels = {**_worker_labels(spec, m), "llmserve.dev/group": name}
        pod = _pod_spec(spec, [container], isolate=True, init=init, volumes=volumes)
        objs.append({"apiVersion": "v1", "kind": "Service",
                     "metadata": _meta(spec, name, "worker"),
                     "spec": {"clusterIP": "None", "selector": labels,
                              "publishNotReadyAddresses": True,
                              "ports": [{"name": "http", "port": WORKER_PORT}]}})
        objs.append({"apiVersion": "apps/v1", "kind": "StatefulSet",
                     "metadata": _meta(spec, name, "worker"),
                     "spec": {"serviceName": name, "replicas": replicas,
                              "podManagementPolicy": "Parallel",
                              "selector": {"matchLabels": labels},
                              "template": {"metadata": {"labels": labels}, "spec": pod}}})
        svc = f"{name}.{k.namespace}.svc"
        if multi_node:  # the router talks to each group's rank-0 pod
            urls.append(f"http://{name}-0.{svc}:{WORKER_PORT}")
        else:
            urls += [f"http://{name}-{i}.{svc}:{WORKER_PORT}" for i in range(m.replicas.max)]
    if not multi_node and m.replicas.max > m.replicas.min:
        objs.append(_hpa(spec, m, base))
    objs.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                 "metadata": _meta(spec, base, "worker"),
                 "spec": {"maxUnavailable": 1, "selector": {"matchLabels":
                                                            _worker_labels(spec, m)}}})
    return objs, urls


def _hpa(spec: DeploymentSpec, m: ModelSpec, target: str) -> dict:
    a = spec.autoscaling
    metrics = []
    for name, (_, field, _) in HPA_METRICS.items():
        value = getattr(a, field)
        if value:
            metrics.append({"type": "Pods", "pods": {
                "metric": {"name": name},
                "target": {"type": "AverageValue", "averageValue": f"{round(value * 1000)}m"}}})
    up_pct = round((a.max_scale_up_rate - 1) * 100)
    down_pct = round((1 - 1 / a.max_scale_down_rate) * 100)
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(spec, target, "worker"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                        "name": target},
                     "minReplicas": max(m.replicas.min, 1),
                     "maxReplicas": m.replicas.max, "metrics": metrics,
                     "behavior": {
                         "scaleUp": {"stabilizationWindowSeconds": round(a.scale_up_cooldown_s),
                                     "policies": [{"type": "Percent", "value": up_pct,
                                                   "periodSeconds": 15}]},
                         "scaleDown": {"stabilizationWindowSeconds":
                                       round(max(a.stable_window_s, a.scale_down_cooldown_s)),
                                       "policies": [{"type": "Percent", "value": down_pct,
                                                     "periodSeconds": 60}]}}}}


def _adapter_rules(spec: DeploymentSpec) -> dict:
    rules = [{"seriesQuery": f'{series}{{namespace!="",pod!=""}}',
              "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                          "pod": {"resource": "pod"}}},
              "name": {"matches": f"^{series}$", "as": name},
              "metricsQuery": query}
             for name, (series, field, query) in HPA_METRICS.items()
             if getattr(spec.autoscaling, field)]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(spec, f"{spec.name}-prometheus-adapter", "autoscaling"),
            "data": {"config.yaml": yaml.safe_dump({"rules": rules}, sort_keys=False)}}


def _service_deploy(spec: DeploymentSpec, component: str, replicas: int, args: list[str],
                    port: int, image: str | None = None) -> list[dict]:
    name = f"{spec.name}-{component}"
    labels = _labels(spec, component)
    c = _container(spec, component, args, port,
                   mounts=[{"name": "config", "mountPath": "/etc/llmserve",
                            "readOnly": True}])
    if image:  # redis: its own image and entry point, no /health
        c.update(image=image, command=["redis-server"], args=args)
        for p in ("readinessProbe", "livenessProbe", "startupProbe"):
            c[p] = {"tcpSocket": {"port": "http"}, "periodSeconds": 5}
    pod = _pod_spec(spec, [c], isolate=False,
                    volumes=[{"name": "config", "configMap": {"name": f"{spec.name}-config"}}])
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, name,
                                                                             component),
             "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": pod}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name, component),
             "spec": {"selector": labels, "ports": [{"name": "http", "port": port,
                                                     "targetPort": "http"}]}},
            {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
             "metadata": _meta(spec, name, component),
             "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}}}]


def _allow(spec: DeploymentSpec, name: str, to: str, sources: list[dict] | None,
           port: int) -> dict:
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": port}]}
    if sources is not None:
        rule["from"] = sources
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(spec, f"{spec.name}-{name}", "network"),
            "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/component": to,
                                                     "app.kubernetes.io/part-of": spec.name}},
                     "policyTypes": ["Ingress"], "ingress": [rule]}}


def _network_policies(spec: DeploymentSpec) -> list[dict]:
    pod = lambda c: {"podSelector": {"matchLabels": {  # noqa: E731
        "app.kubernetes.io/component": c, "app.kubernetes.io/part-of": spec.name}}}
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}
    deny = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(spec, f"{spec.name}-default-deny", "network"),
            "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": spec.name}},
                     "policyTypes": ["Ingress"]}}
    out = [deny, _allow(spec, "router-to-workers", "worker", [pod("router"), prometheus],
                        WORKER_PORT),
           _allow(spec, "gateway-to-router", "router", [pod("gateway"), prometheus],
                  ROUTER_PORT),
           _allow(spec, "clients-to-gateway", "gateway", None, GATEWAY_PORT)]
    if spec.redis.url is None:
        sources = [pod("gateway"), pod("router")]
        if any(m.worker.kv_store for m in spec.models):  # the shared KV store
            sources.append(pod("worker"))
        out.append(_allow(spec, "to-redis", "redis", sources, REDIS_PORT))
    return out


def render_kubernetes(spec: DeploymentSpec, spec_text: str | None = None) -> list[dict]:
    """Every object for ``spec`` (see the module docstring), in apply order.

    Raises:
        ValueError: a worker shape that does not fit ``kubernetes.gpus_per_node``.
    """
    k = spec.kubernetes
    redis_url = spec.redis.url or f"redis://{spec.name}-redis.{k.namespace}.svc:{REDIS_PORT}/0"
    workers: list[dict] = []
    urls: list[str] = []
    for m in spec.models:
        objs, model_urls = _workers(spec, m, redis_url)
        workers += objs
        urls += model_urls
    gw_yaml = yaml.safe_dump(spec.gateway.gateway_yaml(), sort_keys=False)
    docs: list[dict] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": k.namespace, "labels": {"app.kubernetes.io/part-of": spec.name}}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, f"{spec.name}-config",
                                                                   "config"),
         "data": {"llmserve.yaml": spec_text or yaml.safe_dump(spec.model_dump(mode="json"),
                                                               sort_keys=False),
                  "gateway.yaml": gw_yaml,
                  **({"router.yaml": yaml.safe_dump(spec.router.router_yaml(), sort_keys=False)}
                     if spec.router.router_yaml() is not None else {})}},
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": _meta(spec, f"{spec.name}-secrets", "config"),
         "stringData": {"LLMSERVE_MASTER_KEY": "", "AWS_ACCESS_KEY_ID": "",
                        "AWS_SECRET_ACCESS_KEY": ""}},
    ]
    if spec.redis.url is None:
        docs += _service_deploy(spec, "redis", 1, ["--port", str(REDIS_PORT), "--save", "",
                                                   "--appendonly", "no"], REDIS_PORT,
                                image="redis:7-alpine")
    docs += workers
    r = spec.router
    router_cfg = "/etc/llmserve/router.yaml" if r.router_yaml() is not None else None
    router_args = ["router", *r.cli_args(spec.block_size, "0.0.0.0", ROUTER_PORT, router_cfg)]
    for u in urls:
        router_args += ["--worker", u]
    if r.replicas > 1:  # replicas agree on workers, load and cache view through Redis
        router_args += ["--redis-url", redis_url]
    docs += _service_deploy(spec, "router", r.replicas, router_args, ROUTER_PORT)
    gw_args = ["gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT), "--upstream",
               f"http://{spec.name}-router.{k.namespace}.svc:{ROUTER_PORT}", "--redis-url",
               redis_url, "--config", "/etc/llmserve/gateway.yaml"]
    docs += _service_deploy(spec, "gateway", spec.gateway.replicas, gw_args, GATEWAY_PORT)
    if any(d["kind"] == "HorizontalPodAutoscaler" for d in workers):
        docs.append(_adapter_rules(spec))
    if spec.isolation.network_policies:
        docs += _network_policies(spec)
    return docs


def write_manifests(docs: list[dict], output: str) -> None:
    """``-``: one multi-document YAML on stdout; a ``.yaml`` path: one file; else a
    directory with ``NN-kind-name.yaml`` per object."""
    if output == "-" or output.endswith((".yaml", ".yml")):
        text = yaml.safe_dump_all(docs, sort_keys=False)
        if output == "-":
            sys.stdout.write(text)
        else:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text)
        return
    os.makedirs(output, exist_ok=True)
    for i, d in enumerate(docs):
        name = f"{i:02d}-{d['kind'].lower()}-{d['metadata']['name']}.yaml"
        with open(os.path.join(output, name), "w", encoding="utf-8") as f:
            yaml.safe_dump(d, f, sort_keys=False)
