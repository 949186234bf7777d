"""YAML output for the generated files (PyYAML is imported lazily: a dev dependency)."""

from __future__ import annotations

from typing import Any

__all__ = ["dump", "dump_all"]


def _dumper() -> Any:
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
    import yaml

    return yaml.dump(data, Dumper=_dumper(), sort_keys=False, width=1000,
                     allow_unicode=True, default_flow_style=False)


def dump_all(documents: list[Any]) -> str:
    """Several YAML documents separated by `---`."""
    import yaml

    return yaml.dump_all(documents, Dumper=_dumper(), sort_keys=False, width=1000,
                         allow_unicode=True, default_flow_style=False)
