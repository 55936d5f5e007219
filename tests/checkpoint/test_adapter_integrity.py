"""An adapter the trainer writes carries checksums beside PEFT's files; merge-lora refuses one that changed since."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from openrecipes.checkpoint.checksums import CHECKSUMS_FILE
from openrecipes.checkpoint.hf import from_hf, save_hf
from openrecipes.checkpoint.lora import CONFIG_FILE, WEIGHTS_FILE, save_peft_adapter
from openrecipes.cli import main
from openrecipes.models.common.lora import LoraSpec, apply_lora
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapter")
    save_hf(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=2), root / "base")
    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "experts"))
    model = from_hf(root / "base", dtype=torch.float32)
    apply_lora(model, spec)
    with torch.no_grad():  # B starts at zero: give the adapter an effect
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
    save_peft_adapter(model, spec, root / "adapter", base_model=str(root / "base"))
    return root / "base", root / "adapter"


@pytest.fixture()
def adapter(saved, tmp_path) -> Path:
    copy = tmp_path / "adapter"
    shutil.copytree(saved[1], copy)
    return copy


def _merge(base: Path, adapter: Path, out: Path) -> int:
    return main(["convert", "merge-lora", str(base), str(adapter), "--out", str(out)])


def test_the_adapter_keeps_peft_files_and_lists_them(adapter):
    assert {p.name for p in adapter.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, CHECKSUMS_FILE}
    assert set(json.loads((adapter / CHECKSUMS_FILE).read_text())["files"]) == {CONFIG_FILE, WEIGHTS_FILE}


@pytest.mark.parametrize("name", [WEIGHTS_FILE, CONFIG_FILE])
def test_a_changed_adapter_file_is_not_merged(saved, adapter, tmp_path, capsys, name):
    path = adapter / name
    if name == CONFIG_FILE:  # valid JSON still: merged, it would scale every delta by ten
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] * 10}, indent=2) + "\n")
    else:  # a byte inside the tensor data: still a valid file of other numbers
        data = bytearray(path.read_bytes())
        data[len(data) - 16] ^= 0x01
        path.write_bytes(bytes(data))
    assert _merge(saved[0], adapter, tmp_path / "merged") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{name}: damaged" in err, err
    assert not (tmp_path / "merged").exists()


def test_a_missing_listed_file_is_named(saved, adapter, tmp_path):
    (adapter / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{WEIGHTS_FILE}: missing \(listed in {CHECKSUMS_FILE}\)"):
        from openrecipes.checkpoint.lora import merge_lora

        merge_lora(saved[0], adapter, tmp_path / "merged")


def test_an_adapter_from_elsewhere_has_no_checksums_and_merges(saved, adapter, tmp_path, capsys):
    (adapter / CHECKSUMS_FILE).unlink()
    assert _merge(saved[0], adapter, tmp_path / "merged") == 0
    assert json.loads(capsys.readouterr().out)["merged_tensors"] > 0


def test_a_rewritten_adapter_gets_fresh_checksums(saved, adapter, tmp_path):
    model = from_hf(saved[0], dtype=torch.float32)
    spec = LoraSpec(rank=3, alpha=3.0, targets=("o_proj",))
    apply_lora(model, spec)
    save_peft_adapter(model, spec, adapter)  # over the earlier adapter, as a second run into the same run_dir does
    assert _merge(saved[0], adapter, tmp_path / "merged") == 0
