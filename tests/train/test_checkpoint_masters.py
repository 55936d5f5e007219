"""A bf16 recipe's fp32 masters move between the two places a layout keeps them (train/engine.py parameter_dtype):
a save whose parameters are their own fp32 masters (FSDP2, dp > 1) resumes where the optimizer keeps the masters
beside bf16 parameters (one process, dp = 1), and the reverse, each master bit for bit."""

import torch
from torch import nn

from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam
from openrecipes.checkpoint.training_save import load_checkpoint, save_checkpoint


def _trained(dtype: torch.dtype, master: str) -> tuple[nn.Module, MixedPrecisionAdam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(dtype)
    optimizer = MixedPrecisionAdam(list(model.parameters()), AdamConfig(lr=1e-2, master=master))
    model(torch.randn(3, 8, dtype=dtype)).float().square().sum().backward()
    optimizer.step()  # the masters now carry bits their bf16 rounding drops
    return model, optimizer


def _masters(model: nn.Module, optimizer: MixedPrecisionAdam) -> list[torch.Tensor]:
    held = optimizer.master_weights()
    return [held[p] for p in model.parameters()]


def test_masters_resume_across_where_a_layout_keeps_them(tmp_path):
    for index, (saved_kind, loaded_kind) in enumerate([((torch.float32, "param"), (torch.bfloat16, "fp32")),
                                                       ((torch.bfloat16, "fp32"), (torch.float32, "param"))]):
        model, optimizer = _trained(*saved_kind)
        path = save_checkpoint(tmp_path / str(index), model, optimizer, step=3, keep=1)
        loaded_model, loaded_optimizer = _trained(*loaded_kind)  # other values: every one must come from the save
        assert load_checkpoint(path, loaded_model, loaded_optimizer) == 3
        for want, got, param in zip(_masters(model, optimizer), _masters(loaded_model, loaded_optimizer),
                                    loaded_model.parameters()):
            assert torch.equal(got, want) and got.dtype == torch.float32, index
            assert torch.equal(param.detach(), want.to(param.dtype)), index
        for want, got in zip(model.parameters(), loaded_model.parameters()):  # the moments too
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded_optimizer.state[got][key], optimizer.state[want][key]), (index, key)
