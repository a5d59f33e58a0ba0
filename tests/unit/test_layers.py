"""toolkit/LAYERS.md is the law of the house: every import in toolkit/ goes to a lower floor, no two
modules import each other however indirectly, and the login node, the job and the site's service
host each keep to their own parts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = REPO / "toolkit" / "LAYERS.md"
JOB_ONLY = {"toolkit.train", "toolkit.launch", "toolkit.job", "toolkit.watch"}


def read_table() -> dict[str, tuple[int, str]]:
    """{part: (floor, where it runs)} from the table's rows."""
    rows = re.findall(r"^\| (\d+) \| (toolkit[\w.]*) \| [^|]+ \| ([^|]+) \|$", LAYERS.read_text(), re.MULTILINE)
    return {part: (int(floor), runs.strip()) for floor, part, runs in rows}


def kept_entry_points() -> set[str]:
    section = LAYERS.read_text().split("## Kept entry points", 1)[1]
    return set(re.findall(r"^- `(toolkit[\w.]*)`", section, re.MULTILINE))


def modules(root: Path = REPO) -> dict[str, Path]:
    found = {}
    for path in (root / "toolkit").rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The toolkit modules a file imports, at its top or inside a function alike. `from pkg import
    name` is an import of pkg.name where that is a module, else of pkg."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def part_of(module: str, parts) -> str | None:
    """The part that names the module most closely."""
    candidates = [part for part in parts if module == part or module.startswith(part + ".")]
    return max(candidates, key=len, default=None)


def graph(root: Path = REPO) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(path, known) - {name} for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def violations(edges: dict[str, set[str]], table: dict[str, tuple[int, str]], allowed: set[str]) -> list[str]:
    wrong = []
    for module, targets in edges.items():
        if module in allowed:
            continue
        source = part_of(module, table)
        for target in targets:
            into = part_of(target, table)
            if into != source and table[into][0] >= table[source][0]:
                wrong.append(f"{module} (floor {table[source][0]}) imports {target} (floor {table[into][0]})")
    return sorted(wrong)


def test_every_module_is_in_a_part_of_the_table():
    table = read_table()
    assert len(table) > 20 and "toolkit.base" in table and "toolkit.cli" in table
    assert [module for module in modules() if part_of(module, table) is None] == []
    assert [part for part in table if part not in modules()] == []  # no row for a part that is gone


def test_every_import_goes_down_a_floor():
    assert violations(graph(), read_table(), kept_entry_points()) == []


def test_no_two_modules_import_each_other_however_indirectly():
    assert circles(graph()) == []


PLACES = {"anywhere", "login node", "job", "login node, job", "service host", "compute node"}


def test_each_part_says_where_it_runs_in_words_the_checks_know():
    assert {part: runs for part, (_, runs) in read_table().items() if runs not in PLACES} == {}


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_login_node_and_the_job_keep_to_their_own_parts():
    """However indirectly: a login-node command that reaches the job's parts through a part that runs
    anywhere loads them all the same."""
    table = read_table()
    login = {part for part, (_, runs) in table.items() if runs == "login node"}
    assert {part for part, (_, runs) in table.items() if runs == "job"} >= JOB_ONLY
    edges, crossings = graph(), []
    for module in edges:
        source = part_of(module, table)
        if source not in login | JOB_ONLY:
            continue
        for target in reachable(edges, module):
            into = part_of(target, table)
            if (source in login and into in JOB_ONLY) or (source in JOB_ONLY and into in login):
                crossings.append(f"{module} -> {target}")
    assert crossings == []


def test_no_relative_imports_hide_from_the_graph():
    relative = [f"{module}:{node.lineno}" for module, path in modules().items()
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == []


def test_the_site_daemons_are_imported_by_nothing_in_ft():
    def daemon(module: str) -> bool:
        return module.startswith("toolkit.services")

    importers = [module for module, targets in graph().items() if not daemon(module) and any(map(daemon, targets))]
    assert importers == []


def test_the_kept_entry_point_goes_up_only_when_run_as_a_program():
    for module in kept_entry_points():
        tree = ast.parse(modules()[module].read_text())
        top_level = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
        assert top_level == [], f"{module} imports at its top: the job above it would load with the watchdog"


@pytest.mark.parametrize("planted", ["upward", "circle"])
def test_the_checks_catch_what_they_are_for(tmp_path, planted):
    """A planted upward import (data importing train) and a planted circle are both found."""
    (tmp_path / "toolkit" / "data").mkdir(parents=True)
    (tmp_path / "toolkit" / "train").mkdir(parents=True)
    for package in ("toolkit", "toolkit/data", "toolkit/train"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "toolkit" / "train" / "loop.py").write_text("from toolkit.data import rows\n")
    body = "from toolkit.train import loop\n" if planted == "upward" else "import toolkit.data.other\n"
    (tmp_path / "toolkit" / "data" / "rows.py").write_text(body)
    (tmp_path / "toolkit" / "data" / "other.py").write_text("from toolkit.data import rows\n")
    edges = graph(tmp_path)
    table = {"toolkit": (9, "anywhere"), "toolkit.data": (4, "anywhere"), "toolkit.train": (7, "job")}
    if planted == "upward":
        assert violations(edges, table, set()) == [
            "toolkit.data.rows (floor 4) imports toolkit.train.loop (floor 7)"]
        assert circles(edges) == [["toolkit.data.rows", "toolkit.train.loop"]]
    else:
        assert violations(edges, table, set()) == []
        assert circles(edges) == [["toolkit.data.other", "toolkit.data.rows"]]
