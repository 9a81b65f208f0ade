"""The README and docs/ as a newcomer meets them: the README is short, its commands run as written from a fresh
checkout, every relative link (and #anchor) resolves, and nothing points outside the repository."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def prose(text: str) -> str:
    """Markdown without fenced code blocks or inline code (a `# comment` in bash is no heading, `[x](y)` in code
    no link)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (no markup), lower case, every character that is not a
    letter, digit, space, hyphen or underscore dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_github_slugs():
    assert slug("Batched decoding (several requests in flight)") == "batched-decoding-several-requests-in-flight"
    assert slug("`recap compare`") == "recap-compare"
    assert slug("Static shapes for CUDA graphs") == "static-shapes-for-cuda-graphs"
    assert slug("mean× and p10 — speed") == "mean-and-p10--speed"
    assert slug("Demo_caption: [the set](x.md)") == "demo_caption-the-set"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{doc.name}: {target} -> {path} does not exist"
        if anchor:
            assert path.suffix == ".md" and anchor in anchors(path), f"{doc.name}: no heading for {target}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_nothing_points_outside_the_repository(doc):
    text = doc.read_text()
    for outside in (r"DESIGN\.md", r"shared/", r"\bissues? \d+", r"\bissue #\d+", r"the paper's",
                    r"machines? this project is built on"):
        assert not re.search(outside, text, re.I), f"{doc.name} mentions {outside!r}"


# --- the README's commands ---------------------------------------------------------------------------------------

def commands(doc: Path) -> list[list[str]]:
    """The commands of each ```bash block, continuation lines joined: one list per block."""
    blocks = re.findall(r"^```bash\n(.*?)^```", doc.read_text(), re.M | re.S)
    return [[c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()] for block in blocks]


# What a test cannot do in seconds or offline: install, download, use a hub model, start Ray, compare methods over
# every bench set (minutes on 2 cores), or run the whole suite.
SKIP = re.compile(r"^(pip|hf|python -m pytest)\b|--model (?!demo\b)|--ray\b|recap compare\b")


def words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def test_readme_commands_name_files_that_exist_and_create_their_folders():
    blocks = commands(README)
    assert blocks
    for block in blocks:
        made: set[str] = set()
        for command in block:
            for part in command.split("|"):
                argv = words(part)
                if argv[:2] == ["mkdir", "-p"]:
                    made.update(argv[2:])
                for word in argv:
                    if word.startswith(("sample_inputs/", "benchmarks/", "docs/")):
                        found = glob.glob(word, root_dir=ROOT)
                        assert found, f"README: {command!r} names {word}, which is not in the repository"
                        assert not any("/truth/" in f or f.endswith(".truth.jsonl") for f in found if "*" in word)
                    if word.startswith("runs/"):  # not in a fresh checkout: the block must make it first
                        assert "runs" in made, f"README: {command!r} uses runs/ without `mkdir -p runs` before it"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A fresh checkout as far as the README's commands see it: the sample inputs, and `recap` on the PATH running
    this tree."""
    home = tmp_path_factory.mktemp("checkout")
    shutil.copytree(ROOT / "sample_inputs", home / "sample_inputs")
    bin_dir = home / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "recap"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m recap_cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    return home, env


def short_commands() -> list[str]:
    return [c for block in commands(README) for c in block if c.split()[0] in ("recap", "head", "cat")
            and not SKIP.search(c)]


def test_the_readme_shows_its_short_commands():
    got = [re.sub(r"\s+#.*$", "", c) for c in short_commands()]  # without their comments
    assert "recap run sample_inputs/requests.jsonl" in got  # the quick start
    assert "recap models" in got and any(c.startswith("head -n 3 sample_inputs/requests.jsonl | recap run -")
                                         for c in got)


@pytest.mark.parametrize("command", short_commands())
def test_a_readme_command_runs_as_written(checkout, command):
    """As written, run from a fresh checkout; `recap run` answers capped at 24 new tokens to keep this cheap."""
    home, env = checkout
    run = command if "recap run" not in command or "--max-new-tokens" in command else \
        re.sub(r"(recap run [^#|]*?)(\s*(#.*)?)$", r"\1 --max-new-tokens 24\2", command)
    done = subprocess.run(["bash", "-o", "pipefail", "-c", run], cwd=home, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{command!r} exited {done.returncode}: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr
    if "recap run" in command and " -o " not in command:
        records = [orjson.loads(line) for line in done.stdout.splitlines()]
        assert records and all(r["error"] is None for r in records)
