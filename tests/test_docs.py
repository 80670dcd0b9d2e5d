"""The documentation site builds with `mkdocs build --strict`: every page, link and API symbol resolves."""

import os
import re
import subprocess
import sys

import pytest

import tfmem

pytest.importorskip("mkdocs", reason="building the docs needs the docs extra: "
                    "pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings", reason="pip install -e '.[docs]'")
yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(config_file, site_dir):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
         "--site-dir", str(site_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as `mkdocs build --strict` makes it from the repository."""
    site_dir = tmp_path_factory.mktemp("docs") / "site"
    result = _build(os.path.join(ROOT, "mkdocs.yml"), site_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    return site_dir


def test_reference_has_every_public_name(site):
    reference = (site / "api" / "index.html").read_text()
    missing = [name for name in tfmem.__all__ if f'id="tfmem.{name}"' not in reference]
    assert not missing, f"public names without an entry in docs/api.md: {missing}"
    # Doctests in `Example:` sections render as Python console code, not as quoted text.
    assert '<span class="gp">&gt;&gt;&gt; </span>' in reference
    assert "<blockquote>\n<blockquote>" not in reference


def test_readme_links_resolve(site):
    # The README is not part of the site, so its links are checked here: each relative link
    # names a file of the repository, and a link into docs/ a heading the built page has.
    with open(os.path.join(ROOT, "README.md")) as file:
        readme = file.read()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert any(anchor for _, anchor in links)
    broken = []
    for path, anchor in links:
        if "://" in path:
            continue
        if not os.path.exists(os.path.join(ROOT, path)):
            broken.append(path)
        elif anchor and path.startswith("docs/") and path.endswith(".md"):
            page = path[len("docs/"):-len(".md")]
            html = site / ("" if page == "index" else page) / "index.html"
            if f'id="{anchor}"' not in html.read_text():
                broken.append(f"{path}#{anchor}")
    assert not broken, f"README.md links to what does not exist: {broken}"


@pytest.mark.parametrize("page, complaint", [
    ("See [the planner](no-such-page.md).\n", "no-such-page.md"),
    ("See [the data page](index.md#no-such-heading).\n", "no-such-heading"),
    ("::: tfmem.no_such_name\n", "tfmem.no_such_name"),
])
def test_strict_build_fails_on_a_broken_link_or_a_missing_symbol(tmp_path, page, complaint):
    # The project's own configuration, on a two-page site holding one mistake.
    with open(os.path.join(ROOT, "mkdocs.yml")) as file:
        config = yaml.safe_load(file)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## A heading\n")
    (docs / "page.md").write_text("# Page\n\n" + page)
    handler = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    handler["paths"] = [ROOT]
    handler["options"]["extensions"] = [
        os.path.join(ROOT, extension) for extension in handler["options"]["extensions"]]
    config.update(docs_dir=str(docs), nav=["index.md", "page.md"], exclude_docs="")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert complaint in result.stderr, result.stderr[-4000:]
