"""The package's floors (pyproject.toml's import-linter contract) hold, and the lower floors import light."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contract_holds():
    out = _run("import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))")
    assert out.returncode == 0, out.stdout + out.stderr


def test_kernels_import_without_the_floors_above():
    out = _run("import sys, eqxdiff.kernels; print(' '.join(sorted(m for m in sys.modules "
               "if m.startswith(('eqxdiff.loading', 'eqxdiff.models', 'eqxdiff.parallel', 'eqxdiff.pipelines')))))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import eqxdiff.kernels pulled in: {out.stdout}"


def test_every_family_module_is_in_the_independence_contract():
    """The families-never-import-each-other contract lists every family pipeline module (the public modules of
    ``eqxdiff.pipelines``; shared ones are ``_private``), so a new family's file is checked from its first commit."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    independence = [c for c in contracts if c["type"] == "independence"]
    assert len(independence) == 1, [c["name"] for c in contracts]
    families = {f"eqxdiff.pipelines.{p.stem}" for p in (ROOT / "eqxdiff" / "pipelines").glob("*.py")
                if not p.stem.startswith("_")}
    assert families and set(independence[0]["modules"]) == families
