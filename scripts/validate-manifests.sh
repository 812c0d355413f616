#!/usr/bin/env bash
# Validates the Kubernetes manifests in deploy/kubernetes, offline:
#  1. schemas: every resource, strictly (unknown fields are errors), against the OpenAPI
#     schemas of Kubernetes 1.29 (the first release with native sidecars on by default)
#     and 1.37, with kubernetes-validate (PyPI, the schemas ship inside the wheel);
#  2. the kustomization: it lists exactly the files here, and, where kubectl is installed,
#     `kubectl kustomize` renders it and the result passes the same schemas;
#  3. what the schemas cannot see: references between the resources (ConfigMap, Secret and
#     its keys, volumes, the selector), probes on ports the container declares, native
#     sidecar rules, and COMPACTD_* names that compactd really reads (README.md).
# Exits non-zero on any error. Usage: bash scripts/validate-manifests.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-deploy/kubernetes}"
KV_VERSION="1.37.0"
K8S_VERSIONS="${K8S_VERSIONS:-1.29.0 1.37.0}"

if ! python3 -c "import sys, kubernetes_validate.version as v; sys.exit(v.__version__ != '$KV_VERSION')" 2>/dev/null; then
  echo "installing kubernetes-validate==$KV_VERSION from PyPI" >&2
  python3 -m pip install --quiet --disable-pip-version-check "kubernetes-validate==$KV_VERSION"
fi

rendered=""
if command -v kubectl >/dev/null 2>&1; then
  rendered="$(mktemp)"
  trap 'rm -f "$rendered"' EXIT
  if ! kubectl kustomize "$DIR" >"$rendered"; then
    echo "validate-manifests: kubectl kustomize $DIR failed" >&2
    exit 1
  fi
else
  echo "validate-manifests: kubectl not found; the rendered kustomization is not checked" >&2
fi

python3 - "$DIR" "$rendered" $K8S_VERSIONS <<'PY'
import os
import re
import sys

import yaml
import kubernetes_validate
from kubernetes_validate.version import __version__ as kv_version

directory, rendered, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
errors = []


def error(where, message):
    errors.append(f"{where}: {message}")


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, as the API server's decoder does."""


def _mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
# A bare `=` is YAML's "value" tag, which PyYAML cannot construct; Kubernetes reads a string.
StrictLoader.add_constructor("tag:yaml.org,2002:value", lambda l, n: str(n.value))


def load(path):
    try:
        with open(path) as f:
            docs = [d for d in yaml.load_all(f, Loader=StrictLoader) if d is not None]
    except yaml.YAMLError as e:
        error(path, f"not valid YAML: {e}")
        return []
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            error(path, f"document {i + 1} is not a mapping")
    return [d for d in docs if isinstance(d, dict)]


