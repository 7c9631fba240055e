"""Regenerate the vendored JSON schemas the manifest tests validate against.

Not run by the tests (they read the vendored files, offline); run by hand, in a throwaway
virtual environment, when the target Kubernetes or KEDA version changes:

    python -m venv /tmp/schemas && /tmp/schemas/bin/pip install kubernetes-validate \
        cloudcoil-models-keda check-jsonschema
    /tmp/schemas/bin/python deploy/schemas/vendor_schemas.py

Kubernetes: the strict (`additionalProperties: false`) schemas that the `kubernetes-validate`
package ships, for the kinds deploy/k8s/ uses, with `_definitions.json` cut down to the
definitions they reach (same content, fewer unrelated kinds).

Compose: the Compose Specification's schema as the `check-jsonschema` package vendors it (with
its Apache-2.0 licence).

KEDA: no package on the registry ships the ScaledObject and TriggerAuthentication CRD schemas as JSON, so it is derived
from `cloudcoil-models-keda` (pydantic models generated from the KEDA CRDs) with pydantic's
`model_json_schema`, then made strict the same way: every object that lists its properties
gets `additionalProperties: false` unless it is a free-form map (trigger `metadata`, labels).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

KUBERNETES_VERSION = "1.31.0"
KINDS = ("deployment-apps-v1", "poddisruptionbudget-policy-v1", "configmap-v1", "secret-v1")
HERE = Path(__file__).resolve().parent


def _refs(node) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref)
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def vendor_kubernetes() -> None:
    import importlib.resources

    root = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict"
    )
    out = HERE / "kubernetes" / f"v{KUBERNETES_VERSION}-strict"
    out.mkdir(parents=True, exist_ok=True)
    full = json.loads(root.joinpath("_definitions.json").read_text())
    definitions = full["$defs"]
    wanted: set[str] = set()
    todo: list[str] = []
    for kind in KINDS:
        schema = json.loads(root.joinpath(f"{kind}.json").read_text())
        (out / f"{kind}.json").write_text(json.dumps(schema, indent=1) + "\n")
        todo += sorted(_refs(schema))
    while todo:
        name = re.sub(r"^.*#/\$defs/", "", todo.pop())
        if name not in wanted:
            wanted.add(name)
            todo += sorted(_refs(definitions[name]))
    subset = {k: v for k, v in full.items() if k != "$defs"}  # $schema, $id
    subset["$defs"] = {name: definitions[name] for name in sorted(wanted)}
    (out / "_definitions.json").write_text(json.dumps(subset, indent=1) + "\n")


def _make_strict(node) -> None:
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _make_strict(value)
    elif isinstance(node, list):
        for value in node:
            _make_strict(value)


def vendor_keda() -> None:
    from importlib.metadata import version

    from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication

    out = HERE / "keda"
    out.mkdir(parents=True, exist_ok=True)
    source = f"cloudcoil-models-keda {version('cloudcoil-models-keda')}, made strict"
    for model in (ScaledObject, TriggerAuthentication):
        schema = model.model_json_schema(by_alias=True, mode="validation")
        _make_strict(schema)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["x-source"] = source
        name = f"{model.__name__.lower()}-keda-v1alpha1.json"
        (out / name).write_text(json.dumps(schema, indent=1) + "\n")


def vendor_compose() -> None:
    import importlib.resources

    vendor = importlib.resources.files("check_jsonschema").joinpath("builtin_schemas/vendor")
    out = HERE / "compose"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compose-spec.json").write_text(vendor.joinpath("compose-spec.json").read_text())
    licence = vendor.joinpath("licenses/LICENSE.compose-spec").read_text()
    (out / "LICENSE.compose-spec").write_text(licence)


if __name__ == "__main__":
    vendor_kubernetes()
    vendor_keda()
    vendor_compose()
