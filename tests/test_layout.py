"""The import graph of ``pisa``: no cycles, and imports point one way (cli -> eval / bench ->
api, layers, integrations -> cache -> ops; inside ops: decode -> select, attn -> pyramid -> utils).
Every import counts, module-level and inside functions (the lazy backend imports too)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pisa"

# Rank of each part of the library: a module may import only parts of lower or equal rank, and
# one of equal rank only inside its own part.
RANKS = [
    ("pisa.ops.utils", 0), ("pisa.ops.pyramid", 1), ("pisa.ops.select", 2), ("pisa.ops.attn", 2),
    ("pisa.ops.coarse", 2),
    ("pisa.ops.decode", 3), ("pisa.results", 4), ("pisa.cache", 5), ("pisa.api", 6),
    ("pisa.distributed", 6), ("pisa.layers", 7), ("pisa.integrations", 7), ("pisa.eval", 8),
    ("pisa.bench", 9), ("pisa.warmup", 9), ("pisa.cli", 10), ("pisa.version", 0), ("pisa", 11),
]


def _part(module: str) -> tuple[str, int]:
    for prefix, rank in RANKS:
        if module == prefix or module.startswith(prefix + "."):
            return prefix, rank
    raise AssertionError(f"{module} belongs to no part of RANKS")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``pisa`` modules ``name`` imports (a ``from X import Y`` of a submodule ``Y`` is an
    import of ``X.Y``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pisa"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "pisa":
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            found |= subs or {target}
    return found - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_point_down():
    bad = []
    for name, targets in _graph().items():
        part, rank = _part(name)
        for t in targets:
            t_part, t_rank = _part(t)
            if t_rank > rank or (t_rank == rank and t_part != part):
                bad.append(f"{name} -> {t}")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = "open"
        for t in sorted(graph.get(n, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", ["pyramid", "select", "attn", "decode", "coarse"])
def test_op_submodules_never_import_their_dispatch(package):
    """``ops/<op>/__init__`` dispatches to its implementations; they never import it back."""
    graph = _graph()
    pkg = f"pisa.ops.{package}"
    bad = [n for n, ts in graph.items() if n.startswith(pkg + ".") and pkg in ts]
    assert not bad, bad


def test_the_check_sees_imports():
    """The graph is not empty where imports are known to exist (the checks above can fail)."""
    graph = _graph()
    assert "pisa.ops.select.torch_backend" in graph["pisa.ops.select"]
    assert "pisa.ops.utils.config" in graph["pisa.api"]
    assert "pisa.ops.utils.walk_triton" in graph["pisa.ops.decode.triton"]
