"""The README's config snippets are real: each YAML block validates through the entry point (with a tiny model and
the example data in place of the user's), and every `section.key` it names is a key of the schema."""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```yaml\n(.*?)^```", README, flags=re.S | re.M)
DATA = {"llm": "configs/examples/data/quickstart_chat.jsonl", "wan21": "configs/examples/data/clips",
        "wan22": "configs/examples/data/clips"}
SECTIONS = ("run", "device", "model", "network", "data", "train", "save", "sample", "log")


def test_the_readme_shows_a_config_for_images_and_one_for_chat_data():
    families = [yaml.safe_load(block)["model"]["family"] for block in BLOCKS]
    assert {"sdxl", "llm"} <= set(families) and len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_yaml_block_validates(index, tmp_path, run_cli, capsys):
    block = BLOCKS[index]
    family = yaml.safe_load(block)["model"]["family"]
    config = tmp_path / "readme.yaml"
    config.write_text(block)
    data = DATA.get(family, "configs/examples/data/shapes")
    code = run_cli("validate", config, f"model.name_or_path=tiny:{family}", f"data.path={REPO / data}",
                   f"run.output_dir={tmp_path / 'out'}")
    err = capsys.readouterr().err
    assert code == 0, f"README yaml block {index + 1}:\n{block}\n{err}"
    assert "config OK (1 file, 3 overrides)" in err


def test_every_key_the_readme_names_exists():
    from toolkit.config.families import FAMILY_SPECS
    from toolkit.config.load import iter_schema_fields, schema_for

    keys = {dotted for family in FAMILY_SPECS for dotted, _ in iter_schema_fields(schema_for(family))}
    named = set(re.findall(rf"`((?:{'|'.join(SECTIONS)})\.[a-z0-9_]+)", README))
    assert len(named) > 50
    assert sorted(named - keys) == []
