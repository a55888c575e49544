"""The README's promises stay true: its preset table matches the code, and its test
command is the one CI runs."""

import re
from pathlib import Path

from shardemu import PRESETS, Model, param_count

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_preset_table_matches_the_models():
    rows = re.findall(
        r"^\| `([\w.-]+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| .* \| ([\d,]+) \|$",
        README,
        re.M,
    )
    assert {name for name, *_ in rows} == set(PRESETS)
    for name, layers, width, heads, kv_heads, count in rows:
        cfg = PRESETS[name]
        assert (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.kv_heads) == (
            int(layers),
            int(width),
            int(heads),
            int(kv_heads),
        )
        assert param_count(Model(cfg).abstract_params()[0]) == int(count.replace(",", "")), name


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^TEST_COMMAND='(.*)'$", ci, re.M).group(1)
    assert f"```bash\n{command}\n```" in README


def test_layout_section_names_every_module():
    """The README's layout lists each package and, under it, every module it holds."""
    block = README[README.index("## Layout") :].split("```")[1]
    entries: dict[str, str] = {}  # "models/" or "config.py" -> its text
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name, _, text = line.strip().partition(" ")
            entries[name] = text
        elif line.startswith("   ") and entries:
            entries[list(entries)[-1]] += " " + line.strip()
    package = ROOT / "shardemu"
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.name == "__main__.py" or (rel.name == "__init__.py" and len(rel.parts) == 1):
            continue
        if len(rel.parts) == 1:
            assert rel.name in entries, f"{rel} is missing from the README's layout"
        else:
            listed = entries.get(f"{rel.parts[0]}/", "")
            if rel.name != "__init__.py":
                assert rel.name in listed, f"{rel} is missing from the README's layout"
    packages = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert packages == {k for k in entries if k.endswith("/")}
