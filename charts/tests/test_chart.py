"""Checks the kvroute chart and image without a cluster.

    pip install -r charts/tests/requirements.txt
    python3 charts/tests/test_chart.py target/debug

- renders the chart with Helm's own library (helm-python-sdk) for the
  defaults, a minimal set and every example values file, and lints it;
- validates every rendered manifest of a built-in kind with
  kubernetes-validate --strict against the oldest and newest Kubernetes the
  chart supports, the example custom resources against their CRDs'
  openAPIV3Schema, and the ServiceMonitor with the prometheus-operator's
  validators generated from its CRD (node; `npm ci` in
  charts/tests/servicemonitor first);
- asserts on RBAC (equal to operator/RBAC.md), images, ports, probes and
  security contexts, and that every value is in values.schema.json;
- checks that bad values fail rendering with the field's name;
- starts the router binary on every rendered router config: it must accept
  it (the router refuses unknown or bad fields at start, naming them);
- checks that router.responseCache reaches the routers' configs, with the
  Secrets it names mounted where its files point;
- lints the Dockerfile (hadolint) and asserts its rules.
"""

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "charts", "kvroute")
# The Kubernetes versions the chart supports: Chart.yaml's kubeVersion, and
# the API version the operator is built against (k8s-openapi v1_34).
KUBE_VERSIONS = ["1.29.0", "1.34.0"]
BUILT_IN_GROUPS = {"v1", "apps/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1",
                   "rbac.authorization.k8s.io/v1"}

failures = []


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(f"{what}: {detail}")


def render(values, name="kv", namespace="kvroute"):
    chart = helm.Chart.load(CHART)
    out = chart.render(values, name=name, namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return docs


def values_sets():
    sets = {"defaults": {}, "minimal": {"pools": [{"name": "p"}]},
            "picker only": {"router": {"picker": {"enabled": True, "api": False}},
                            "pools": [{"name": "p", "model": "m"}, {"name": "q", "picker": {"api": True}}]}}
    for path in sorted(glob.glob(os.path.join(CHART, "examples", "values-*.yaml"))):
        with open(path) as f:
            sets[os.path.basename(path)] = yaml.safe_load(f)
    return sets


def pod_specs(docs):
    for d in docs:
        if d["kind"] == "Deployment":
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            yield d["metadata"]["name"], d["spec"]


def rbac_md_rules():
    """The ClusterRole rules and the Lease rule of operator/RBAC.md."""
    with open(os.path.join(ROOT, "operator", "RBAC.md")) as f:
        text = f.read()
    block = re.search(r"## Cluster-wide.*?```yaml\n(.*?)```", text, re.S).group(1)
    docs = list(yaml.safe_load_all(block))
    cluster = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]
    lease = next(d for d in docs if d["kind"] == "Role")["rules"]
    return cluster, lease


def crd_schemas():
    schemas = {}
    for path in glob.glob(os.path.join(ROOT, "crds", "*.yaml")):
        with open(path) as f:
            crd = yaml.safe_load(f)
        for v in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])
            schemas[key] = v["schema"]["openAPIV3Schema"]
    return schemas


def schema_paths(schema, prefix=""):
    """Every property path the values schema declares."""
    paths = set()
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        paths.add(path)
        paths |= schema_paths(sub, path)
        if sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            paths |= schema_paths(sub["items"], path + "[]")
    return paths


def value_paths(values, prefix=""):
    paths = set()
    for name, v in values.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.add(path)
        # Free-form maps (resources, config, selectors) stop here.
        if isinstance(v, dict) and v and name not in ("config", "requests", "limits", "labels",
                                                       "nodeSelector", "metricsNamespaceSelector",
                                                       "behavior"):
            paths |= value_paths(v, path)
    return paths