def name_of(doc):
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def check_schema(where, doc):
    for field in ("apiVersion", "kind"):
        if not isinstance(doc.get(field), str):
            error(where, f"{name_of(doc)}: no {field}")
            return
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(top level)"
            error(where, f"{name_of(doc)} against Kubernetes {version}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            error(where, f"{name_of(doc)}: {e.message}")


# 1 and 2: the kustomization and the schemas ---------------------------------------------
kustomization = os.path.join(directory, "kustomization.yaml")
files = sorted(f for f in os.listdir(directory)
               if f.endswith((".yaml", ".yml")) and f != "kustomization.yaml")
kdocs = load(kustomization) if os.path.exists(kustomization) else []
if len(kdocs) != 1 or kdocs[0].get("kind") != "Kustomization":
    error(kustomization, "missing, or not one Kustomization")
    listed = files
else:
    listed = kdocs[0].get("resources") or []
    for f in sorted(set(files) - set(listed)):
        error(kustomization, f"{f} is not listed in resources")
    for f in sorted(set(listed) - set(files)):
        error(kustomization, f"resources names {f}, which is not in {directory}")

docs = []  # (file, document)
for f in files:
    path = os.path.join(directory, f)
    for doc in load(path):
        docs.append((path, doc))
        check_schema(path, doc)
if not docs:
    error(directory, "no Kubernetes resources found")

if rendered:
    out = load(rendered)
    for doc in out:
        check_schema("kubectl kustomize", doc)
    if len(out) != len(docs):
        error("kubectl kustomize", f"rendered {len(out)} resources, the files hold {len(docs)}")

# 3: what the schemas cannot see ---------------------------------------------------------
by_kind = {}
for path, doc in docs:
    by_kind.setdefault(doc.get("kind"), {})[(doc.get("metadata") or {}).get("name")] = doc

readme = open("README.md").read() if os.path.exists("README.md") else ""
known_env = set(re.findall(r"COMPACTD_[A-Z0-9_]+", readme))
# README abbreviates some twins, e.g. `COMPACTD_LLM_PRICE_INPUT`, `…_OUTPUT`.
known_env |= {"COMPACTD_LLM_PRICE_OUTPUT"}


def check_compactd_env(where, names):
    if not known_env:
        return
    for n in names:
        if n.startswith("COMPACTD_") and n not in known_env:
            error(where, f"{n} is not a setting compactd reads (README.md, Configuration)")


for name, cm in by_kind.get("ConfigMap", {}).items():
    data = cm.get("data") or {}
    for k, v in data.items():
        if not isinstance(v, str):
            error(f"ConfigMap/{name}", f"{k}: values must be strings (quote {v!r})")
    check_compactd_env(f"ConfigMap/{name}", data)

POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def pod_specs():
    for path, doc in docs:
        kind = doc.get("kind")
        spec = doc.get("spec") or {}
        if kind == "Pod":
            yield path, doc, spec, (doc.get("metadata") or {}).get("labels") or {}
        elif kind in POD_KINDS or kind == "CronJob":
            template = spec.get("template") or {}
            if kind == "CronJob":
                template = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
            yield (path, doc, template.get("spec") or {},
                   (template.get("metadata") or {}).get("labels") or {})


pod_labels = []
for path, doc, spec, labels in pod_specs():
    where = f"{path}: {name_of(doc)}"
    pod_labels.append(labels)
    selector = ((doc.get("spec") or {}).get("selector") or {}).get("matchLabels")
    if doc.get("kind") in POD_KINDS - {"Job"}:
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            error(where, "spec.selector.matchLabels does not match the pod template's labels")
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    for vname, v in volumes.items():
        if "secret" in v:
            sec = v["secret"]
            target = by_kind.get("Secret", {}).get(sec.get("secretName"))
            if target is None:
                if not sec.get("optional"):
                    error(where, f"volume {vname}: no Secret {sec.get('secretName')} in {directory}")
                continue
            keys = set(target.get("data") or {}) | set(target.get("stringData") or {})
            for item in sec.get("items") or []:
                if item.get("key") not in keys:
                    error(where, f"volume {vname}: Secret {sec.get('secretName')} has no key {item.get('key')}")
        if "configMap" in v and v["configMap"].get("name") not in by_kind.get("ConfigMap", {}):
            if not v["configMap"].get("optional"):
                error(where, f"volume {vname}: no ConfigMap {v['configMap'].get('name')} in {directory}")
    containers = [(c, True) for c in spec.get("initContainers") or []]
    containers += [(c, False) for c in spec.get("containers") or []]
    for c, is_init in containers:
        cw = f"{where}: container {c.get('name')}"
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in volumes:
                error(cw, f"volumeMount {m.get('name')} names no volume of the pod")
        for src in c.get("envFrom") or []:
            ref = src.get("configMapRef") or src.get("secretRef")
            kind = "ConfigMap" if "configMapRef" in src else "Secret"
            if ref and not ref.get("optional") and ref.get("name") not in by_kind.get(kind, {}):
                error(cw, f"envFrom: no {kind} {ref.get('name')} in {directory}")
        if str(c.get("image", "")).split("/")[-1].split(":")[0] == "compactd":
            check_compactd_env(cw, [e.get("name", "") for e in c.get("env") or []])
        sidecar = is_init and c.get("restartPolicy") == "Always"
        if is_init and c.get("restartPolicy") not in (None, "Always"):
            error(cw, "an init container's restartPolicy can only be Always (a native sidecar)")
        ports = {p.get("containerPort") for p in c.get("ports") or []}
        port_names = {p.get("name") for p in c.get("ports") or []}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe)
            if not p:
                continue
            if is_init and not sidecar:
                error(cw, f"{probe} on an init container needs restartPolicy: Always")
            for handler in ("grpc", "httpGet", "tcpSocket"):
                port = (p.get(handler) or {}).get("port")
                if port is None:
                    continue
                if port not in ports and port not in port_names:
                    error(cw, f"{probe}.{handler}.port {port} is not one of the container's ports")
        if not (c.get("resources") or {}).get("limits"):
            error(cw, "no resource limits")

for name, np in by_kind.get("NetworkPolicy", {}).items():
    match = ((np.get("spec") or {}).get("podSelector") or {}).get("matchLabels") or {}
    if match and not any(all(l.get(k) == v for k, v in match.items()) for l in pod_labels):
        error(f"NetworkPolicy/{name}", "podSelector matches no pod here")

if errors:
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    print(f"validate-manifests: {len(errors)} error(s) in {directory}", file=sys.stderr)
    sys.exit(1)
print(f"validate-manifests: {len(docs)} resources in {directory} valid against Kubernetes "
      f"{', '.join(versions)} (kubernetes-validate {kv_version}, strict)"
      + ("; kustomization renders" if rendered else ""))
PY
