"""save.format=gguf (llm): the llama.cpp adapter read back with gguf's own GGUFReader and checked against the PEFT
file of the same run: llama.cpp's tensor names and metadata, shapes, and values (q/k rows in llama.cpp's rotary
order, as its convert_lora_to_gguf.py writes them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import REPO  # noqa: E402
from toolkit.cli import main  # noqa: E402
from toolkit.tiny import resolve_model_path  # noqa: E402

# llama.cpp's names of a Llama block's projections (its gguf-py tensor_mapping.py / llama-arch.cpp)
LLAMA_CPP_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}


def train_gguf(monkeypatch, out: Path, *overrides: str) -> int:
    monkeypatch.chdir(REPO)
    return main(["train", "configs/examples/quickstart_llm_chat.yaml", f"run.output_dir={out}", "run.name=tiny",
                 "train.steps=2", "save.every=0", "sample.prompts=[]", "train.eval_every=0", "network.rank=8",
                 "network.alpha=16", "save.format=gguf", *overrides])


def llama_cpp_name(peft_key: str) -> str:
    """base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight -> blk.1.attn_q.weight.lora_a"""
    module, _, factor = peft_key.removeprefix("base_model.model.model.layers.").rpartition(".lora_")
    block, _, projection = module.partition(".")
    return f"blk.{block}.{LLAMA_CPP_NAMES[projection]}.weight.lora_{factor[0].lower()}"


def rotary_rows(b: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows as llama.cpp orders them: the first and second rotary halves interleaved."""
    head_dim = b.shape[0] // heads
    halves = b.reshape(heads, 2, head_dim // 2, -1)
    return torch.stack([halves[:, 0], halves[:, 1]], dim=2).reshape(b.shape)


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists a tensor's shape innermost first (ggml's ne); numpy's order is the reverse
        assert list(values.shape) == [int(n) for n in reversed(t.shape)]
        tensors[t.name] = torch.from_numpy(values.astype("float32").copy())
    return fields, tensors


@pytest.mark.parametrize("dtype, rslora", [("fp32", False), ("bf16", True)])
def test_gguf_adapter_holds_the_peft_factors_under_llama_cpp_names(tmp_path, monkeypatch, tiny_cache, dtype, rslora):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    out = tmp_path / "run"
    assert train_gguf(monkeypatch, out, f"save.dtype={dtype}", f"network.rslora={rslora}") == 0
    final = out / "final"
    assert (final / "tiny.gguf").is_file() and (final / "adapter_model.safetensors").is_file()
    fields, tensors = read_gguf(final / "tiny.gguf")
    peft = load_file(str(final / "adapter_model.safetensors"))
    config = AutoConfig.from_pretrained(resolve_model_path("tiny:llm"))

    # the metadata llama.cpp's llama_adapter_lora_init checks, and what the converter writes besides
    scale = 16 / 8 ** 0.5 if rslora else 16 / 8   # PEFT's scaling; llama.cpp applies alpha / rank
    assert fields["general.architecture"] == "llama"
    assert fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora"
    assert fields["adapter.lora.alpha"] == pytest.approx(scale * 8, rel=1e-6)
    assert fields["general.file_type"] == {"fp32": 0, "bf16": 32}[dtype]
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(final / "tiny.gguf")).tensors} == {
        {"fp32": "F32", "bf16": "BF16"}[dtype]}

    # every PEFT tensor under its llama.cpp name, nothing else, 2 layers x 7 projections x (A, B)
    assert set(tensors) == {llama_cpp_name(k) for k in peft}
    assert len(tensors) == 2 * 7 * 2
    for key, value in peft.items():
        ours = tensors[llama_cpp_name(key)]
        expected = value.float()
        if ".lora_B." in key and "q_proj" in key:
            expected = rotary_rows(expected, config.num_attention_heads)
        elif ".lora_B." in key and "k_proj" in key:
            expected = rotary_rows(expected, config.num_key_value_heads)
        assert ours.shape == expected.shape
        assert torch.equal(ours, expected.to(torch.bfloat16).float() if dtype == "bf16" else expected), key
    # the permutation is real: a q_proj lora_b differs from PEFT's row order
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert not torch.equal(tensors[llama_cpp_name(q_b)], peft[q_b].float())
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 8


def test_gguf_without_the_package_is_a_user_error_before_training(tmp_path, monkeypatch, capsys, tiny_cache):
    monkeypatch.setitem(sys.modules, "gguf", None)   # import gguf then raises ImportError
    assert train_gguf(monkeypatch, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "'save.format': save.format=gguf needs the gguf package" in err and ": pip install gguf" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "final").exists()


def test_qwen2_keeps_peft_row_order_and_an_unmapped_architecture_is_named():
    """Qwen2 is written without the llama permutation (convert_hf_to_gguf's Qwen2Model has none); a module at
    another scale than the file's alpha has the ratio folded into its lora_b; an architecture without a mapping
    is a UserError naming the supported ones."""
    from transformers import MixtralConfig, Qwen2Config

    from toolkit.errors import UserError
    from toolkit.models.llm_gguf import gguf_arch, gguf_tensors
    from toolkit.models.lora_export import Factor

    config = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                         intermediate_size=64, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    q = Factor(torch.randn(4, 32), torch.randn(32, 4), alpha=8.0)
    down = Factor(torch.randn(4, 64), torch.randn(32, 4), alpha=2.0)   # scale 0.5 against the file's 2.0
    alpha, tensors = gguf_tensors({"base_model.model.model.layers.2.self_attn.q_proj": q,
                                   "base_model.model.model.layers.0.mlp.down_proj": down}, config, gguf_arch(config))
    assert alpha == 2.0   # the first module in name order (layers.0 down_proj)
    assert sorted(tensors) == ["blk.0.ffn_down.weight.lora_a", "blk.0.ffn_down.weight.lora_b",
                               "blk.2.attn_q.weight.lora_a", "blk.2.attn_q.weight.lora_b"]
    assert torch.equal(tensors["blk.2.attn_q.weight.lora_a"], q.down)
    torch.testing.assert_close(tensors["blk.2.attn_q.weight.lora_b"], q.up * 4.0)   # 8/4 trained, 2/4 written
    assert torch.equal(tensors["blk.0.ffn_down.weight.lora_b"], down.up)
    with pytest.raises(UserError, match="MixtralForCausalLM.*supported: LlamaForCausalLM"):
        gguf_arch(MixtralConfig(architectures=["MixtralForCausalLM"]))