def main():
    bins = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug")
    print(f"helm-python-sdk {helm.helm_sdk_version()}, kubernetes-validate {kubernetes_validate.version.__version__}")

    # Lint, with and without pools.
    for name, values in values_sets().items():
        report = helm.lint(CHART, values, strict=True, namespace="kvroute")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        check(f"helm lint --strict ({name})", not problems, problems)

    cluster_rules, lease_rules = rbac_md_rules()
    crds = crd_schemas()
    for name, values in values_sets().items():
        docs = render(values)
        kinds = sorted({d["kind"] for d in docs})
        check(f"renders ({name}): {', '.join(kinds)}", bool(docs))
        for d in docs:
            what = f"{d['kind']}/{d['metadata']['name']} ({name})"
            if d["apiVersion"] in BUILT_IN_GROUPS:
                for version in KUBE_VERSIONS:
                    try:
                        kubernetes_validate.validate(d, version, strict=True)
                    except Exception as e:  # noqa: BLE001 - report any validator failure
                        check(f"valid for Kubernetes {version}: {what}", False, str(e)[:400])
        valid = all(not f.startswith("valid for") for f in failures)
        check(f"every built-in manifest validates strictly for {' and '.join(KUBE_VERSIONS)} ({name})", valid)

        # RBAC is exactly operator/RBAC.md's.
        roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
        for role in roles:
            want = lease_rules if role["metadata"]["name"].endswith("-leader-election") else cluster_rules
            check(f"RBAC of {role['kind']}/{role['metadata']['name']} is operator/RBAC.md's ({name})",
                  role["rules"] == want, role["rules"])
        watch = values.get("operator", {}).get("watchNamespaces", [])
        cluster_roles = [r for r in roles if r["kind"] == "ClusterRole"]
        check(f"cluster-wide RBAC only without watchNamespaces ({name})", bool(cluster_roles) == (not watch))

        tag = values.get("image", {}).get("tag") or "0.1.0"
        for pod, spec in pod_specs(docs):
            sc = spec.get("securityContext", {})
            check(f"{pod}: non-root, seccomp RuntimeDefault ({name})",
                  sc.get("runAsNonRoot") is True and sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", sc)
            uses_api = pod.endswith("-operator")
            check(f"{pod}: service account token only where the API is used ({name})",
                  spec.get("automountServiceAccountToken") is uses_api, spec.get("automountServiceAccountToken"))
            for c in spec["containers"]:
                csc = c.get("securityContext", {})
                check(f"{pod}/{c['name']}: read-only root, no capabilities, no escalation ({name})",
                      csc.get("readOnlyRootFilesystem") is True and csc.get("allowPrivilegeEscalation") is False
                      and csc.get("capabilities", {}).get("drop") == ["ALL"], csc)
                check(f"{pod}/{c['name']}: image ghcr.io/kvroute/kvroute:{tag} ({name})",
                      c["image"] == f"ghcr.io/kvroute/kvroute:{tag}", c["image"])
                check(f"{pod}/{c['name']}: resources set ({name})",
                      bool(c.get("resources", {}).get("requests")) and bool(c.get("resources", {}).get("limits")))
                if spec.get("restartPolicy") != "Never":
                    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                    probes = [c.get("livenessProbe", {}), c.get("readinessProbe", {})]
                    paths = [p.get("httpGet", {}).get("path") for p in probes]
                    check(f"{pod}/{c['name']}: probes on /healthz and /readyz of its ports ({name})",
                          paths == ["/healthz", "/readyz"]
                          and all(p["httpGet"]["port"] in ports for p in probes), (paths, ports))

        # ServiceMonitors validate against the prometheus-operator's schema.
        monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
        if monitors:
            check_service_monitors(monitors, name)

        # Services expose what the containers listen on: a router the API
        # (http) unless it is a picker only, and the picker (grpc) when on.
        configs = {d["metadata"]["name"]: yaml.safe_load(d["data"]["router.yaml"])
                   for d in docs if d["kind"] == "ConfigMap" and "router.yaml" in d["data"]}
        for svc in (d for d in docs if d["kind"] == "Service"):
            svc_name = svc["metadata"]["name"]
            names = sorted(p["name"] for p in svc["spec"]["ports"])
            if svc_name.endswith("-operator"):
                want = ["admin", "grpc"]
            else:
                config = configs[svc_name]
                want = sorted(["admin"] + (["http"] if "listen" in config else [])
                              + (["grpc"] if "extProc" in config else []))
            check(f"Service/{svc_name} ports {names} ({name})", names == want, names)
        if name == "picker only":
            check("a picker-only router has no API listener and no helm test",
                  "listen" not in configs["kv-kvroute-p"] and "extProc" in configs["kv-kvroute-p"]
                  and not any(d["kind"] == "Pod" for d in docs), configs)

        # Router configs: the router binary accepts each, with the files of
        # the Secrets its Deployment mounts stood in for.
        deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
        for cm in (d for d in docs if d["kind"] == "ConfigMap" and "router.yaml" in d["data"]):
            mounts = secret_mounts(deployments[cm["metadata"]["name"]])
            check(f"router accepts ConfigMap/{cm['metadata']['name']} ({name})",
                  router_accepts(bins, cm["data"]["router.yaml"], mounts))

    # The examples' manifests validate: custom resources against their
    # CRDs, the rest strictly against Kubernetes.
    for example in sorted(glob.glob(os.path.join(CHART, "examples", "*-pool.yaml"))):
        check_example(example, crds)
    # ... and a wrong one does not.
    wrong = {"apiVersion": "kvroute.dev/v1alpha1", "kind": "CacheRoutingPolicy",
             "metadata": {"name": "x"},
             "spec": {"targetRef": {"name": "p"}, "engine": {"blockSize": "sixteen"}}}
    try:
        jsonschema.validate(wrong, crds[("kvroute.dev/v1alpha1", "CacheRoutingPolicy")])
        check("a CacheRoutingPolicy with a string blockSize fails its CRD", False, "accepted")
    except jsonschema.ValidationError as e:
        check("a CacheRoutingPolicy with a string blockSize fails its CRD", "sixteen" in e.message, e.message)

    # Every value is in the schema.
    with open(os.path.join(CHART, "values.schema.json")) as f:
        schema = json.load(f)
    with open(os.path.join(CHART, "values.yaml")) as f:
        defaults = yaml.safe_load(f)
    missing = value_paths(defaults) - schema_paths(schema)
    check("every value in values.yaml is in values.schema.json", not missing, sorted(missing))

    # Bad values fail with the field's name.
    bad = {
        "a wrong type": ({"operator": {"replicas": "two"}}, "replicas"),
        "an unknown key": ({"operator": {"replicaz": 2}}, "replicaz"),
        "a negative replica count": ({"router": {"replicas": -1}}, "replicas"),
        "a pool without a name": ({"pools": [{"namespace": "ml"}]}, "name"),
        "a router config setting discovery": ({"router": {"config": {"discovery": {}}}}, "discovery"),
        "a misspelt router config section": ({"router": {"config": {"tenency": {}}}}, "tenency"),
        "a misspelt router config field": ({"pools": [{"name": "p", "config": {"limits": {"maxBodyByts": 1}}}]},
                                           "maxBodyByts"),
        "engine autoscaling without a deployment": ({"engineAutoscaling": {"enabled": True},
                                                     "pools": [{"name": "p"}]}, "deployment"),
        "an engine pressure target over 1": ({"pools": [{"name": "p", "engineAutoscaling": {"target": "1.5"}}]},
                                             "target"),
        "a router config setting responseCache": ({"router": {"config": {"responseCache": {}}}}, "responseCache"),
        "a misspelt response cache field": ({"router": {"responseCache": {"ttlSeconds": 60}}}, "ttlSeconds"),
        "an unknown response cache backend": ({"pools": [{"name": "p", "responseCache": {"backend": "memcached"}}]},
                                              "backend"),
        "a response cache passwordFile (the chart's)": ({"router": {"responseCache": {"passwordFile": "/x"}}},
                                                        "passwordFile"),
        "a response cache Secret without its key": ({"router": {"responseCache": {"passwordSecret": {"name": "r"}}}},
                                                    "'key'"),
    }
    for what, (values, field) in bad.items():
        try:
            render(values)
            check(f"{what} fails rendering", False, "rendered")
        except helm.HelmError as e:
            check(f"{what} fails rendering, naming {field}", field in str(e), str(e))

    check_picker_network_policy()
    check_engine_autoscaling()
    check_response_cache(bins)
    check_dashboard()
    check_dockerfile()
    if failures:
        print(f"\n{len(failures)} failed:")
        for f in failures:
            print("  " + f)
        sys.exit(1)
    print("\nchart and image checks: all passed")


def check_example(path, crds):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for d in docs:
        what = f"example {os.path.basename(path)}: {d['kind']}/{d['metadata']['name']}"
        key = (d["apiVersion"], d["kind"])
        if d["apiVersion"].startswith("gateway.networking.k8s.io/"):
            # Gateway API's CRDs are not available offline.
            print(f"skip {what}: Gateway API kinds are not validated here")
            continue
        if key in crds:
            try:
                jsonschema.validate(d, crds[key])
                check(f"{what} matches its CRD", True)
            except jsonschema.ValidationError as e:
                check(f"{what} matches its CRD", False, e.message)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
                check(f"{what} valid for Kubernetes {version}", True)
            except Exception as e:  # noqa: BLE001 - report any validator failure
                check(f"{what} valid for Kubernetes {version}", False, str(e)[:400])


def secret_mounts(deployment):
    """Where a Deployment's containers mount Secrets (secret or projected
    volumes)."""
    spec = deployment["spec"]["template"]["spec"]
    secrets = {v["name"] for v in spec.get("volumes", []) if "secret" in v or "projected" in v}
    return [m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] in secrets]


