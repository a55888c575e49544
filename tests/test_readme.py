"""The README's promises stay true: its preset table matches the code, and its test
command is the one CI runs."""

import re
from pathlib import Path

from shardemu import PRESETS, Model, param_count

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_preset_table_matches_the_models():
    rows = re.findall(
        r"^\| `([\w.-]+)` \| (\d+) \| (\d+) \| (\d+) \| .* \| ([\d,]+) \|$", README, re.M
    )
    assert {name for name, *_ in rows} == set(PRESETS)
    for name, layers, width, heads, count in rows:
        cfg = PRESETS[name]
        assert (cfg.num_layers, cfg.embed_dim, cfg.num_heads) == (
            int(layers),
            int(width),
            int(heads),
        )
        assert param_count(Model(cfg).abstract_params()[0]) == int(count.replace(",", "")), name


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^TEST_COMMAND='(.*)'$", ci, re.M).group(1)
    assert f"```bash\n{command}\n```" in README
