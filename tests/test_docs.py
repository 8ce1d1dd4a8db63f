"""The README and docs/ as a user meets them: every command in their shell blocks runs as written (as a
dry run), every relative link leads to a file (and, with #anchor, to a heading of it), and every
`python -m fedtune...` they name is a module that runs with -m."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .workflow_harness import ROOT, VENV_BIN

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# How a command of the docs starts; a line may carry a prompt naming its host (`leonardo$ snakemake ...`).
COMMAND = re.compile(r"^(?:[\w.-]+\$ )?((?:snakemake|python -m fedtune|scripts/|make)\b.*)$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}

# What cannot run here, with the reason: a command is skipped when it contains the key.
CANNOT_RUN_HERE = {
    "scripts/setup-env": "installs packages into .venv; the suite's own set-up runs it (make test)",
    "--report": "reads a finished run's outputs; tests/test_demo.py makes the demo's report",
}


def shell_blocks(path: Path) -> list[list[str]]:
    """The fenced shell blocks of a Markdown file (indented ones in lists too), as lists of lines."""
    blocks, block, indent = [], None, ""
    for line in path.read_text(encoding="utf-8").splitlines():
        fence = FENCE.match(line)
        if block is None and fence:
            block, indent = ([] if fence["lang"] in SHELL_LANGUAGES else None), fence["indent"]
            if block is None:
                block = False  # a fence of another language: skip to its end
            continue
        if block is not None and line.strip() == "```":
            if block:
                blocks.append(block)
            block = None
            continue
        if block:
            block.append(line[len(indent) :] if line.startswith(indent) else line)
        elif block == []:
            block.append(line[len(indent) :] if line.startswith(indent) else line)
    return blocks


def commands(path: Path) -> list[list[str]]:
    """The commands of each shell block, in order (a block's later commands may read what earlier ones
    wrote, as the twin's do)."""
    found = []
    for block in shell_blocks(path):
        lines = [m.group(1).strip() for line in block if (m := COMMAND.match(line.strip()))]
        if lines:
            found.append(lines)
    return found


def dry_form(command: str) -> str | None:
    """The command as the test runs it: a Snakemake dry run, make's dry run, a module's --help, a script's
    dry form; None when it cannot run here (CANNOT_RUN_HERE)."""
    if any(key in command for key in CANNOT_RUN_HERE):
        return None
    if command.startswith("snakemake"):
        words = shlex.split(command, comments=True)
        return command if {"-n", "--dry-run"} & set(words) else "snakemake -n" + command[len("snakemake") :]
    if command.startswith("make"):
        return "make -n" + command[len("make") :]
    if command.startswith("python -m"):
        module = command.split()[2]
        return f"python -m {module} --help"
    if command.startswith("scripts/rehearse"):
        return command.split("#")[0].strip() + " --dry-run"
    return command


def all_commands() -> list[tuple[str, list[str]]]:
    return [
        (f"{path.relative_to(ROOT)}#{k}", block) for path in DOCS for k, block in enumerate(commands(path))
    ]


def test_the_commands_are_found():
    """The extraction sees the README's two commands, its cluster commands behind a prompt, and a
    snakemake line of docs/."""
    found = [c for _, block in all_commands() for c in block]
    assert "make demo" in " ".join(found) and "make test" in " ".join(found)
    assert any(c.startswith("snakemake --profile profiles/leonardo") for c in found), found
    assert (
        dry_form("snakemake --profile profiles/local results/x")
        == "snakemake -n --profile profiles/local results/x"
    )
    assert dry_form("scripts/setup-env && source .venv/bin/activate") is None
    # Every entry of the allow-list skips a command the docs hold (a stale entry would hide nothing).
    for key in CANNOT_RUN_HERE:
        assert any(key in c for c in found), key


def workspace(tmp_path: Path) -> Path:
    """A working directory that holds the checkout's files (linked) but none of its run outputs, so the
    commands write their results/, dag.dot and .snakemake/ here."""
    for entry in ROOT.iterdir():
        if entry.name not in {"results", ".snakemake", ".git", ".pytest_cache"}:
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def run_block(workdir: Path, block: list[str]) -> list[tuple[str, int, str]]:
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", PYTHONPATH=str(ROOT),
               FEDTUNE_ACCOUNT="proj123", HF_HUB_OFFLINE="1")  # fmt: skip
    results = []
    for command in block:
        form = dry_form(command)
        if form is None:
            continue
        done = subprocess.run(["bash", "-c", form], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        results.append((form, done.returncode, (done.stdout + done.stderr)[-3000:]))
    return results


def test_every_command_of_the_readme_and_docs_runs_as_written(tmp_path):
    """Each command runs in a workspace of its own, side by side with the others, but a block whose later
    commands read what an earlier one wrote (a script's output: the twin) runs in order in one workspace,
    as a user would paste it. The same command in two blocks runs once."""
    units, seen = [], set()
    for name, block in all_commands():
        fresh = [c for c in block if c not in seen]
        seen.update(block)
        if any(c.startswith("scripts/") for c in fresh[:-1]):
            units.append((name, fresh))
        else:
            units.extend((name, [c]) for c in fresh)
    workdirs = []
    for k in range(len(units)):
        (tmp_path / str(k)).mkdir()
        workdirs.append(workspace(tmp_path / str(k)))
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(run_block, workdirs, [unit for _, unit in units]))
    failed = [(name, form, rc, out) for (name, _), runs in zip(units, outcomes, strict=True)
              for form, rc, out in runs if rc != 0]  # fmt: skip
    assert not failed, "\n\n".join(f"{name}: `{form}` exited {rc}:\n{out}" for name, form, rc, out in failed)
    assert sum(len(runs) for runs in outcomes) >= 10


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, counts, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} +(.*?)\s*#*$", line)):
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    text = re.sub(r"^ *```.*?^ *```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_fedtune_module_the_docs_name_runs_with_python_m():
    names = sorted({m for doc in DOCS for m in re.findall(r"python -m (fedtune(?:\.\w+)+)", doc.read_text())})
    assert "fedtune.report.status" in names and len(names) >= 8, names
    missing = []
    for name in names:
        importlib.import_module(name)
        spec = importlib.util.find_spec(name)
        if (
            spec.submodule_search_locations is not None
            and importlib.util.find_spec(f"{name}.__main__") is None
        ):
            missing.append(f"{name}: a package without __main__")
    assert not missing, missing
    assert sys.modules[names[0]]
