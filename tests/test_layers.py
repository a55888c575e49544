"""The layering of docs/design.md holds: `lint-imports` keeps the contracts in
pyproject.toml, and an import that climbs back up (a model importing the command line)
breaks them."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(source_root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the package found under `source_root`, with the repo's
    contracts, in a fresh process (grimp caches nothing between calls there)."""
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
         "lint_imports_command()", "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=source_root, env={"PYTHONPATH": str(source_root), "PATH": ""},
        capture_output=True, text=True,
    )  # fmt: skip


def test_the_package_keeps_its_layers():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_an_import_that_climbs_back_up_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "shardemu", tmp_path / "shardemu",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    gpt = tmp_path / "shardemu" / "models" / "gpt.py"
    gpt.write_text(gpt.read_text() + "\nfrom shardemu.cli import main  # noqa\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0
    assert "shardemu.models.gpt -> shardemu.cli" in done.stdout, done.stdout