def router_accepts(bins, config, mounts):
    """Starts the router on `config` (listening on loopback): a config it
    refuses makes it exit at once with the field's name. Files under the
    secret `mounts` are made up in a scratch directory (API keys: a YAML
    map; anything else: a 32-byte key)."""
    scratch = tempfile.mkdtemp()
    for mount in mounts:
        for path in set(re.findall(re.escape(mount.rstrip("/")) + r"/[\w.-]+", config)):
            local = os.path.join(scratch, path.lstrip("/").replace("/", "_"))
            with open(local, "w") as f:
                f.write("sk-test-0123456789: tenant-a\n" if path.endswith((".yaml", ".yml")) else "0" * 64)
            config = config.replace(path, local)
    config_path = os.path.join(scratch, "router.yaml")
    with open(config_path, "w") as f:
        f.write(config)
    listen = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
    if "extProc" in yaml.safe_load(config):
        listen += ["--ext-proc-listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [os.path.join(bins, "kvroute-router"), "--config", config_path] + listen,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "RUST_BACKTRACE": "0"})
    try:
        proc.wait(timeout=2)
        print(proc.stderr.read().decode()[-600:])
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


def check_picker_network_policy():
    """The picker port admits only router.picker.allowedFrom under the
    chart's NetworkPolicy (nothing when empty), whose routers then trust the
    gateways; without a NetworkPolicy NOTES.txt warns."""
    gateways = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}]
    for allowed in ([], gateways):
        values = {"networkPolicy": {"enabled": True},
                  "router": {"picker": {"enabled": True, "allowedFrom": allowed}},
                  "pools": [{"name": "p"}]}
        docs = render(values)
        policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-routers"))
        picker_rules = [r for r in policy["spec"]["ingress"]
                        if any(p["port"] == 9002 for p in r.get("ports", []))]
        want = [{"from": gateways, "ports": [{"port": 9002, "protocol": "TCP"}]}] if allowed else []
        check(f"the picker port admits {'the gateways' if allowed else 'nothing'} under the NetworkPolicy",
              picker_rules == want, picker_rules)
        config = next(yaml.safe_load(d["data"]["router.yaml"]) for d in docs
                      if d["kind"] == "ConfigMap" and "router.yaml" in d["data"])
        check(f"extProc.trustedNetwork is {bool(allowed)} with allowedFrom {'set' if allowed else 'empty'}",
              config["extProc"].get("trustedNetwork") is bool(allowed), config["extProc"])
    chart = helm.Chart.load(CHART)
    for policy, warns in ((False, True), (True, False)):
        values = {"networkPolicy": {"enabled": policy}, "router": {"picker": {"enabled": True}},
                  "pools": [{"name": "p"}]}
        out = chart.render(values, name="kv", namespace="kvroute", is_install=True)
        notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
        check(f"NOTES.txt {'warns' if warns else 'does not warn'} about the picker "
              f"{'without' if warns else 'with'} a NetworkPolicy", ("WARNING" in notes) == warns, notes)


