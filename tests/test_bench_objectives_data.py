"""bench/llm_objectives.py gives every row the same number of tokens: each prompt and completion it writes is
exactly the workload's length under the model's tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import llm_objectives  # noqa: E402


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_written_texts_have_the_workload_s_token_counts(tmp_path, objective):
    from transformers import AutoTokenizer

    from toolkit.tiny import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny:llm"))
    w = dict(batch=2, prompt=13, completion=29, generations=1)
    path = tmp_path / "data.jsonl"
    llm_objectives.write_data(path, objective, w, 5, tokenizer)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert len(records) == 5
    assert [count(r["prompt"]) for r in records] == [13] * 5
    if objective == "dpo":
        assert [count(r["chosen"]) for r in records] == [29] * 5
        assert [count(r["rejected"]) for r in records] == [29] * 5
        assert all(r["chosen"] != r["rejected"] for r in records)
    else:
        assert all(set(r) == {"prompt"} for r in records)
    assert llm_objectives.units(objective, w) == ((4, 42, "sequences") if objective == "dpo" else (2, 29, "completions"))


def test_bench_llm_hands_an_objective_to_the_objectives_bench(tmp_path):
    """`bench/llm.py --objective grpo` is bench/llm_objectives.py with the same arguments (issue 43 asked for the
    rows under bench/llm.py): the CPU check's toolkit row runs and its JSON says the objective."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "grpo.json"
    done = subprocess.run([sys.executable, str(repo / "bench" / "llm.py"), "--objective", "grpo", "--tiny",
                           "--rows", "toolkit", "--steps", "1", "--warmup", "1", "--out", str(out)],
                          cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["objective"] == "grpo" and result["rows"]["toolkit"]["completions_per_s"] > 0
    assert "completions/s" in done.stdout
