"""Packaging checks (run by scripts/check-packaging.sh inside .venv).

Renders the Helm chart with Helm's own Go SDK (helm-python-sdk) for the default
values and for every values file in the chart's ci/ folder, then checks every
manifest against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
unknown fields are errors), checks that the objects refer to each other (Service,
PDB and ServiceMonitor selectors match the pods; HPA targets the Deployment; the
RBAC covers each watched namespace), and validates the rendered gateway config
with `switchyard check-config`. A negative pass proves each check can fail.
"""

import copy
import subprocess
import sys
import tempfile
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "switchyard"
KUBE_VERSION = "1.33.0"
# Custom resources whose schemas kubernetes-validate does not bundle.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def render(values, namespace="inference"):
    """Every object the chart renders with these values."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="sy", namespace=namespace, is_install=True)
    objects = []
    for name, text in sorted(files.items()):
        if name.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append((name, doc))
    return objects


def schema_problems(objects):
    problems = []
    for name, obj in objects:
        if (obj.get("apiVersion"), obj.get("kind")) in CRDS:
            if not obj.get("spec", {}).get("endpoints"):
                problems.append(f"{name}: {obj['kind']} without endpoints")
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{name}: {obj.get('kind')}: {e.message} at {list(e.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{name}: no schema for {obj.get('apiVersion')} {obj.get('kind')}")
    return problems


def by_kind(objects, kind):
    return [o for _, o in objects if o.get("kind") == kind]


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def reference_problems(objects):
    """Objects that should point at the gateway's pods or Deployment, and don't."""
    problems = []
    (deploy,) = by_kind(objects, "Deployment")
    pod = deploy["spec"]["template"]
    labels = pod["metadata"]["labels"]
    if not matches(deploy["spec"]["selector"]["matchLabels"], labels):
        problems.append("Deployment selector does not match its pod labels")
    for svc in by_kind(objects, "Service"):
        if not matches(svc["spec"]["selector"], labels):
            problems.append("Service selector does not match the pods")
    for pdb in by_kind(objects, "PodDisruptionBudget"):
        if not matches(pdb["spec"]["selector"]["matchLabels"], labels):
            problems.append("PodDisruptionBudget selector does not match the pods")
    for sm in by_kind(objects, "ServiceMonitor"):
        svc_labels = by_kind(objects, "Service")[0]["metadata"]["labels"]
        if not matches(sm["spec"]["selector"]["matchLabels"], svc_labels):
            problems.append("ServiceMonitor selector does not match the Service")
    name = deploy["metadata"]["name"]
    hpas = [h for h in by_kind(objects, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["kind"] == "Deployment"]
    if hpas and not any(h["spec"]["scaleTargetRef"]["name"] == name for h in hpas):
        problems.append("no HorizontalPodAutoscaler targets the gateway Deployment")
    spec = pod["spec"]
    container = spec["containers"][0]
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        if container.get(probe, {}).get("httpGet", {}).get("path") != path:
            problems.append(f"{probe} is not on {path}")
    sc = container.get("securityContext", {})
    if not (spec.get("securityContext", {}).get("runAsNonRoot") and sc.get("readOnlyRootFilesystem")
            and sc.get("capabilities", {}).get("drop") == ["ALL"]):
        problems.append("pod is not non-root with a read-only root and no capabilities")
    config = config_text(objects)
    server = toml_loads(config).get("server", {})
    grace = -(-(server.get("unready_grace_ms", 0) + server.get("drain_timeout_ms", 30000)) // 1000)
    if spec.get("terminationGracePeriodSeconds", 0) <= grace:
        problems.append(f"terminationGracePeriodSeconds {spec.get('terminationGracePeriodSeconds')} "
                        f"does not cover unready grace + drain ({grace} s)")
    watched = {p["kubernetes"]["namespace"] for p in toml_loads(config).get("pools", []) if "kubernetes" in p}
    roles = {(r["metadata"]["namespace"], tuple(r["rules"][0]["verbs"])) for r in by_kind(objects, "Role")}
    if {ns for ns, _ in roles} != watched or any(v != ("list", "watch") for _, v in roles):
        problems.append(f"RBAC roles {sorted(roles)} do not grant list/watch on pods in exactly {sorted(watched)}")
    followed = {p["kubernetes"]["namespace"] for p in toml_loads(config).get("pools", [])
                if p.get("kubernetes", {}).get("inference_pool")}
    granted = {r["metadata"]["namespace"] for r in by_kind(objects, "Role")
               if any("inferencepools" in rule.get("resources", []) for rule in r["rules"])}
    if granted != followed:
        problems.append(f"RBAC grants InferencePool list/watch in {sorted(granted)}, pools follow them in {sorted(followed)}")
    if "epp" in container["args"] and not any(p.get("name") == "grpc" for s in by_kind(objects, "Service")
                                              for p in s["spec"]["ports"]):
        problems.append("epp mode without a grpc Service port")
    return problems


def toml_loads(text):
    import tomllib

    return tomllib.loads(text)


def config_text(objects):
    (cm,) = by_kind(objects, "ConfigMap")
    return cm["data"]["switchyard.toml"]


def config_problems(objects, binary):
    """`switchyard check-config --no-secrets` on the rendered config."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(config_text(objects))
    out = subprocess.run([binary, "check-config", "--no-secrets", f.name], capture_output=True, text=True)
    Path(f.name).unlink()
    if out.returncode != 0:
        return [f"rendered config rejected by switchyard check-config:\n{out.stderr.strip()}"]
    return []


