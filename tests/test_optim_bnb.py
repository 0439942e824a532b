"""A bitsandbytes AdamW8bit/Lion8bit run resumes in the toolkit's optimizers (bitsandbytes 8-bit steps on CPU)."""

import pytest
import torch

from helpers import optim_grads, optim_params
from toolkit.errors import UserError
from toolkit.optim import AdamW8bit, Lion8bit, convert_bnb_state_dict
from toolkit.optim.bnb_compat import BNB_NESTED_KEY
from toolkit.optim.quant import dequantize_blockwise

bnb = pytest.importorskip("bitsandbytes")

def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def _flatten(state_dict):
    """The pre-0.49.2 layout: quantization tensors beside "step" instead of nested."""
    flat = {"state": {}, "param_groups": state_dict["param_groups"]}
    for k, s in state_dict["state"].items():
        s = dict(s)
        s.update(s.pop(BNB_NESTED_KEY))
        flat["state"][k] = s
    return flat


@pytest.mark.parametrize("layout", ["nested", "flat"])
@pytest.mark.parametrize("bnb_class,toolkit_class", [(bnb.optim.AdamW8bit, AdamW8bit), (bnb.optim.Lion8bit, Lion8bit)])
def test_bnb_run_resumes_in_toolkit(layout, bnb_class, toolkit_class):
    bnb_params = optim_params()
    theirs = bnb_class(bnb_params, lr=1e-3, weight_decay=0.01)
    for grads in optim_grads(5, seed=1):
        _step(theirs, bnb_params, grads)

    saved = theirs.state_dict()
    assert all(BNB_NESTED_KEY in s for s in saved["state"].values())  # bitsandbytes >= 0.49.2 nests
    saved = _flatten(saved) if layout == "flat" else saved
    converted = convert_bnb_state_dict(saved)
    assert all(set(s) <= {"step", "state1", "state2", "absmax1", "absmax2"} for s in converted["state"].values())

    our_params = [torch.nn.Parameter(p.detach().clone()) for p in bnb_params]
    ours = toolkit_class(our_params, lr=1e-3, weight_decay=0.01)
    ours.load_state_dict(saved)  # detects and converts the bitsandbytes layout itself
    n_moments = 2 if toolkit_class is AdamW8bit else 1
    for p, q in zip(bnb_params, our_params):
        s_bnb, s_ours = theirs.state[p], ours.state[q]
        assert s_ours["step"] == 5
        for i in range(1, n_moments + 1):
            if p.numel() < 4096:
                assert torch.equal(s_ours[f"state{i}"], s_bnb[f"state{i}"])
                continue
            expected = bnb.functional.dequantize_blockwise(s_bnb[f"state{i}"], absmax=s_bnb[f"absmax{i}"],
                                                            code=s_bnb[f"qmap{i}"], blocksize=256)
            assert torch.equal(dequantize_blockwise(s_ours[f"state{i}"], s_ours[f"absmax{i}"], signed=i == 1), expected)

    for grads in optim_grads(10, seed=2):
        _step(theirs, bnb_params, grads)
        _step(ours, our_params, grads)
    # The runs agree up to quantization choices: bitsandbytes' CPU quantizer does not always take the nearest
    # map entry (the toolkit does), so a few codes differ each step. Ten steps move params by about 1e-2.
    for p, q in zip(bnb_params, our_params):
        error = (q - p).abs()
        if p.numel() < 4096:
            torch.testing.assert_close(q, p, atol=1e-7, rtol=0)
        elif toolkit_class is AdamW8bit:
            assert error.mean().item() < 1e-6 and error.max().item() < 2e-4
        else:  # Lion: a sign flip where the momentum is within a quantization step of 0 moves by 2 * lr
            assert error.mean().item() < 1e-6 and (error > 1e-6).sum().item() <= 4 and error.max() <= 2e-3 + 1e-6


def test_custom_map_is_refused():
    p = torch.nn.Parameter(torch.randn(64, 128))
    theirs = bnb.optim.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    theirs.step()
    saved = theirs.state_dict()
    saved["state"][0][BNB_NESTED_KEY]["qmap1"] = torch.linspace(-1, 1, 256)
    with pytest.raises(UserError, match="custom qmap1"):
        convert_bnb_state_dict(saved)
