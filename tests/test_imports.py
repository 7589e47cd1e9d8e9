"""Imports inside occamy_mtp point one way: no module imports itself back through others.

Every import counts, at the top of a module or inside a function: a deferred import
only hides a cycle from the interpreter, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "occamy_mtp"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from occamy_mtp import checkpoint` imports the submodule when there is one
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
                found.add(node.module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import path per cycle found by depth-first search (empty when the graph is acyclic)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "occamy_mtp.train.loop" in graph and "occamy_mtp.model.checkpoint" in graph["occamy_mtp.train.loop"]
    assert cycles(graph) == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles(graph))


def test_a_cycle_is_found(tmp_path):
    package = tmp_path / "occamy_mtp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from occamy_mtp import b\n")
    (package / "b.py").write_text("def late():\n    from occamy_mtp.c import x\n")
    (package / "c.py").write_text("import occamy_mtp.a\nx = 1\n")
    (package / "d.py").write_text("from occamy_mtp.a import b\n")  # imports into the cycle, is not in it
    assert cycles(import_graph(package)) == [["occamy_mtp.a", "occamy_mtp.b", "occamy_mtp.c", "occamy_mtp.a"]]


def test_the_layout_page_lists_every_module_below_what_it_imports():
    """docs/developer/LAYOUT.md's table: every module appears, and imports only modules of earlier (or its own) rows."""
    layout = (PACKAGE.parent / "docs" / "developer" / "LAYOUT.md").read_text()
    rows = []
    for line in layout.splitlines():
        if line.startswith("| `occamy_mtp/"):
            cell = line.split("|")[1]
            rows.append({part.strip().strip("`").removesuffix(".py").rstrip("/").replace("/", ".") for part in cell.split(",")})
    graph = import_graph()
    package_level = {"occamy_mtp"}  # __init__: the version string, importable from anywhere
    listed = set().union(*rows)
    missing = {m for m in graph if m not in package_level and not any(m == r or m.startswith(r + ".") for r in listed)}
    assert not missing, f"modules missing from the layout table of docs/developer/LAYOUT.md: {sorted(missing)}"

    def row_of(module: str) -> int:
        return next(i for i, row in enumerate(rows) if any(module == r or module.startswith(r + ".") for r in row))

    wrong = [
        f"{module} imports {target}, listed below it"
        for module in graph if module not in package_level
        for target in graph[module] if target not in package_level and row_of(target) > row_of(module)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_commands_live_in_one_wing_named_after_themselves():
    """Every command is `occamy_mtp/commands/<name>.py` (a `-` spelled `_`) with a `main`, its
    docstring opening with its launch line; the wing holds nothing else, and no module outside it
    (the command-line entry `__main__` aside) imports the command-line convention or a command."""
    import ast

    from occamy_mtp.__main__ import COMMANDS

    wing = PACKAGE / "commands"
    modules = {p.stem for p in wing.glob("*.py") if p.stem != "__init__"}
    assert modules == {name.replace("-", "_") for name in COMMANDS}
    for name in COMMANDS:
        tree = ast.parse((wing / f"{name.replace('-', '_')}.py").read_text())
        assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body), name
        launch = ast.get_docstring(tree).splitlines()[0]
        script = {"train": "train.py", "export": "export.py", "assemble": "assemble_head.py"}.get(name)  # the design card's scripts
        assert launch.startswith((f"python -m occamy_mtp {name} ", f"python {script} ", f"accelerate launch {script} ")), (name, launch)
    graph = import_graph()
    outside = {module: sorted(t for t in targets if t == "occamy_mtp.cli" or t.startswith("occamy_mtp.commands"))
               for module, targets in graph.items()
               if not module.startswith("occamy_mtp.commands") and module not in ("occamy_mtp.__main__", "occamy_mtp.cli")}
    assert {module: targets for module, targets in outside.items() if targets} == {}
