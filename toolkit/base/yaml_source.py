"""YAML loading that remembers where every value came from (file and line), for located errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.base.errors import FtError

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


# Recipes and profiles are small, hand-written files. These bounds keep a hostile one (an alias
# "billion laughs", 100k-deep nesting, a FIFO, a huge file) from hanging or crashing ft.
MAX_YAML_BYTES = 1 << 20
MAX_NODES = 100_000  # nodes visited with aliases expanded
MAX_DEPTH = 64

# The pure-Python loader: libyaml's C composer recurses without a limit and crashes the process
# (SIGSEGV) on deeply nested input; files this small parse in milliseconds either way.
BoundedLoader = yaml.SafeLoader


def read_text_file(path: Path, what: str = "file") -> str:
    """A small UTF-8 text file, or a YamlError that says why not (never blocks on a FIFO)."""
    try:
        if path.is_dir():
            raise YamlError(f"{path}: is a folder, not a {what}")
        if not path.exists():
            if path.is_symlink():
                raise YamlError(f"{path}: cannot be read: a symbolic link that leads nowhere (a loop, or a "
                                "missing target)")
            raise YamlError(f"{path}: no such file")
        if not path.is_file():
            raise YamlError(f"{path}: not a regular file (a FIFO or device?): give a {what} file")
        if path.stat().st_size > MAX_YAML_BYTES:
            raise YamlError(f"{path}: larger than {MAX_YAML_BYTES >> 20} MiB; a {what} is a small text file")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:  # a symlink loop, a permission problem
        raise YamlError(f"{path}: cannot be read: {exc.strerror or exc}") from None


def _index(root: yaml.Node, source: SourceMap) -> None:
    """Record every key's and value's line; refuse duplicate keys, and bound the work (aliases make
    a small document arbitrarily large when expanded)."""
    visited = 0
    stack: list[tuple[yaml.Node, Location]] = [(root, ())]
    while stack:
        node, location = stack.pop()
        visited += 1
        if visited > MAX_NODES:
            raise YamlError(f"{source.path}: the document expands to more than {MAX_NODES} values "
                            "(aliases referring to aliases?)", hint="write the values out without nested aliases")
        if len(location) > MAX_DEPTH:
            line = node.start_mark.line + 1
            raise YamlError(f"{source.path}:{line}: nested more than {MAX_DEPTH} levels deep")
        source.lines.setdefault(location, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict[object, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value
                line = key_node.start_mark.line + 1
                hashable = key if isinstance(key, str) else repr(key)
                if hashable in seen and not (key_node.tag == "tag:yaml.org,2002:merge"):
                    raise YamlError(f"{source.path}:{line}: key {key!r} appears twice (lines {seen[hashable]} and "
                                    f"{line}); YAML would silently keep the last", hint="remove one of them")
                seen[hashable] = line
                source.lines[(*location, key)] = line
                stack.append((value_node, (*location, key)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*location, index)) for index, item in enumerate(node.value))


def parse_yaml(text: str, where: str) -> tuple[Any, SourceMap]:
    """Parse YAML text from `where`, bounded; return its data and where each part of it is."""
    source = SourceMap(where)
    loader = None
    try:
        loader = BoundedLoader(text)  # its reader already refuses some characters
        node = loader.get_single_node()
        if node is None:
            return None, source
        _index(node, source)
        data = loader.construct_document(node)  # after the bounds: aliases are shared, not copied
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        located = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        problem = getattr(exc, "problem", None) or str(exc)
        raise YamlError(f"{located}: invalid YAML: {problem}",
                        hint="check indentation and quoting around that line") from None
    except RecursionError:
        raise YamlError(f"{where}: nested too deeply to read") from None
    except ValueError as exc:  # a value the constructor refuses: a 5000-digit integer...
        raise YamlError(f"{where}: a value cannot be read: {str(exc)[:160]}") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, source


def load_yaml(path: Path, what: str = "recipe") -> tuple[Any, SourceMap]:
    """Parse a YAML file; return its data and where each part of it is."""
    return parse_yaml(read_text_file(path, what), str(path))


def load_trusted_yaml(path: Path) -> Any:
    """ft's own shipped files (built-in profiles): libyaml's fast loader, no bounds needed."""
    return yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
