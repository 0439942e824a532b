"""A setting that only some objectives read, set for one that does not, is refused before anything loads (it would
be ignored): config/objectives.py's table, checked where the config is merged."""

from __future__ import annotations

import pytest

from conftest import REPO

SFT = REPO / "configs/examples/quickstart_llm.yaml"
DPO = REPO / "configs/examples/quickstart_llm_dpo.yaml"


@pytest.mark.parametrize("config, override, objective, readers", [
    (SFT, "train.beta=0.3", "sft", "dpo, orpo, kto"),
    (SFT, "train.num_generations=8", "sft", "grpo"),
    (DPO, "train.reward=[format]", "dpo", "grpo"),
    (DPO, "train.desirable_weight=2.0", "dpo", "kto"),
])
def test_a_setting_its_objective_does_not_read_is_refused(config, override, objective, readers, run_cli, capsys):
    assert run_cli("validate", config, override) == 2
    err = capsys.readouterr().err
    key = override.split("=")[0]
    assert (f"'{key}' in command line has no effect with train.objective={objective}; remove it, or set "
            f"train.objective to one that reads it: {readers}") in err
    assert "Traceback" not in err


def test_the_objectives_own_settings_and_defaults_pass(run_cli, capsys):
    assert run_cli("validate", DPO, "train.beta=0.3", "train.reference_logps=live") == 0
    assert run_cli("validate", SFT, "train.beta=0.1") == 0  # the default: nothing is ignored
    assert run_cli("validate", SFT, "train.objective=kto", "train.desirable_weight=2.0",
                   "data.path=configs/examples/data/quickstart_kto.jsonl") == 0
