"""The documentation site (``mkdocs.yml`` over ``docs/``) builds with ``mkdocs build --strict``,
and the strict build fails on a broken link: the same check ``make docs`` runs in ``.ci/run``."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _build(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(root / "mkdocs.yml"), "-d", str(site)],
                          cwd=root, capture_output=True, text=True, env=env, timeout=300)


def test_docs_site_builds_strict(tmp_path):
    out = _build(ROOT, tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link(tmp_path):
    """A copy of the site whose home page links to a page that does not exist: the build fails
    naming the link, so a link broken by a moved page fails CI."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the old page](no-such-page.md).\n")
    out = _build(tmp_path, tmp_path / "site")
    assert out.returncode != 0
    assert "no-such-page.md" in out.stdout + out.stderr


def _module_table(text: str) -> str:
    start = text.index("| piece | module |")
    end = text.find("\n\n", start)
    return text[start: end if end >= 0 else None].rstrip("\n")


def test_architecture_page_module_table_is_the_readmes():
    """The site's architecture page carries the README's module table unchanged (the structure
    test checks the README's against the tree), so the two cannot drift apart."""
    readme = (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert _module_table(page) == _module_table(readme)
