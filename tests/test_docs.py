"""The docs as reference: the README's example runs, design.md's printed schedule is what the
code prints, both stay within their caps, every link between the repository's docs resolves
inside it, and every repository path they name exists."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def run_block(code: str, where: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(where), "exec"), {})
    return out.getvalue()


def test_design_prints_the_schedule_the_code_builds():
    text = DESIGN.read_text()
    (code,) = blocks(text, "python")
    (printed,) = blocks(text, "text")
    assert run_block(code, DESIGN) == printed


def test_design_stays_within_its_word_cap():
    assert len(DESIGN.read_text().split()) <= 3000


def test_readme_plans_on_its_first_screen_and_stays_short():
    text = README.read_text()
    first_screen = "\n".join(text.splitlines()[:40])
    assert "logaddexp(lse_a, lse_b)" in first_screen and "treeattn.plan(" in first_screen
    assert "make demo" in text and "make test" in text
    assert len(text.encode()) <= 12 * 1024
    (code,) = blocks(text, "python")
    pick, *_ = run_block(code, README).splitlines()
    assert pick.endswith("µs per layer")


def test_slug_follows_githubs_rule():
    assert slug("The planner's headline (predicted)") == "the-planners-headline-predicted"
    assert slug("4. The algorithms") == "4-the-algorithms"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_docs_resolve_inside_the_repository(doc: Path):
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            assert target.startswith(("https://", "http://")), f"{doc.name}: {target}"
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.is_relative_to(ROOT), f"{doc.name} points outside the repository: {target}"
        assert path.exists(), f"{doc.name}: {target} does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{doc.name}: no heading #{anchor} in {path.name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_path_outside_the_repository(doc: Path):
    text = doc.read_text()
    for outside in ("/work/", "/".join(("..", "shared")), "/tmp/", "/home/"):
        assert outside not in text, f"{doc.name} names {outside}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_the_docs_name_exist(doc: Path):
    named = re.findall(r"`((?:treeattn|tests|benchmarks|docs|notebooks)/[^`\s]*)`",
                       doc.read_text())
    for path in (n.split("::")[0] for n in named if not re.search(r"[{<*]", n)):
        assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"
