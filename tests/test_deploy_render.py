"""``llmserve render --target kubernetes``: every object of the sample specs (the
small one, the two-model one and the seeds' 405B one) passes the Kubernetes OpenAPI schema offline
(kubernetes-validate, strict: unknown fields are errors), the wiring is consistent
(selectors, Services, router worker list, HPA), the isolation section is rendered,
and the container arguments parse with the real ``llmserve`` CLI parsers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")

from llmserve.deploy.kubernetes import render_kubernetes  # noqa: E402
from llmserve.deploy.spec import load_spec, parse_spec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples", "llmserve.yaml")
BIG = os.path.join(ROOT, "examples", "llmserve-405b.yaml")
MULTI = os.path.join(ROOT, "examples", "llmserve-multi.yaml")


def render(path: str) -> list[dict]:
    return render_kubernetes(load_spec(path))


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs):
    return {d["metadata"]["name"]: d["spec"]["template"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}


@pytest.mark.parametrize("path", [SMALL, BIG, MULTI])
def test_manifests_pass_the_kubernetes_schema(path, tmp_path):
    docs = render(path)
    for d in docs:
        kv.validate(d, kv.latest_version(), strict=True)
    # and the CLI writes what validates (a directory of files)
    out = str(tmp_path / "manifests")
    r = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "render", path,
                        "--target", "kubernetes", "-o", out], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    files = sorted(os.listdir(out))
    assert len(files) == len(docs)
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet",
                        *[os.path.join(out, f) for f in files]], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_schema_check_catches_a_bad_manifest():
    d = render(SMALL)[-1]
    d = {**d, "spec": {**d["spec"], "podSelectorr": {}}}
    with pytest.raises(kv.ValidationError):
        kv.validate(d, kv.latest_version(), strict=True)


def test_wiring_is_consistent():
    docs = render(SMALL)
    templates = pod_specs(docs)
    for d in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
        sel = d["spec"]["selector"]["matchLabels"]
        assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for s in by_kind(docs, "Service"):
        assert any(s["spec"]["selector"].items() <= t["metadata"]["labels"].items()
                   for t in templates.values()), s["metadata"]["name"]
    sts, = by_kind(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == "demo-smollm2"
    router = templates["demo-router"]["spec"]["containers"][0]["args"]
    workers = [router[i + 1] for i, a in enumerate(router) if a == "--worker"]
    assert workers == [f"http://demo-smollm2-{i}.demo-smollm2.llmserve.svc:8000"
                       for i in range(2)]  # every replica up to replicas.max
    gw = templates["demo-gateway"]["spec"]["containers"][0]["args"]
    assert gw[gw.index("--upstream") + 1] == "http://demo-router.llmserve.svc:8080"
    assert gw[gw.index("--redis-url") + 1] == "redis://demo-redis.llmserve.svc:6379/0"
    hpa, = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "demo-smollm2"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 2)
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
               for m in hpa["spec"]["metrics"]}
    assert targets == {"llmserve_num_requests_waiting": "5000m",
                       "llmserve_kv_cache_usage_perc": "800m"}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 60
    adapter = yaml.safe_load(next(d for d in docs if d["metadata"]["name"] ==
                                  "demo-prometheus-adapter")["data"]["config.yaml"])
    assert {r["name"]["as"] for r in adapter["rules"]} == set(targets)
    probes = templates["demo-smollm2"]["spec"]["containers"][0]
    assert probes["readinessProbe"]["httpGet"]["path"] == "/health"
    assert len(by_kind(docs, "PodDisruptionBudget")) == 4


def test_container_args_parse_with_the_real_cli():
    from llmserve.entrypoints.cli import build_parser

    parser = build_parser()
    for name, t in pod_specs(render(SMALL)).items():
        c = t["spec"]["containers"][0]
        if c["command"] == ["llmserve"]:
            args = parser.parse_args(c["args"])
            assert args.command == c["args"][0], name
    worker = pod_specs(render(SMALL))["demo-smollm2"]["spec"]["containers"][0]["args"]
    a = parser.parse_args(worker)
    assert (a.max_num_seqs, a.kv_cache_memory, a.dtype, a.served_model_name) == \
        (16, "256MiB", "float32", ["smollm2"])


def test_isolation_and_405b_shape():
    docs = render(BIG)
    templates = pod_specs(docs)
    groups = by_kind(docs, "StatefulSet")
    assert len(groups) == 1 and groups[0]["spec"]["replicas"] == 8  # pp 8: one pod a node
    pod = groups[0]["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"  # tp 8 per node
    args = worker["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "8"
    assert args[args.index("--pipeline-parallel-size") + 1] == "8"
    assert args[args.index("--max-num-seqs") + 1] == "256"
    assert pod["runtimeClassName"] == "kata-qemu-tdx"
    assert pod["nodeSelector"] == {"feature.node.kubernetes.io/cpu-security.tdx.enabled":
                                   "true"}
    assert pod["initContainers"][0]["args"][:3] == \
        ["registry", "pull", "registry://llama-3.1-405b-instruct:prod"]
    for name, t in templates.items():
        ps = t["spec"]
        assert ps["securityContext"]["runAsNonRoot"] is True, name
        for c in ps["containers"] + ps.get("initContainers", []):
            sec = c["securityContext"]
            assert sec["readOnlyRootFilesystem"] and not sec["allowPrivilegeEscalation"]
            assert sec["capabilities"]["drop"] == ["ALL"], (name, c["name"])
        if "gateway" in name or "router" in name:
            assert "runtimeClassName" not in ps  # only the workers hold weights and prompts
    assert not by_kind(docs, "HorizontalPodAutoscaler")  # min == max
    router = templates["llama405b-router"]["spec"]["containers"][0]["args"]
    assert router[router.index("--redis-url") + 1].startswith("redis://")  # 2 replicas
    pols = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    assert pols["llama405b-default-deny"]["policyTypes"] == ["Ingress"]
    assert "ingress" not in pols["llama405b-default-deny"]
    to_workers = pols["llama405b-router-to-workers"]
    assert to_workers["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    sources = [f["podSelector"]["matchLabels"] for f in to_workers["ingress"][0]["from"]]
    assert {"app.kubernetes.io/component": "router",
            "app.kubernetes.io/part-of": "llama405b"} in sources
    assert not any(s.get("app.kubernetes.io/component") == "gateway" for s in sources)
    to_router = pols["llama405b-gateway-to-router"]["ingress"][0]["from"]
    assert {"app.kubernetes.io/component": "gateway", "app.kubernetes.io/part-of":
            "llama405b"} in [f["podSelector"]["matchLabels"] for f in to_router]


def test_sev_snp_and_tp_that_does_not_fit_a_node():
    with open(BIG) as f:
        text = f.read().replace("confidential: tdx", "confidential: sev-snp")
    pod = by_kind(render_kubernetes(parse_spec(text)), "StatefulSet")[0]["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {
        "feature.node.kubernetes.io/cpu-security.sev.snp.enabled": "true"}
    assert pod["spec"]["runtimeClassName"] == "kata-qemu-snp"
    wide = text.replace("tp: 8", "tp: 16")
    with pytest.raises(ValueError, match="tp 16 does not fit one node of 8"):
        render_kubernetes(parse_spec(wide))


TWO_MODELS = """\
name: duo
models:
  - name: chat
    worker: {max_num_seqs: 8, kv_store: true}
    replicas: {min: 1, max: 4}
  - name: chat-small
    speculative: {method: ngram, num_speculative_tokens: 3}
    replicas: {min: 2, max: 3}
  - name: fixed
    replicas: {min: 1, max: 1}
