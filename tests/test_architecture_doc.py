"""``docs/architecture.md`` stays true to the package: it names every module, and names none that is gone.

A module counts as named when its path inside the package appears in the document, written as in the
tree (``strategy.py``, ``engine/dispatch.py``, ``app/conf/``). Package ``__init__.py``/``__main__.py`` files
are covered by their folder's name (``engine/``).
"""

from __future__ import annotations

import pathlib
import re

PROJECT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = PROJECT / "lightning_roundpipe"
DOCUMENT = PROJECT / "docs" / "architecture.md"


def package_modules(package: pathlib.Path) -> set[str]:
    """Every module as the document writes it: ``engine/dispatch.py``, or a folder ``engine/`` for its dunders."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package)
        if path.name in ("__init__.py", "__main__.py"):
            if relative.parent.parts:
                names.add(f"{relative.parent.as_posix()}/")
        else:
            names.add(relative.as_posix())
    return names


def named_paths(text: str) -> set[str]:
    """The paths a text names, ``a/b.py`` or ``a/``, each whole: ``engine/stage.py`` does not name a top-level
    ``stage.py``. A leading ``lightning_roundpipe/`` is dropped."""
    pattern = r"(?<![\w./-])(?:lightning_roundpipe/)?((?:\w+/)*(?:\w+\.py|\w+/))"
    return {match.group(1) for match in re.finditer(pattern, text)}


def missing_and_stale(package: pathlib.Path, text: str) -> tuple[list[str], list[str]]:
    """Modules the text does not name, and ``.py`` paths it names in one of the package's folders that are not
    modules (``tests/...`` or ``benchmarks/...`` are outside the package; a bare ``x.py`` is not checked)."""
    modules = package_modules(package)
    files = {path.relative_to(package).as_posix() for path in package.rglob("*.py")}  # dunders too
    folders = {path.split("/")[0] for path in files if "/" in path}
    named = named_paths(text)
    missing = sorted(modules - named)
    stale = sorted(path for path in named if path.endswith(".py") and path.split("/")[0] in folders
                   and path not in files)
    return missing, stale


def test_the_document_names_every_package_module_and_no_stale_one():
    text = DOCUMENT.read_text()
    missing, stale = missing_and_stale(PACKAGE, text)
    assert not missing, f"docs/architecture.md does not name {missing}: say where each belongs and why"
    assert not stale, f"docs/architecture.md names modules that do not exist (any more): {stale}"


def test_the_check_fails_on_a_missing_or_stale_module(tmp_path):
    package = tmp_path / "pkg"
    (package / "engine").mkdir(parents=True)
    for name in ("__init__.py", "strategy.py", "engine/__init__.py", "engine/stage.py", "engine/worker.py"):
        (package / name).write_text("")
    text = "The adapter is `strategy.py`; `engine/` holds `engine/stage.py`, and `engine/worker.py`."
    assert missing_and_stale(package, text) == ([], [])
    # A sub-path does not name a top-level module, and a module that left the package is stale.
    (package / "stage.py").write_text("")
    text_with_gone = text + " The old `engine/engine.py` ran everything."
    assert missing_and_stale(package, text_with_gone) == (["stage.py"], ["engine/engine.py"])
    assert missing_and_stale(package, text.replace("`engine/worker.py`", "the worker")) == (
        ["engine/worker.py", "stage.py"], [])


def test_the_readme_points_to_the_document():
    assert "docs/architecture.md" in (PROJECT / "README.md").read_text()