def check_engine_autoscaling():
    """A pool's engineAutoscaling scales its engine Deployment, in the pool's
    namespace, on the average kvroute_cache_pressure of that pool's routers
    (type Value: the HPA sums what the adapter returns and divides nothing
    by the engine count); a pool without it gets no HPA."""
    values = {"engineAutoscaling": {"maxReplicas": 6},
              "pools": [{"name": "p", "namespace": "ml", "engineAutoscaling": {"enabled": True, "deployment": "vllm"}},
                        {"name": "q"}]}
    hpas = [d for d in render(values) if d["kind"] == "HorizontalPodAutoscaler"]
    check("engineAutoscaling: one HPA, for the pool that enables it", len(hpas) == 1, hpas)
    if len(hpas) != 1:
        return
    hpa = hpas[0]
    metric = hpa["spec"]["metrics"][0]["external"]
    check("engineAutoscaling: the engine Deployment in the pool's namespace, pool defaults merged",
          hpa["metadata"]["namespace"] == "ml"
          and hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"}
          and (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6), hpa)
    check("engineAutoscaling: kvroute_cache_pressure of the pool's routers, target type Value 0.2",
          metric["metric"] == {"name": "kvroute_cache_pressure",
                               "selector": {"matchLabels": {"namespace": "kvroute", "service": "kv-kvroute-p"}}}
          and metric["target"] == {"type": "Value", "value": "0.2"}, metric)
    check("engineAutoscaling: scale-down slowed by default",
          hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 1800, hpa["spec"].get("behavior"))


def check_response_cache(bins):
    """router.responseCache, with a pool's over it, is the routers'
    responseCache (absent: off); the Secrets it names are mounted, read-only,
    where passwordFile and secretFile point, and the router accepts the
    result."""
    def rendered(values):
        docs = render(values)
        configs = {d["metadata"]["name"]: yaml.safe_load(d["data"]["router.yaml"])
                   for d in docs if d["kind"] == "ConfigMap" and "router.yaml" in d["data"]}
        deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
        return configs, deployments

    configs, _ = rendered({"pools": [{"name": "p"}]})
    check("responseCache: off by default", "responseCache" not in configs["kv-kvroute-p"], configs)

    configs, deployments = rendered({"router": {"responseCache": {"backend": "embedded"}},
                                     "pools": [{"name": "p"}, {"name": "q", "responseCache": {"ttlS": 60}}]})
    check("responseCache: router.responseCache for every pool, a pool's merged over it",
          configs["kv-kvroute-p"].get("responseCache") == {"backend": "embedded"}
          and configs["kv-kvroute-q"].get("responseCache") == {"backend": "embedded", "ttlS": 60}, configs)
    check("responseCache: embedded mounts no Secret",
          not any(secret_mounts(d) for d in deployments.values()), deployments)

    configs, _ = rendered({"pools": [{"name": "p", "responseCache": {}}, {"name": "q"}]})
    check("responseCache: a pool's alone turns it on for that pool only",
          configs["kv-kvroute-p"].get("responseCache") == {} and "responseCache" not in configs["kv-kvroute-q"],
          configs)

    cache = {"backend": "redis", "url": "redis://redis-master.cache:6379",
             "passwordSecret": {"name": "redis", "key": "redis-password"},
             "keySecret": {"name": "kvroute-response-cache", "key": "key"}}
    configs, deployments = rendered({"router": {"responseCache": cache}, "pools": [{"name": "p"}]})
    section = configs["kv-kvroute-p"].get("responseCache", {})
    spec = deployments["kv-kvroute-p"]["spec"]["template"]["spec"]
    # Where each mounted Secret key appears in the container: path -> (secret, key).
    files = {}
    for mount in spec["containers"][0]["volumeMounts"]:
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        if not mount.get("readOnly"):
            continue
        for source in volume.get("projected", {}).get("sources", []):
            for item in source.get("secret", {}).get("items", []):
                files[f"{mount['mountPath']}/{item['path']}"] = (source["secret"]["name"], item["key"])
    check("responseCache: the Redis password and key Secrets mounted read-only where passwordFile and secretFile point",
          files.get(section.get("passwordFile")) == ("redis", "redis-password")
          and files.get(section.get("secretFile")) == ("kvroute-response-cache", "key")
          and "passwordSecret" not in section and "keySecret" not in section
          and section.get("url") == cache["url"], (section, files))
    check("responseCache: the router accepts the Redis section, its Secrets' files stood in for",
          router_accepts(bins, yaml.safe_dump(configs["kv-kvroute-p"]), secret_mounts(deployments["kv-kvroute-p"])))

    configs, deployments = rendered({"router": {"responseCache": cache},
                                     "pools": [{"name": "p", "responseCache": {"backend": "embedded"}}]})
    section = configs["kv-kvroute-p"].get("responseCache", {})
    check("responseCache: a pool back on the embedded store drops the Redis url and password, keeps the key",
          section.get("backend") == "embedded" and "url" not in section and "passwordFile" not in section
          and "secretFile" in section, section)
    check("responseCache: the router accepts that pool's section",
          router_accepts(bins, yaml.safe_dump(configs["kv-kvroute-p"]), secret_mounts(deployments["kv-kvroute-p"])))


