"""The repository's own promises: the README's commands are the ones CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    test_line = next(c for c in _readme_commands() if "pytest" in c)
    assert test_line in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readme_test_command_installs_the_cpu_torch_before_the_test_extras():
    """Issue 18: followed literally, `pip install -e ".[test]"` pulled PyTorch's CUDA build (about 15 nvidia-*
    packages). The line pins the release whose CPU build this project's machines hold, before the extras."""
    test_line = next(c for c in _readme_commands() if "pytest" in c)
    torch_at, extras_at = test_line.find("pip install torch=="), test_line.find('pip install -e ".[test]"')
    assert 0 <= torch_at < extras_at, test_line
