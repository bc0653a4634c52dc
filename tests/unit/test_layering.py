"""Import layering, read from the package's source with `ast`: experience makers never import advantage
estimators (the group statistics both use live below them, in aligner_ext/groups.py), and no part of
the package (a top-level module or subpackage) imports another that imports it back, directly or
through others. Imports under `if TYPE_CHECKING:` never run, so they count for the first rule only."""

import ast
from pathlib import Path

import aligner_ext

PACKAGE = Path(aligner_ext.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, runtime_only: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every aligner_ext import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(child) for child in ast.walk(node)}
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
    return [(line, name) for line, name in found if name.split(".")[0] == "aligner_ext"]


def part(module: str) -> str:
    """The top-level module or subpackage of aligner_ext that `module` belongs to."""
    return module.split(".")[1] if "." in module else module


def import_edges() -> dict[str, dict[str, str]]:
    """part -> imported part -> one runtime import that makes the edge (`path:line imports module`)."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part(module_name(path))
        for line, name in imports(path, runtime_only=True):
            if part(name) != source:
                where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
                edges.setdefault(source, {}).setdefault(part(name), where)
    return edges


def find_cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    """The imports along one cycle of `edges`, or None (depth-first search from each part)."""
    def walk(start: str, node: str, trail: list[str], seen: set[str]) -> list[str] | None:
        for nxt, where in edges.get(node, {}).items():
            if nxt == start:
                return trail + [where]
            if nxt not in seen:
                seen.add(nxt)
                found = walk(start, nxt, trail + [where], seen)
                if found:
                    return found
        return None

    return next((cycle for start in sorted(edges) if (cycle := walk(start, start, [], {start}))), None)


def test_the_checks_see_imports_and_cycles():
    # the rules below would pass vacuously if imports were missed or cycles not found
    names = [name for _, name in imports(PACKAGE / "experience" / "two_round.py", runtime_only=True)]
    assert "aligner_ext.experience.base" in names and "aligner_ext.groups" in names
    type_only = [name for _, name in imports(PACKAGE / "context.py", runtime_only=False)]
    assert "aligner_ext.config" in type_only and imports(PACKAGE / "context.py", runtime_only=True) == []
    assert import_edges()["trainer"]["config"].startswith("aligner_ext/trainer/")
    assert find_cycle({"a": {"b": "a->b"}, "b": {"c": "b->c"}, "c": {"a": "c->a"}}) == ["a->b", "b->c", "c->a"]
    assert find_cycle({"a": {"b": "a->b"}, "b": {"c": "b->c"}}) is None


def test_experience_never_imports_algorithms():
    offending = [f"aligner_ext/experience/{path.name}:{line} imports {name}"
                 for path in sorted((PACKAGE / "experience").rglob("*.py"))
                 for line, name in imports(path, runtime_only=False) if name.startswith("aligner_ext.algorithms")]
    assert not offending, "experience/ must not import algorithms/ (move shared code below both):\n" + "\n".join(offending)


def test_no_two_parts_of_the_package_import_each_other():
    cycle = find_cycle(import_edges())
    assert cycle is None, "import cycle between parts of the package:\n" + "\n".join(cycle)
