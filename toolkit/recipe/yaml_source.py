"""YAML loading that remembers where every value came from (file and line), for located errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.errors import FtError

# libyaml's loader when PyYAML was built with it: several times faster on the login node.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

Location = tuple[str | int, ...]


@dataclass
class SourceMap:
    """Line numbers (1-based) of the keys and values of a YAML document, by path."""

    path: str
    lines: dict[Location, int] = field(default_factory=dict)

    def line_of(self, location: Location) -> int | None:
        # The nearest located ancestor: a missing field is reported at its parent mapping.
        for end in range(len(location), -1, -1):
            line = self.lines.get(tuple(location[:end]))
            if line is not None:
                return line
        return None


class YamlError(FtError):
    exit_code = 2


def _index(node: yaml.Node, location: Location, source: SourceMap) -> None:
    source.lines.setdefault(location, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            source.lines[(*location, key)] = key_node.start_mark.line + 1
            _index(value_node, (*location, key), source)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _index(item, (*location, index), source)


def load_yaml(path: Path) -> tuple[Any, SourceMap]:
    """Parse a YAML file; return its data and where each part of it is."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise YamlError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise YamlError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    source = SourceMap(str(path))
    try:
        node = yaml.compose(text, Loader=SafeLoader)
        data = yaml.load(text, Loader=SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise YamlError(f"{where}: invalid YAML: {problem}",
                        hint="check indentation and quoting around that line") from None
    if node is not None:
        _index(node, (), source)
    return data, source
