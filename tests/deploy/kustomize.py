"""Renders deploy/kubernetes/'s kustomizations the way `kubectl kustomize` does, for the
subset of kustomize those files use: `resources` (files and folders), `images` (new tags) and
`patches` with a target and a JSON 6902 patch. Any other key fails loudly rather than being
ignored. (Checked against kustomize v5.5's own output for every overlay when written; CI has
no kubectl.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonpatch
import yaml

Manifest = dict[str, Any]
SUPPORTED = {"apiVersion", "kind", "resources", "images", "patches"}


def load_documents(path: Path) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_spec(manifest: Manifest) -> dict[str, Any] | None:
    if manifest["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        spec: dict[str, Any] = manifest["spec"]["template"]["spec"]
        return spec
    return None


def matches(manifest: Manifest, target: dict[str, str]) -> bool:
    group, _, version = manifest["apiVersion"].rpartition("/")
    wanted = {
        "group": group,
        "version": version,
        "kind": manifest["kind"],
        "name": manifest["metadata"]["name"],
    }
    return all(wanted[key] == value for key, value in target.items())


def set_image(manifest: Manifest, image: dict[str, str]) -> None:
    spec = pod_spec(manifest)
    if spec is None:
        return
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            new_name = image.get("newName", name)
            container["image"] = f"{new_name}:{image.get('newTag', tag)}"


def build(folder: Path) -> list[Manifest]:
    """The manifests that `kubectl kustomize folder` prints, as dicts."""
    kustomization: dict[str, Any] = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    assert not unknown, f"{folder}: kustomize features this renderer lacks: {sorted(unknown)}"
    manifests: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        manifests += build(path) if path.is_dir() else load_documents(path)
    for image in kustomization.get("images", []):
        for manifest in manifests:
            set_image(manifest, image)
    for patch in kustomization.get("patches", []):
        operations = yaml.safe_load(patch["patch"])
        targets = [i for i, m in enumerate(manifests) if matches(m, patch["target"])]
        assert targets, f"{folder}: patch target {patch['target']} matches nothing"
        for index in targets:
            manifests[index] = jsonpatch.apply_patch(manifests[index], operations)
    return manifests
