"""Every key of the cluster.yaml schema appears in the shipped cluster.yaml, where users read
what it does, and the file holds no key the schema lacks (it loads)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import yaml

from router.config.loader import load_config
from router.config.schema import ClusterConfig

CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"


def schema_keys(cls: type, prefix: str = "") -> set[str]:
    """Dotted keys of a config dataclass; a field whose type is a section recurses."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys |= schema_keys(kind, key + ".")
        else:
            keys.add(key)
    return keys


def yaml_keys(node: dict, prefix: str = "") -> set[str]:
    """Dotted keys of the YAML; a mapping under a key the schema calls a section recurses."""
    keys = set()
    for name, value in node.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            keys |= yaml_keys(value, key + ".")
        else:
            keys.add(key)
    return keys


def test_every_schema_key_is_documented_in_cluster_yaml():
    documented = yaml_keys(yaml.safe_load(CLUSTER_YAML.read_text()))
    missing = sorted(schema_keys(ClusterConfig) - documented)
    assert not missing, f"cluster.yaml does not show these keys: {missing}"


def test_cluster_yaml_holds_only_schema_keys_and_loads():
    documented = yaml_keys(yaml.safe_load(CLUSTER_YAML.read_text()))
    assert documented <= schema_keys(ClusterConfig)
    load_config(CLUSTER_YAML)  # no unknown key, no bad value
