"""The package floors of docs/architecture.md, checked on the source.

Every module's imports are read with ``ast``: top-level ones, the lazy ones inside
functions, those under ``TYPE_CHECKING``, and ``importlib.import_module("...")`` with a
literal name. Two rules follow from the floors:

- imports point down: no package imports one on a higher floor (packages of one floor may
  import each other only where :data:`SIDEWAYS` says so);
- no two modules import each other directly.

A violation is reported as ``file:line`` with the import that breaks the rule, all of them
at once, so one run lists everything to fix.

``cluster/cli.py`` names its subcommands' modules as strings in a table (``SUBCOMMANDS``)
and imports the chosen one by that string: the entry-point table knows every command,
``bench/``'s included, as ``[project.scripts]`` does. Such computed names are not imports
here; the test of the table is that each names a module on disk.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lower floors know nothing of higher ones (docs/architecture.md, "Package floors").
FLOORS: dict[str, int] = {
    "scheduler": 0,
    "engine": 1,
    "kvtransfer": 1,
    "prefill_pool": 2,
    "decode_pool": 2,
    "router": 2,
    "cluster": 3,
    "bench": 4,
}

# Imports between packages of one floor, allowed by name (importer -> imported). None:
# engine and kvtransfer stand beside each other, and so do the pools and the router; what
# two of them need lives a floor down.
SIDEWAYS: frozenset[tuple[str, str]] = frozenset()

# Pairs of modules allowed to import each other: none (kvtransfer's links, which named
# their owners, now get a context object). A pair listed here that is gone fails too.
KNOWN_MUTUAL: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Import:
    """One module named by an import statement of ``source`` at ``line``."""

    source: str  # the importing module, dotted
    path: Path
    line: int
    target: str  # the imported module, dotted (a package means its __init__)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative ones resolved)."""
    if node.level == 0:
        return node.module or ""
    package = source.split(".") if is_package else source.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path, text: str | None = None) -> list[Import]:
    """Every import in the file at ``path`` (or in ``text``, read as that file)."""
    source = module_name(path)
    is_package = path.name == "__init__.py"
    text = path.read_text(encoding="utf-8") if text is None else text
    tree = ast.parse(text, filename=str(path))
    found: list[Import] = []

    def add(target: str, line: int) -> None:
        imp = Import(source, path, line, target)
        if imp not in found:  # `from m import a, b` names m once
            found.append(imp)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(source, is_package, node)
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod where there is one.
                sub = f"{module}.{alias.name}"
                add(sub if is_module(sub) else module, node.lineno)
        elif isinstance(node, ast.Call) and _is_import_module(node.func):
            if node.args and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, str):
                    add(node.args[0].value, node.lineno)
    return found


def _is_import_module(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id == "import_module"


def all_imports() -> list[Import]:
    found: list[Import] = []
    for package in FLOORS:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.extend(imports_of(path))
    return found


def where(imp: Import) -> str:
    return f"{imp.path.relative_to(ROOT)}:{imp.line}"


def floor_violations(imports: list[Import]) -> list[str]:
    bad: list[str] = []
    for imp in imports:
        src, dst = imp.source.split(".")[0], imp.target.split(".")[0]
        if src == dst or dst not in FLOORS:
            continue
        if FLOORS[dst] > FLOORS[src]:
            bad.append(f"{where(imp)}: {imp.source} (floor {FLOORS[src]}) imports "
                       f"{imp.target} (floor {FLOORS[dst]}), a higher floor")
        elif FLOORS[dst] == FLOORS[src] and (src, dst) not in SIDEWAYS:
            bad.append(f"{where(imp)}: {imp.source} imports {imp.target}, a package "
                       f"beside it (floor {FLOORS[src]}); what both need belongs a floor down")
    return bad


def mutual_imports(imports: list[Import]) -> dict[tuple[str, str], str]:
    """Each pair of modules that import each other (names sorted), with where."""
    first: dict[tuple[str, str], Import] = {}
    for imp in imports:
        if imp.source != imp.target:
            first.setdefault((imp.source, imp.target), imp)
    pairs: dict[tuple[str, str], str] = {}
    for (a, b), imp in sorted(first.items()):
        back = first.get((b, a))
        if back is not None and a < b:
            pairs[(a, b)] = f"{where(imp)} and {where(back)}: {a} and {b} import each other"
    return pairs


def test_every_package_of_a_floor_is_on_disk() -> None:
    assert sorted(p for p in FLOORS if not (ROOT / p / "__init__.py").is_file()) == []


def test_imports_point_down() -> None:
    bad = floor_violations(all_imports())
    assert bad == [], "\n".join(bad)


def test_no_two_modules_import_each_other() -> None:
    pairs = mutual_imports(all_imports())
    bad = [text for pair, text in pairs.items() if pair not in KNOWN_MUTUAL]
    assert bad == [], "\n".join(bad)
    gone = sorted(KNOWN_MUTUAL - pairs.keys())
    assert gone == [], f"no longer import each other; strike from KNOWN_MUTUAL: {gone}"


def test_every_command_names_a_module_on_disk() -> None:
    """The CLI's table names modules by string, which the import checks do not follow."""
    from cluster.cli import SUBCOMMANDS

    missing = sorted(m for m, _ in SUBCOMMANDS.values() if not is_module(m))
    assert missing == []


def test_the_checks_see_lazy_relative_and_string_imports() -> None:
    """An upward import in a function or by string is caught, at its line."""
    path = ROOT / "scheduler" / "_floors_probe.py"  # read as if it were there; not written
    found = imports_of(path, (
        "from . import tiers\n"
        "def f():\n"
        "    from cluster import config\n"
        "    import importlib\n"
        "    return importlib.import_module('router.metrics')\n"
    ))
    assert [(i.line, i.target) for i in found] == [
        (1, "scheduler.tiers"), (3, "cluster.config"), (4, "importlib"), (5, "router.metrics")]
    bad = floor_violations(found)
    assert [b.split(": ", 1)[0] for b in bad] == ["scheduler/_floors_probe.py:3",
                                                  "scheduler/_floors_probe.py:5"]
    pair = [Import("a.x", path, 1, "a.y"), Import("a.y", path, 2, "a.x")]
    assert list(mutual_imports(pair)) == [("a.x", "a.y")]
