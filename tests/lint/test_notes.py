"""Design notes and cited paths stay true (docs/design/conventions.md, "Design notes").

A note ``[Note: name]`` is *defined* exactly once: by a heading of a document under ``docs/`` that starts with it
(``## [Note: name] ...``), by a paragraph of a ``docs/design/*.md`` file that starts with it, or by a paragraph
of a module docstring that starts with it (code comments and other docstrings only cite). Every other occurrence
is a *citation*; every citation names a defined note, and every defined note is cited at least once besides its
definition (a note nobody relies on is a comment).

Every repository path that a docstring (of any module, class or function) or a document names -- ``docs/...md``,
``benchmarks/...``, ``deepspeed/....py``, ``tests/...py`` and the like -- exists in the tree (``tests/_harness.x``
and ``deepspeed/__init__`` name ``tests/_harness.py`` and ``deepspeed/__init__.py``). Result files under
``benchmarks/results`` are records of past runs and are not checked.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTE = re.compile(r"\[Note: ([^\]\n]+)\]")
# A path the repository could hold: one of its top-level folders, then at least one more component.
PATH = re.compile(r"(?<![\w./-])((?:deepspeed|docs|benchmarks|tests|examples|scripts|csrc)/[\w./-]*[\w/])")
SKIP_PARTS = {"__pycache__", ".git", "results"}
PLACEHOLDER = re.compile(r"[<>{}*]|\.\.\.")
SELF = Path(__file__).resolve()
EXAMPLE_NOTES = {"name"}  # ``[Note: name]`` where a document explains the convention itself
# Created when the package is built, not in a checkout: ``csrc/`` is copied there (setup.py).
BUILD_PATHS = {"deepspeed/ops/csrc"}


def _files(suffix: str, *tops: str) -> list[Path]:
    found: list[Path] = []
    for top in tops:
        base = ROOT / top
        candidates = [base] if base.is_file() else sorted(base.rglob(f"*{suffix}"))
        found.extend(
            p
            for p in candidates
            if p.suffix == suffix and not SKIP_PARTS & set(p.relative_to(ROOT).parts) and p.resolve() != SELF
        )  # this file's examples are not the tree's notes
    return found


def _python_files() -> list[Path]:
    return _files(".py", "deepspeed", "benchmarks", "tests", "examples", "scripts")


def _markdown_files() -> list[Path]:
    return _files(".md", "docs", "benchmarks", "README.md", "examples", "tests")


def _docstrings(path: Path) -> list[tuple[int, str, bool]]:
    """(line, text, is_module_docstring) of every docstring in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                line = node.body[0].lineno
                out.append((line, doc, isinstance(node, ast.Module)))
    return out


def _paragraph_starts(text: str) -> set[int]:
    """Character offsets in ``text`` where a paragraph (after a blank line, or the text's start) begins."""
    starts = {len(text) - len(text.lstrip())}
    for match in re.finditer(r"\n[ \t]*\n[ \t]*(?=\S)", text):
        starts.add(match.end())
    return starts


def _heading_starts(text: str) -> set[int]:
    return {m.start(1) for m in re.finditer(r"^#+[ \t]+(\S)", text, flags=re.MULTILINE)}


_Found = list[tuple[str, str]]  # (note name, where it occurs)


def _notes_in(text: str, where: str, definition_starts: set[int]) -> tuple[_Found, _Found]:
    definitions, citations = [], []
    for match in NOTE.finditer(text):
        if match.group(1).strip() in EXAMPLE_NOTES:
            continue
        entry = (match.group(1).strip(), where)
        (definitions if match.start() in definition_starts else citations).append(entry)
    return definitions, citations