def args_problems(objects, binary):
    """Flags in the container's args that the binary's subcommand does not take."""
    (deploy,) = by_kind(objects, "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    sub = next(a for a in args if not a.startswith("-") and a in ("serve", "epp"))
    helptext = subprocess.run([binary, sub, "--help"], capture_output=True, text=True).stdout
    helptext += subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    return [f"`{a}` is not a flag of `switchyard {sub}`" for a in args
            if a.startswith("--") and f"{a} " not in helptext and f"{a}=" not in helptext]


def subset_problems(given, rendered, path="config"):
    """Where the rendered TOML lost or changed a value given in `config` (the chart's
    own TOML emitter: numbers, quoting, nesting)."""
    if isinstance(given, dict):
        if not isinstance(rendered, dict):
            return [f"{path}: rendered as {rendered!r}"]
        return [p for k, v in given.items() for p in subset_problems(v, rendered.get(k), f"{path}.{k}")]
    if isinstance(given, list):
        if not isinstance(rendered, list) or len(rendered) != len(given):
            return [f"{path}: rendered as {rendered!r}"]
        return [p for i, (g, r) in enumerate(zip(given, rendered)) for p in subset_problems(g, r, f"{path}[{i}]")]
    if given != rendered or isinstance(given, bool) != isinstance(rendered, bool):
        return [f"{path}: {given!r} rendered as {rendered!r}"]
    return []


def check(values, label, binary):
    objects = render(values)
    problems = (schema_problems(objects) + reference_problems(objects)
                + config_problems(objects, binary) + args_problems(objects, binary))
    with helm.Chart.load(str(CHART)) as chart:
        merged = chart.merge_values(values)
    problems += subset_problems(merged["config"], toml_loads(config_text(objects)))
    kinds = sorted({o["kind"] for _, o in objects})
    return objects, problems, kinds


def negative(defaults, binary):
    """Each check must reject a broken input; returns what failed to fail."""
    missed = []
    objects = render(defaults)
    for what, breaks in (
        ("replicas: \"two\"", lambda d: d["spec"].update(replicas="two")),
        ("an unknown field", lambda d: d["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"].update(pathh="/")),
        ("a pod without containers", lambda d: d["spec"]["template"]["spec"].pop("containers")),
    ):
        broken = copy.deepcopy(objects)
        breaks(next(o for _, o in broken if o["kind"] == "Deployment"))
        if not schema_problems(broken):
            missed.append(f"schema check accepted a Deployment with {what}")
    broken = copy.deepcopy(objects)
    for _, o in broken:
        if o["kind"] == "Service":
            o["spec"]["selector"] = {"app.kubernetes.io/name": "someone-else"}
    if not any("Service selector" in p for p in reference_problems(broken)):
        missed.append("reference check accepted a Service that selects no gateway pod")
    if not subset_problems({"pools": [{"port": 8000}]}, {"pools": [{"port": 8000.5}]}):
        missed.append("round-trip check accepted a changed number")
    broken = copy.deepcopy(objects)
    next(o for _, o in broken if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"].append("--grpc-lisen")
    if not args_problems(broken, binary):
        missed.append("args check accepted an unknown flag")
    bad_values = {"config": {"server": {"drain_timeout_ms": "soon", "lisen": "x"}}}
    if not config_problems(render(bad_values), binary):
        missed.append("check-config accepted a config with an unknown key and a string duration")
    lint = helm.lint(str(CHART), {"replicaCount": "two"}, strict=True)
    if not lint.get("errors") and not any(m["severity"] >= 3 for m in lint.get("messages", [])):
        missed.append("helm lint accepted replicaCount as a map")
    return missed


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target" / "debug" / "switchyard")
    failed = False
    lint = helm.lint(str(CHART), strict=True)
    findings = [m for m in lint.get("messages", []) if m["severity"] >= 2] + [{"error": e} for e in lint.get("errors", [])]
    for m in findings:
        print(f"helm lint: {m.get('path', '')}: {m['error']}")
        failed = True
    sets = [("default values", {})]
    for f in sorted((CHART / "ci").glob("*-values.yaml")):
        sets.append((f"ci/{f.name}", yaml.safe_load(f.read_text())))
    for label, values in sets:
        objects, problems, kinds = check(values, label, binary)
        for p in problems:
            print(f"{label}: {p}")
        failed |= bool(problems)
        print(f"{label}: {len(objects)} manifests ({', '.join(kinds)}): {'FAILED' if problems else 'ok'}")
    missed = negative({}, binary)
    for m in missed:
        print(f"negative test: {m}")
    print(f"negative tests: {'FAILED' if missed else 'ok (broken manifests and configs are rejected)'}")
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