def check_service_monitors(monitors, name):
    """Validates with the prometheus-operator models' validators (generated
    from the ServiceMonitor CRD), run by node: charts/tests/servicemonitor
    (`npm ci` there first)."""
    run = subprocess.run(["node", os.path.join(os.path.dirname(__file__), "servicemonitor", "validate.mjs")],
                         input=json.dumps(monitors), capture_output=True, text=True)
    check(f"ServiceMonitors match the ServiceMonitor CRD ({name})", run.returncode == 0,
          run.stdout + run.stderr)


def check_dashboard():
    """Every metric the dashboard queries is one the router exports, and no
    two panels overlap on Grafana's 24-column grid."""
    with open(os.path.join(CHART, "dashboards", "kvroute.json")) as f:
        dashboard = json.load(f)
    cells = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                cells.setdefault((x, y), []).append(panel["title"])
    overlaps = sorted({tuple(titles) for titles in cells.values() if len(titles) > 1})
    check("dashboard: panels within 24 columns, none overlapping",
          not overlaps and all(x < 24 for x, _ in cells), overlaps)
    source = ""
    for path in glob.glob(os.path.join(ROOT, "router", "src", "**", "*.rs"), recursive=True):
        with open(path) as f:
            source += f.read()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"kvroute_[a-z_]+", target["expr"]):
                family = re.sub(r"_(total|bucket|sum|count)$", "", metric)
                check(f"dashboard '{panel['title']}': {metric} is exported",
                      f'"{family}"' in source, target["expr"])


def check_dockerfile():
    path = os.path.join(ROOT, "Dockerfile")
    lint = subprocess.run(["hadolint", path], capture_output=True, text=True)
    check("hadolint Dockerfile", lint.returncode == 0, lint.stdout + lint.stderr)
    with open(path) as f:
        text = f.read()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    check("Dockerfile: multi-stage, distroless nonroot runtime",
          len(stages) == 2 and stages[-1].startswith("gcr.io/distroless/") and stages[-1].endswith(":nonroot"), stages)
    runtime = text.split("FROM " + stages[-1], 1)[1]
    check("Dockerfile: runs as a non-root user", re.search(r"^USER 65532", runtime, re.M) is not None)
    check("Dockerfile: STOPSIGNAL SIGTERM", re.search(r"^STOPSIGNAL SIGTERM$", runtime, re.M) is not None)
    check("Dockerfile: OCI labels", all(f"org.opencontainers.image.{k}" in runtime
                                        for k in ("title", "source", "licenses")))
    check("Dockerfile: release build, debug info stripped",
          "cargo build --release --locked" in text and "strip --strip-debug" in text)
    for binary in ("kvroute-router", "kvroute-operator", "kvroute-agent", "kvroute-engine-sim", "kvroute"):
        check(f"Dockerfile: ships {binary}", f"/usr/local/bin/{binary} " in text or f" {binary}" in text)


if __name__ == "__main__":
    main()
