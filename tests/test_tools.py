"""The user's tools live in the package (fedtune/tools/), not in the test tree: scripts/twin and
scripts/rehearse run `python -m fedtune.tools.<tool>`, and nothing under scripts/ or benchmarks/
imports a test module, so a checkout without tests/ (or an installed fedtune) keeps them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `import tests...`, `from tests... import`, `python -m tests....`
IMPORTS_TESTS = re.compile(r"^\s*(?:from|import)\s+tests\b|-m\s+tests\.", re.M)


def test_no_script_or_benchmark_imports_the_tests():
    found = []
    for folder in ("scripts", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "results" in path.relative_to(ROOT).parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            found += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in IMPORTS_TESTS.finditer(text)]
    assert not found, "\n".join(found)


def test_the_scripts_run_the_package_tools():
    for script, module in (("twin", "fedtune.tools.twin"), ("rehearse", "fedtune.tools.rehearsal")):
        text = (ROOT / "scripts" / script).read_text()
        assert f'exec python -m {module} "$@"' in text, script
        assert "tests" not in text, script


def test_the_tools_help_names_the_script():
    # The same --help as the scripts always had: prog is the script the user runs.
    for module, prog in (
        ("fedtune.tools.twin", "scripts/twin"),
        ("fedtune.tools.rehearsal", "scripts/rehearse"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT, check=True
        )
        assert result.stdout.startswith(f"usage: {prog} "), result.stdout
