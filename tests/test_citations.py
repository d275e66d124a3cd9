"""Every path or module that README.md, docs/*.md and the docstrings and comments under pisa/ cite
exists in the repository.

A citation is a repository path (``docs/spec.md``, ``benchmarks/results/x.json``, ``pisa/ops/``),
a bare file name (``selection_v2.md``, ``train_h200_v2.json``, ``regression.py``; globs such as
``beam_price_h200_*.json`` too) or a dotted module (``pisa.ops.utils.config.AUTO_CROSSOVER_T``).
Paths must exist as written (relative to the repository root); bare names are looked up where
such files live (a page's own folder, the root, ``benchmarks/results/`` and its subfolders for
result files, anywhere in the repository for scripts); dotted names resolve to a module file
under ``pisa/`` and then to names defined in it, read from its syntax tree (nothing is imported,
so optional dependencies such as transformers need not be installed). Output paths of commands
(``--json X``, ``--out X``) are not citations.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_DIRS = ("docs", "benchmarks", "examples", "pisa", "tests")

# a character that may not stand right before a citation: it would make it part of a longer path
# (/root/out/x.json, ../shared/y.md), of a longer dotted name (torch.pisa.x) or an expression in
# an f-string ({args.json})
_NOT_AFTER = r"(?<![\w./{-])"
PATH_RE = re.compile(_NOT_AFTER + r"((?:" + "|".join(TOP_DIRS) + r")/[\w./*-]*[\w*])")
# a path relative to the citing page that climbs out of its folder (../README.md from docs/)
RELATIVE_RE = re.compile(r"(?<![\w./-])(\.\./[\w./*-]*[\w*])")
NAME_RE = re.compile(_NOT_AFTER + r"([\w*-]+\.(?:md|py|json|png|tar\.gz))(?![\w/-])")
MODULE_RE = re.compile(_NOT_AFTER + r"(pisa(?:\.[A-Za-z_]\w*)+)")
# files of a user's model directory, not of the repository
EXTERNAL_NAMES = {"config.json", "tokenizer.json", "tokenizer_config.json"}
# what a command writes is not a citation
OUTPUT_RE = re.compile(r"--(?:json|out)[ =]\S+")


def citations(text: str) -> list[tuple[str, str]]:
    """The ``(kind, cited)`` pairs of ``text``, ``kind`` in "path" | "relative" | "name" |
    "module", in order of appearance."""
    text = OUTPUT_RE.sub(" ", text)
    found = [(m.start(), "path", m.group(1)) for m in PATH_RE.finditer(text)]
    found += [(m.start(), "relative", m.group(1)) for m in RELATIVE_RE.finditer(text)]
    found += [(m.start(), "name", m.group(1)) for m in NAME_RE.finditer(text)
              if m.group(1) not in EXTERNAL_NAMES]
    found += [(m.start(), "module", m.group(1)) for m in MODULE_RE.finditer(text)]
    return [(kind, cited) for _, kind, cited in sorted(found)]


def prose_lines(source: str) -> list[str]:
    """Python ``source``'s lines with everything but comments and string literals (docstrings
    among them) blanked out; ``FSTRING_MIDDLE``: the literal parts of an f-string on Python >=
    3.12."""
    lines = [""] * (source.count("\n") + 1)
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in kinds:
            for i, part in enumerate(tok.string.split("\n")):
                lines[tok.start[0] - 1 + i] += " " + part
    return lines


def _exists(root: Path, cited: str) -> bool:
    return any(root.glob(cited)) if "*" in cited else (root / cited).exists()


def path_exists(cited: str, page: Path, root: Path = ROOT) -> bool:
    """A repository path ``cited`` (globs allowed) exists under ``root``."""
    return _exists(root, cited)


def relative_exists(cited: str, page: Path, root: Path = ROOT) -> bool:
    """A path relative to the citing ``page`` exists and lies inside the repository (a clone has
    nothing above its root)."""
    target = (page.parent / cited).resolve()
    return target.is_relative_to(root.resolve()) and _exists(page.parent, cited)


def name_exists(cited: str, page: Path, root: Path = ROOT) -> bool:
    """A bare file name exists next to the citing ``page``, at the root, or where files of its
    kind live: result files under ``benchmarks/results/`` (any depth), scripts anywhere."""
    if _exists(page.parent, cited) or _exists(root, cited):
        return True
    if cited.endswith((".json", ".tar.gz")):
        return any((root / "benchmarks" / "results").rglob(cited))
    if cited.endswith(".py"):
        return any(root.rglob(cited))
    return False


def _defined_names(tree: ast.AST) -> dict[str, ast.AST | None]:
    """Top-level names a module (or class body) defines: functions, classes (mapped to their
    node, to look inside), assignments and imports."""
    names: dict[str, ast.AST | None] = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node if isinstance(node, ast.ClassDef) else None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names[t.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try)):  # guarded definitions
            names.update(_defined_names(node))
            for handler in getattr(node, "handlers", []):
                names.update(_defined_names(handler))
    return names


def module_exists(cited: str, page: Path, root: Path = ROOT) -> bool:
    """A dotted name ``pisa.a.b.c`` is a module file under ``root`` (the longest such prefix)
    followed by names it defines (a class's attributes for a second name), e.g.
    ``pisa.ops.utils.config.SelectConfig.beam_at``."""
    parts = cited.split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        file = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()),
                    None)
        if file is not None:
            break
    else:
        return False
    scope: ast.AST | None = ast.parse(file.read_text())
    for attr in parts[n:]:
        names = _defined_names(scope) if scope is not None else {}
        if attr not in names:
            return False
        scope = names[attr]
        if scope is None:  # a function or value: what follows is not read
            return True
    return True


RESOLVE = {"path": path_exists, "relative": relative_exists, "name": name_exists,
           "module": module_exists}
# The history page cites modules and scripts by the paths they had then (it says so at its top);
# only these, only there, and each must really be gone (else the entry is stale).
REMOVED = {"docs/history.md": {
    "pisa/ops/select_triton.py", "pisa/ops/attn_triton.py", "pisa/ops/decode_triton.py",
    "pisa/ops/utils.py", "select_triton.py", "attn_triton.py", "decode_triton.py", "utils.py",
    "levers_h200.py", "benchmarks/levers_h200.py", "tests/test_gpu.py",
    "tests/ops/test_attn_triton.py", "tests/ops/test_select_triton.py"}}


def pages(root: Path = ROOT) -> list[Path]:
    """The files whose citations are checked."""
    return ([root / "README.md", *sorted((root / "docs").glob("*.md"))]
            + sorted((root / "pisa").rglob("*.py")))


def broken(root: Path = ROOT, removed: dict[str, set[str]] | None = None) -> list[str]:
    """``"page:line: kind 'cited'"`` for every citation under ``root`` that does not resolve,
    except the ``removed`` files a page may cite by their old paths."""
    out = []
    for page in pages(root):
        name, text = page.relative_to(root).as_posix(), page.read_text()
        old = (removed or {}).get(name, set())
        lines = prose_lines(text) if page.suffix == ".py" else text.splitlines()
        for number, line in enumerate(lines, 1):
            for kind, cited in citations(line):
                if cited not in old and not RESOLVE[kind](cited, page, root):
                    out.append(f"{name}:{number}: {kind} {cited!r}")
    return out


def test_every_citation_exists():
    bad = broken(removed=REMOVED)
    assert not bad, "citations of missing files or modules:\n" + "\n".join(bad)


def test_removed_files_are_gone():
    back = [f"{page}: {cited}" for page, olds in REMOVED.items() for cited in olds
            if path_exists(cited, ROOT / page) or name_exists(cited, ROOT / page)]
    assert not back, f"listed as removed but present (drop them from REMOVED): {back}"


def test_extractor_finds_each_kind_and_skips_outputs_and_other_machines_paths():
    text = ("See `docs/spec.md` §4, benchmarks/results/a_*.json and selection_v2.md; "
            "``pisa.ops.utils.config.SelectConfig``, ../shared/X.md. Not /root/out/y.json, "
            "torch.pisa.z, `--json benchmarks/results/new.json`, f\"{args.json}\".")
    assert citations(text) == [("path", "docs/spec.md"), ("path", "benchmarks/results/a_*.json"),
                               ("name", "selection_v2.md"),
                               ("module", "pisa.ops.utils.config.SelectConfig"),
                               ("relative", "../shared/X.md")]


def test_python_prose_is_comments_and_strings_only():
    src = 'import pisa.api\nx = "see docs/a.md"  # and pisa/b.py\n'
    assert [citations(line) for line in prose_lines(src)] == [
        [], [("path", "docs/a.md"), ("path", "pisa/b.py")], []]


@pytest.fixture
def fake_repo(tmp_path):
    """A tiny repository: one module, one result file, a README that cites good and bad."""
    (tmp_path / "pisa" / "ops").mkdir(parents=True)
    (tmp_path / "pisa" / "__init__.py").write_text("from .ops.m import f\n")
    (tmp_path / "pisa" / "ops" / "__init__.py").write_text("")
    (tmp_path / "pisa" / "ops" / "m.py").write_text(
        '"""Cites ``pisa.ops.m.Gone`` and docs/gone.md."""\n'
        "LIMIT = 3\n\nclass Cfg:\n    def width(self):\n        pass\n\ndef f():\n    pass\n")
    (tmp_path / "benchmarks" / "results" / "history").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "history" / "old.json").write_text("{}")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("`README.md`, `old.json`, `pisa.f`, ../README.md,"
                                               " `../../shared/SPEC.md`, `docs/gone.md`\n")
    (tmp_path / "README.md").write_text(
        "`docs/page.md` `pisa.ops.m.Cfg.width` `pisa.ops.m.LIMIT`\n"
        "`docs/missing.md` `benchmarks/results/old.json` `new.json` `pisa.ops.m.Cfg.depth` "
        "`pisa.ops.gone` `pisa/ops/gone.py`\n")
    return tmp_path


def test_a_missing_file_or_module_is_reported(fake_repo):
    assert broken(fake_repo, removed={"docs/page.md": {"docs/gone.md"}}) == [
        "README.md:2: path 'docs/missing.md'",
        "README.md:2: path 'benchmarks/results/old.json'",  # moved to history/: path is stale
        "README.md:2: name 'new.json'",
        "README.md:2: module 'pisa.ops.m.Cfg.depth'",
        "README.md:2: module 'pisa.ops.gone'",
        "README.md:2: path 'pisa/ops/gone.py'",
        "docs/page.md:1: relative '../../shared/SPEC.md'",
        "pisa/ops/m.py:1: module 'pisa.ops.m.Gone'",
        "pisa/ops/m.py:1: path 'docs/gone.md'",
    ]
