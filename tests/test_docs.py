"""The documentation a clone can follow: every section of the K3 specification that the code
cites ("spec §N", or a bare "§N") has a heading in docs/model.md, every "DESIGN §N" one
in docs/design.md, and every relative link in README.md and docs/ resolves to a file of the
repository (nothing outside it, such as the ../shared/ folder of the machines the project was
written on)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CODE_SUFFIXES = {".py", ".cu", ".cuh", ".h", ".cpp", ".cc", ".sh", ".md", ".txt", ".inc"}
# "DESIGN §N" cites the design notes, not the model specification.
CITATION = re.compile(r"(?<!DESIGN )§\s?(\d+(?:\.\d+)*)")
DESIGN_CITATION = re.compile(r"DESIGN §\s?(\d+)(?:-(\d+))?")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def repo_files() -> list[Path]:
    """Tracked and not-ignored untracked files (what a clone of the working tree holds)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def cited_sections(pattern=CITATION) -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    for path in repo_files():
        if path.suffix not in CODE_SUFFIXES or DOCS in path.parents or path == Path(__file__):
            continue
        for match in pattern.finditer(path.read_text(errors="replace")):
            first, last = match.group(1), match.group(2) if pattern.groups > 1 else None
            numbers = [str(n) for n in range(int(first), int(last) + 1)] if last else [first]
            for number in numbers:  # "DESIGN §4-5" cites both
                cited.setdefault(number, set()).add(str(path.relative_to(ROOT)))
    return cited


def test_every_cited_spec_section_has_a_heading_in_docs_model():
    headings = set(HEADING.findall((DOCS / "model.md").read_text()))
    cited = cited_sections()
    assert len(cited) > 30  # the scan finds the code's citations at all
    missing = {n: sorted(files)[:3] for n, files in cited.items() if n not in headings}
    assert not missing, f"sections cited in the code without a heading in docs/model.md: {missing}"


def test_every_cited_design_section_has_a_heading_in_docs_design():
    headings = set(HEADING.findall((DOCS / "design.md").read_text()))
    cited = cited_sections(DESIGN_CITATION)
    assert len(cited) >= 5
    missing = {n: sorted(files)[:3] for n, files in cited.items() if n not in headings}
    assert not missing, f"DESIGN sections cited in the code without a heading in docs/design.md: {missing}"


def test_links_in_readme_and_docs_resolve_inside_the_repository():
    files = set(repo_files())
    checked = 0
    for doc in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = doc.read_text()
        assert "../shared" not in text, f"{doc.name} points outside the repository"
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            assert ROOT in path.parents and (path in files or path.is_dir()), f"{doc.name}: broken link {target}"
            checked += 1
    assert checked >= 5  # README links the docs, the docs link each other


def test_code_comments_do_not_point_outside_the_repository():
    spec_outside = "/".join(("shared", "k3", "ARCHITECTURE.md"))  # spelled so this file does not match
    offenders = [str(p.relative_to(ROOT)) for p in repo_files()
                 if p.suffix in CODE_SUFFIXES and spec_outside in p.read_text(errors="replace")]
    assert not offenders, offenders


def test_docs_architecture_lists_every_folder():
    """docs/architecture.md's table has a row for each package of k3_trtllm and each folder of
    plugins/, so a folder added without a line there fails here."""
    text = (DOCS / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)`", text, re.M))
    packages = {f"k3_trtllm/{p.name}" for p in (ROOT / "k3_trtllm").iterdir() if (p / "__init__.py").is_file()}
    native = {f"plugins/{p.name}" for p in (ROOT / "plugins").iterdir() if p.is_dir()}
    assert packages | native <= rows, sorted((packages | native) - rows)
    assert {"bench", "tests", "build_scripts"} <= rows
