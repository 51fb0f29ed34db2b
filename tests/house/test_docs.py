"""The documentation's links resolve: every relative link in README.md and docs/*.md names an existing
file (and, for a .md file with an #anchor, an existing heading); the README stays a few screens long."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def prose_lines(text: str):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped except '-' and '_', spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Every relative link of a markdown file that does not resolve, as 'file: target (why)'."""
    broken = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^(https?:|mailto:)", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.is_file():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.name}: {target} (no heading #{anchor})")
    return broken


def test_every_relative_link_resolves():
    assert [p for p in PAGES if p.parent.name == "docs"], "no docs/*.md found"
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_few_screens():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move details into docs/"


def test_checker_finds_planted_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# A heading, here\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-heading-here) ![ok](other.md) [web](https://example.com/x.md)\n"
        "[missing](nothing.md) ![missing](nothing.png) [bad anchor](other.md#not-a-heading)\n"
        "`[in code](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: nothing.md (no such file)",
        "page.md: nothing.png (no such file)",
        "page.md: other.md#not-a-heading (no heading #not-a-heading)",
    ]


SCRIPT_COMMAND = re.compile(r"((?:benchmarks|data)/\w+\.py)([^`\n]*)")
LORA_LAB_COMMAND = re.compile(r"lora-lab (inspect|convert|merge|train|sample|plan)\b([^`\n]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def unknown_flags(pages) -> list[str]:
    """`--flags` the pages give a script of benchmarks/ or data/, or a `lora-lab` command, on the same line,
    that the script's source or the command's parser does not have."""
    from lora_lab.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    bad = []
    for page in pages:
        for line in page.read_text(encoding="utf-8").splitlines():
            for m in SCRIPT_COMMAND.finditer(line):
                script = ROOT / m.group(1)
                source = script.read_text(encoding="utf-8") if script.is_file() else ""
                bad += [f"{page.name}: {m.group(1)} {flag}" for flag in FLAG.findall(m.group(2))
                        if f'"{flag}"' not in source and f"'{flag}'" not in source]
            for m in LORA_LAB_COMMAND.finditer(line):
                known = {o for a in commands[m.group(1)]._actions for o in a.option_strings}
                bad += [f"{page.name}: lora-lab {m.group(1)} {flag}" for flag in FLAG.findall(m.group(2))
                        if flag not in known]
    return bad


def test_every_documented_command_flag_exists():
    """measurements.md gave `bench_memory.py --no-optimizers` after that flag had gone (its table moved to
    bench_optim.py): the command failed with 'unrecognized arguments'."""
    assert unknown_flags(PAGES) == []


def test_flag_checker_finds_a_planted_unknown_flag(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`python benchmarks/bench_memory.py --profile --no-such-flag`\n"
                    "`lora-lab merge B O --lora F --strength 2`\n", encoding="utf-8")
    assert unknown_flags([page]) == ["page.md: benchmarks/bench_memory.py --no-such-flag",
                                     "page.md: lora-lab merge --strength"]