autoscaling: {target_concurrency: 6, target_ttft_p90_s: 0.5}
router:
  tiers: {auto: {levels: [{model: chat-small, max_score: 0.35}, {model: chat}]}}
"""


def test_two_model_render_validates_and_has_per_model_objects():
    from llmserve.entrypoints.cli import build_parser
    from llmserve.spec_decode.config import SpeculativeConfig

    docs = render_kubernetes(parse_spec(TWO_MODELS))
    for d in docs:
        kv.validate(d, kv.latest_version(), strict=True)
    sts = {d["metadata"]["name"]: d for d in by_kind(docs, "StatefulSet")}
    assert sorted(sts) == ["duo-chat", "duo-chat-small", "duo-fixed"]
    assert {n: d["spec"]["replicas"] for n, d in sts.items()} == \
        {"duo-chat": 1, "duo-chat-small": 2, "duo-fixed": 1}
    services = {d["metadata"]["name"]: d["spec"]["selector"] for d in by_kind(docs, "Service")}
    pdbs = {d["metadata"]["name"]: d["spec"]["selector"]["matchLabels"]
            for d in by_kind(docs, "PodDisruptionBudget")}
    for name, d in sts.items():  # each model's Service and PDB select only its pods
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert labels["llmserve.dev/model"] == name[len("duo-"):]
        assert services[name].items() <= labels.items()
        assert pdbs[name].items() <= labels.items()
        others = [o["spec"]["template"]["metadata"]["labels"] for n, o in sts.items()
                  if n != name]
        assert not any(pdbs[name].items() <= o.items() for o in others), name
    hpas = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "HorizontalPodAutoscaler")}
    assert {n: (h["scaleTargetRef"]["name"], h["minReplicas"], h["maxReplicas"])
            for n, h in hpas.items()} == {"duo-chat": ("duo-chat", 1, 4),
                                          "duo-chat-small": ("duo-chat-small", 2, 3)}
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
               for m in hpas["duo-chat"]["metrics"]}
    assert targets == {"llmserve_num_requests_waiting": "5000m",  # the local autoscaler's
                       "llmserve_concurrency": "6000m",            # targets, one each
                       "llmserve_kv_cache_usage_perc": "800m",
                       "llmserve_time_to_first_token_seconds_p90": "500m"}
    adapter = yaml.safe_load(next(d for d in docs if d["metadata"]["name"] ==
                                  "duo-prometheus-adapter")["data"]["config.yaml"])
    rules = {r["name"]["as"]: r for r in adapter["rules"]}
    assert set(rules) == set(targets)
    assert rules["llmserve_time_to_first_token_seconds_p90"]["metricsQuery"].startswith(
        "histogram_quantile(0.9, sum(rate(<<.Series>>")
    templates = pod_specs(docs)
    router = templates["duo-router"]["spec"]["containers"][0]["args"]
    workers = [router[i + 1] for i, a in enumerate(router) if a == "--worker"]
    assert workers == [f"http://duo-{m}-{i}.duo-{m}.llmserve.svc:8000" for m, n in
                       (("chat", 4), ("chat-small", 3), ("fixed", 1)) for i in range(n)]
    parser = build_parser()
    args = parser.parse_args(router)  # the spec's tiers: a router.yaml in the ConfigMap
    assert args.config == "/etc/llmserve/router.yaml"
    config = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "duo-config")
    assert yaml.safe_load(config["data"]["router.yaml"])["tiers"]["auto"]["levels"][1] == \
        {"model": "chat"}
    mounts = templates["duo-router"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "config", "mountPath": "/etc/llmserve", "readOnly": True} in mounts
    chat = parser.parse_args(templates["duo-chat"]["spec"]["containers"][0]["args"])
    small = parser.parse_args(templates["duo-chat-small"]["spec"]["containers"][0]["args"])
    assert chat.kv_store == "redis://duo-redis.llmserve.svc:6379/0" and small.kv_store is None
    assert (chat.served_model_name, small.served_model_name) == (["chat"], ["chat-small"])
    assert chat.speculative_config is None
    assert SpeculativeConfig.from_value(small.speculative_config).num_speculative_tokens == 3
    to_redis = next(p for p in by_kind(docs, "NetworkPolicy")
                    if p["metadata"]["name"] == "duo-to-redis")
    sources = [f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
               for f in to_redis["spec"]["ingress"][0]["from"]]
    assert sources == ["gateway", "router", "worker"]  # the KV store's writers
