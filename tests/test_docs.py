"""The docs a user follows: no link, `docs/...` path or repository file named in README.md or
docs/*.md that the repository does not have, no anchor without its heading, and the ATen list of
docs/FRONTEND.md equal to what the frontend maps."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path into the repository: a top-level folder of ours, then a file with a known suffix
PATH = re.compile(
    r"(?<![\w./-])((?:docs|benchmarks|tests|examples|scripts|disco_ray|planner|actors|workloads|shared)/"
    r"[\w./-]*\w\.(?:py|md|json|sh|png|yaml|msgpack))\b"
)
BARE_MD = re.compile(r"(?<![\w./(-])([\w-]+\.md)\b")  # "FORMATS.md": here, in docs/ or at the top


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", doc.read_text(), re.M)}


def broken(doc: Path) -> list[str]:
    text = doc.read_text()
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{doc.name}: link {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{doc.name}: link {target}: no such heading")
    for path in PATH.findall(text):
        if "MODE" not in path and not (ROOT / path).exists():
            bad.append(f"{doc.name}: path {path}")
    for name in BARE_MD.findall(text):
        if not any((d / name).exists() for d in (doc.parent, ROOT / "docs", ROOT)):
            bad.append(f"{doc.name}: file {name}")
    return bad


def test_every_link_and_path_in_the_docs_exists():
    bad = [b for doc in DOCS for b in broken(doc)]
    assert not bad, "\n".join(bad)


def test_the_check_finds_a_missing_file_a_missing_heading_and_a_bare_path(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Top\n[ok](a.md#top) [gone](b.md) [x](a.md#nowhere) see docs/NOPE.md, shared/GPU.md, C.md\n"
    )
    assert broken(tmp_path / "a.md") == [
        "a.md: link b.md",
        "a.md: link a.md#nowhere: no such heading",
        "a.md: path docs/NOPE.md",
        "a.md: path shared/GPU.md",
        "a.md: file C.md",
    ]


def test_the_frontend_doc_lists_exactly_the_aten_ops_it_maps():
    from disco_ray.frontend import aten

    text = (ROOT / "docs" / "FRONTEND.md").read_text()
    block = text.split("tests/test_docs.py -->", 1)[1].strip().split("\n\n")[0]
    assert sorted(re.findall(r"`(\w+)`", block)) == aten.supported()


def test_the_readme_is_a_door_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, (
        f"README.md has {lines} lines: move design notes to docs/, figures to docs/BENCHMARKS.md"
    )


def test_every_measured_table_says_its_date_machine_command_and_commit():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    bad = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        if "| --- |" not in section:
            continue
        head = section.split("\n| ", 1)[0]  # what precedes the section's first table
        name = section.splitlines()[0]
        for what, pattern in (
            ("date", r"Date \d{4}-\d{2}-\d{2}"),
            ("machine", r"CPU, 2-core box|16-core GPU host|H100"),
            (
                "command",
                r"`(?:[A-Z_]+=\S+ )*(?:PYTHONPATH=\. )?(?:\.venv/bin/)?(?:python3?|disco-ray) [^`]+`",
            ),
            ("commit", r"commit\s+(?:before\s+)?[0-9a-f]{7}"),
        ):
            if not re.search(pattern, head):
                bad.append(f"{name}: no {what} before its table")
    assert not bad, "\n".join(bad)
