"""A renderer for the subset of kustomize that k8s/ uses, for machines without kustomize.

Supported kustomization keys: `resources` (files and directories), `patches` (JSON 6902
operation lists with a kind/name target), `images` (newName/newTag), `namespace`. Any other
key raises, so a manifest that starts using more of kustomize fails here loudly instead of
rendering wrong. Where `kubectl kustomize` exists the tests check both render the same.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images", "namespace"}
# Kinds without a namespace among those k8s/ uses.
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "APIService",
    "PersistentVolume",
    "StorageClass",
}

Obj = dict[str, Any]


class KustomizeError(ValueError):
    pass


def load_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def render(directory: Path) -> list[Obj]:
    """The objects `kustomize build directory` would emit (order not guaranteed)."""
    kfile = directory / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text())
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported kustomization keys {sorted(unknown)}")
    objs: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objs.extend(render(path) if path.is_dir() else load_docs(path))
    for patch in spec.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise KustomizeError(f"{patch['path']}: only JSON 6902 operation lists are supported")
        targets = [o for o in objs if _matches(o, patch["target"])]
        if not targets:
            raise KustomizeError(f"patch {patch['path']} matches nothing: {patch['target']}")
        for obj in targets:
            apply_json_patch(obj, ops)
    for image in spec.get("images", []):
        for obj in objs:
            _set_image(obj, image)
    namespace = spec.get("namespace")
    if namespace:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace
    return objs


def _matches(obj: Obj, target: dict[str, str]) -> bool:
    if set(target) - {"kind", "name"}:
        raise KustomizeError(f"unsupported patch target keys: {sorted(target)}")
    return target.get("kind") in (None, obj.get("kind")) and target.get("name") in (
        None,
        obj.get("metadata", {}).get("name"),
    )


def _pod_spec(obj: Obj) -> Obj | None:
    if obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return obj["spec"]["template"]["spec"]
    if obj.get("kind") == "Pod":
        return obj["spec"]
    return None


def _set_image(obj: Obj, image: dict[str, str]) -> None:
    spec = _pod_spec(obj)
    if spec is None:
        return
    for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        name, _, tag = container["image"].partition(":")
        if name != image["name"]:
            continue
        new_name = image.get("newName", name)
        new_tag = image.get("newTag", tag)
        container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def apply_json_patch(obj: Obj, ops: list[Obj]) -> None:
    """RFC 6902 add / replace / remove, in place."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        value = copy.deepcopy(op.get("value"))
        if isinstance(node, list):
            if kind == "add":
                node.insert(len(node) if last == "-" else int(last), value)
            elif kind == "replace":
                node[int(last)] = value
            elif kind == "remove":
                del node[int(last)]
            else:
                raise KustomizeError(f"unsupported op {kind!r}")
        else:
            if kind in ("replace", "remove") and last not in node:
                raise KustomizeError(f"{kind} of missing path {op['path']}")
            if kind in ("add", "replace"):
                node[last] = value
            elif kind == "remove":
                del node[last]
            else:
                raise KustomizeError(f"unsupported op {kind!r}")
