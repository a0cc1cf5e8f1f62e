"""The docs name only what exists, and every folder the runtime writes is declared in one place."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from llama_base import paths

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCES = [p for p in REPO.rglob("*.py") if not ({".venv", ".git", "tests"} & set(p.relative_to(REPO).parts))]


def _code(text: str) -> str:
    """The fenced blocks and inline code spans of a markdown text: where commands are written."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", prose))


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (REPO / "Makefile").read_text(), flags=re.M))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_target_the_docs_name_exists(doc):
    named = set(re.findall(r"\bmake ([a-z][a-z0-9-]*)", _code(doc.read_text())))
    assert named, f"{doc.name} names no make target: the pattern no longer matches how the docs write them"
    assert named <= _make_targets(), f"{doc.name} names missing targets: {sorted(named - _make_targets())}"


def _runnable(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    return spec.submodule_search_locations is None or importlib.util.find_spec(f"{module}.__main__") is not None


def test_every_python_module_the_docs_and_makefile_run_exists():
    texts = [_code(d.read_text()) for d in DOCS] + [(REPO / "Makefile").read_text()]
    named = {m for t in texts for m in re.findall(r"(?:python3?|\$\(PY\)) -m ([A-Za-z_][\w.]*)", t)}
    named -= {"venv", "pip", "pytest"}        # the interpreter's and the test runner's own
    assert {"verify", "verify.mlir", "bench", "llama_runtime.cli.compile"} <= named
    assert not [m for m in sorted(named) if not _runnable(m)]


def test_the_checks_recognise_a_missing_target_and_module():
    assert "no-such-target" not in _make_targets() and "test" in _make_targets()
    assert not _runnable("verify.no_such_module") and not _runnable("llama_base")   # a package without __main__


def test_every_cache_folder_is_asked_for_by_its_declared_name():
    """Code outside `paths` never composes a folder from the cache root by hand: it asks
    `cache_dir` (or a helper over it, which `paths` defines), and every name asked for is one of
    `paths.CACHE_FOLDERS`."""
    by_hand, named = [], set()
    for p in SOURCES:
        text = p.read_text()
        if p.name != "paths.py" and re.search(r"\bcache_root\(\)\s*/", text):
            by_hand.append(str(p.relative_to(REPO)))
        named |= set(re.findall(r"cache_dir\([\"']([^\"']+)[\"']\)", text))
    assert not by_hand
    assert {"models", "host_kernels", "bench"} <= named <= set(paths.CACHE_FOLDERS)


def test_an_undeclared_cache_folder_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.ENV_CACHE, str(tmp_path))
    assert paths.cache_dir("kernels") == tmp_path / "kernels" == paths.kernels_dir()
    with pytest.raises(KeyError, match="not a declared cache folder"):
        paths.cache_dir("scratch")


def test_the_readme_lists_every_folder_the_runtime_writes():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## What the runtime guarantees"):]
    for name in [*paths.CACHE_FOLDERS, "reports"]:
        assert f"{name}/`" in section, name
    for env in (paths.ENV_CACHE, paths.ENV_REPORTS, "HF_HOME"):
        assert env in section, env


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken
