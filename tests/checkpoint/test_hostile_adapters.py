"""An adapter from elsewhere (no checksums) whose numbers are hostile: merge-lora refuses it in one line before it
multiplies, matches or writes anything it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from openrecipes.checkpoint.checksums import CHECKSUMS_FILE
from openrecipes.checkpoint.lora import CONFIG_FILE, WEIGHTS_FILE
from openrecipes.cli import main
from tests.checkpoint.test_adapter_integrity import saved  # noqa: F401  (fixture)

Q = "base_model.model.model.layers.0.self_attn.q_proj"


def _adapter(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "bias": "none", **config}))
    save_file(tensors, folder / WEIGHTS_FILE)
    assert not (folder / CHECKSUMS_FILE).exists()
    return folder


def _refused(base: Path, adapter: Path, out: Path, capsys, message: str) -> None:
    assert main(["convert", "merge-lora", str(base), str(adapter), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_factors_larger_than_any_base_tensor_are_refused_before_the_product(saved, tmp_path, capsys):  # noqa: F811
    rows = 1_000_000  # B @ A would be 8 TB in fp64
    adapter = _adapter(tmp_path / "adapter", {"r": 1, "lora_alpha": 1.0, "target_modules": ["q_proj"]},
                       {f"{Q}.lora_A.weight": torch.zeros(1, rows), f"{Q}.lora_B.weight": torch.zeros(rows, 1)})
    _refused(saved[0], adapter, tmp_path / "merged", capsys, "changes more values than the base holds there")


def test_a_scale_that_overflows_the_weights_is_refused(saved, tmp_path, capsys):  # noqa: F811
    from openrecipes.checkpoint.hf import from_hf

    out_features, in_features = from_hf(saved[0]).get_parameter(f"{Q.removeprefix('base_model.model.')}.weight").shape
    adapter = _adapter(tmp_path / "adapter", {"r": 2, "lora_alpha": 1e308, "target_modules": ["q_proj"]},
                       {f"{Q}.lora_A.weight": torch.ones(2, in_features),
                        f"{Q}.lora_B.weight": torch.ones(out_features, 2)})
    _refused(saved[0], adapter, tmp_path / "merged", capsys, "non-finite in float32 (scaled by lora_alpha 1e+308")


def test_a_module_the_base_lacks_is_refused_before_a_pattern_meets_its_name(saved, tmp_path, capsys):  # noqa: F811
    module = "base_model.model." + "a" * 40 + "!"  # "(a+)+" backtracks on this name for hours
    adapter = _adapter(tmp_path / "adapter", {"r": 2, "lora_alpha": 4.0, "target_modules": "(a+)+"},
                       {f"{module}.lora_A.weight": torch.zeros(2, 8), f"{module}.lora_B.weight": torch.zeros(8, 2)})
    _refused(saved[0], adapter, tmp_path / "merged", capsys, "the base model has no module 'aaaa")


def test_an_adapter_without_tensors_is_refused(saved, tmp_path, capsys):  # noqa: F811
    adapter = _adapter(tmp_path / "adapter", {"r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"]}, {})
    _refused(saved[0], adapter, tmp_path / "merged", capsys, "holds no LoRA tensors")