def _collect_notes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    defined: dict[str, list[str]] = defaultdict(list)
    cited: dict[str, list[str]] = defaultdict(list)

    def add(found: tuple[_Found, _Found]) -> None:
        for name, where in found[0]:
            defined[name].append(where)
        for name, where in found[1]:
            cited[name].append(where)

    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        docs = _docstrings(path)
        module_doc = next((d for _, d, is_module in docs if is_module), None)
        if module_doc is not None:
            add(_notes_in(module_doc, rel, _paragraph_starts(module_doc)))
        # Everything outside the module docstring (code comments, other docstrings) only cites.
        rest = source.replace(module_doc, "", 1) if module_doc is not None else source
        add(_notes_in(rest, rel, set()))
    for path in _markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        starts = _heading_starts(text) if rel.startswith("docs/") else set()
        if path.parent == ROOT / "docs" / "design":
            starts |= _paragraph_starts(text)
        add(_notes_in(text, rel, starts))
    return defined, cited


DEFINED, CITED = _collect_notes()


def test_notes_exist() -> None:
    assert len(DEFINED) >= 10 and len(CITED) >= 10  # the collector found the tree's notes


def test_every_note_is_defined_once() -> None:
    twice = {name: where for name, where in DEFINED.items() if len(where) > 1}
    assert not twice, f"notes defined more than once (keep one definition, cite it elsewhere): {twice}"


def test_every_cited_note_is_defined() -> None:
    undefined = {name: sorted(set(where)) for name, where in CITED.items() if name not in DEFINED}
    assert not undefined, f"cited but never defined: {undefined}"


def test_every_defined_note_is_cited() -> None:
    unused = {name: where for name, where in DEFINED.items() if name not in CITED}
    assert not unused, f"defined but never cited where it is relied on: {unused}"


def _cited_paths(text: str) -> list[str]:
    found = []
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        end = match.end()
        after = text[end : end + 2]
        placeholder_after = PLACEHOLDER.match(after[:1]) or (after[:1] == "." and PLACEHOLDER.match(after[1:]))
        if placeholder_after or PLACEHOLDER.search(path):
            continue  # a pattern (``benchmarks/results/*.jsonl``, ``<path>``), not a path
        found.append(path)
    return found


def _path_citations() -> list[tuple[str, str]]:
    cites = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, doc, _ in _docstrings(path):
            cites.extend((f"{rel}:{line}", cited) for cited in _cited_paths(doc))
    for path in _markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            cites.extend((f"{rel}:{number}", cited) for cited in _cited_paths(line))
    return cites


def _exists(cited: str) -> bool:
    if cited.rstrip("/") in BUILD_PATHS or (ROOT / cited).exists():
        return True
    module = cited.split(".", 1)[0]  # ``tests/_harness.run_distributed``: a name in ``tests/_harness.py``
    return (ROOT / f"{module}.py").exists()


def test_cited_paths_exist() -> None:
    missing = [f"{where}: {cited}" for where, cited in _path_citations() if not _exists(cited)]
    assert not missing, "paths cited in docstrings or docs that are not in the repository:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "see `docs/design/streams.md` and deepspeed/_core/comm/streams.py.",
            ["docs/design/streams.md", "deepspeed/_core/comm/streams.py"],
        ),
        ("files under benchmarks/results/*.jsonl or `<path>_rank<r>.json`", []),
        ("the upstream deepspeed/runtime/zero/stage3.py", ["deepspeed/runtime/zero/stage3.py"]),
        ("import deepspeed.comm", []),
    ],
)
def test_path_pattern(text: str, expected: list[str]) -> None:
    assert _cited_paths(text) == expected


def test_definition_rules() -> None:
    doc = "Title.\n\n[Note: a] defined here.\n\nCites [Note: b] and\n[Note: c] mid-paragraph.\n"
    defined, cited = _notes_in(doc, "m.py", _paragraph_starts(doc))
    assert [n for n, _ in defined] == ["a"] and [n for n, _ in cited] == ["b", "c"]
    md = "## [Note: d] Heading\n\ntext [Note: e]\n"
    defined, cited = _notes_in(md, "x.md", _heading_starts(md) | _paragraph_starts(md))
    assert [n for n, _ in defined] == ["d"] and [n for n, _ in cited] == ["e"]
