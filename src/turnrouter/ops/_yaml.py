"""YAML output for the generated files (PyYAML is imported lazily: the `ops` extra)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["MissingYaml", "dump", "dump_all", "load_yaml"]


class MissingYaml(ImportError):
    """PyYAML is not installed: one line naming the extra that brings it."""


def load_yaml() -> ModuleType:
    """The `yaml` module, or `MissingYaml` saying which extra to install."""
    try:
        import yaml
    except ImportError as exc:
        raise MissingYaml(
            "turnrouter.ops needs PyYAML: install turnrouter's ops extra "
            "(from a checkout: pip install -e '.[ops]')") from exc
    return yaml


def _dumper() -> Any:
    load_yaml()  # the one-line hint when PyYAML is missing
    import yaml

    class Dumper(yaml.SafeDumper):
        """Block style; multi-line strings as literal blocks; keys in insertion order."""

    def represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, represent_str)
    return Dumper


def dump(data: Any) -> str:
    """One YAML document."""
    load_yaml()  # the one-line hint when PyYAML is missing
    import yaml

    return yaml.dump(data, Dumper=_dumper(), sort_keys=False, width=1000,
                     allow_unicode=True, default_flow_style=False)


def dump_all(documents: list[Any]) -> str:
    """Several YAML documents separated by `---`."""
    load_yaml()  # the one-line hint when PyYAML is missing
    import yaml

    return yaml.dump_all(documents, Dumper=_dumper(), sort_keys=False, width=1000,
                         allow_unicode=True, default_flow_style=False)
