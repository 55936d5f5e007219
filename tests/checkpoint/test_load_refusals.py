"""What a checkpoint load refuses, in one line naming the file: a checkpoint this tool wrote without its checksum
file, or with a file the list leaves out; and NaN or inf weights on every path that reads them (a training save
resumed from, a native checkpoint exported, a Hugging Face directory loaded, an adapter merge's base)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from openrecipes.checkpoint.checksums import CHECKSUMS_FILE, write_checksums
from openrecipes.checkpoint.hf import from_hf
from openrecipes.checkpoint.native import MANIFEST, load_native_state
from openrecipes.checkpoint.safe_load import load_dcp
from openrecipes.cli import main
from tests.checkpoint.test_safe_load import native_dir  # noqa: F401  (fixture)

EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.fixture()
def copy(native_dir, tmp_path):  # noqa: F811
    target = tmp_path / "ckpt"
    shutil.copytree(native_dir, target)
    return target


def _one_line_export_error(ckpt: Path, tmp_path: Path, capsys) -> str:
    assert main(["convert", "export", str(ckpt), str(tmp_path / "hf-out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "hf-out").exists()
    return err


# ---- checksums.json: required, and complete


def test_a_deleted_checksum_file_is_refused_naming_the_folder(copy, tmp_path, capsys):
    (copy / CHECKSUMS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{copy / CHECKSUMS_FILE}: missing from {copy}"):
        load_native_state(copy)
    assert f"{copy / CHECKSUMS_FILE}: missing" in _one_line_export_error(copy, tmp_path, capsys)


def test_a_listed_file_that_is_absent_is_refused(copy):
    document = json.loads((copy / CHECKSUMS_FILE).read_text())
    document["files"]["__1_0.distcp"] = dict(document["files"]["__0_0.distcp"])
    (copy / CHECKSUMS_FILE).write_text(json.dumps(document))
    with pytest.raises(FileNotFoundError, match=rf"__1_0\.distcp: missing \(listed in {CHECKSUMS_FILE}\)"):
        load_native_state(copy)


@pytest.mark.parametrize("name", ["config.json", MANIFEST, "__0_0.distcp"])
def test_a_present_file_the_list_leaves_out_is_refused(copy, tmp_path, capsys, name):
    document = json.loads((copy / CHECKSUMS_FILE).read_text())
    del document["files"][name]  # e.g. a rewritten manifest whose entry was dropped instead of forged
    (copy / CHECKSUMS_FILE).write_text(json.dumps(document))
    with pytest.raises(ValueError, match=rf"{copy / name}: not listed in {CHECKSUMS_FILE}"):
        load_native_state(copy)
    assert f"{name}: not listed" in _one_line_export_error(copy, tmp_path, capsys)


def test_a_file_added_after_the_save_is_refused(copy):
    (copy / "extra.distcp").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=rf"extra\.distcp: not listed in {CHECKSUMS_FILE}"):
        load_native_state(copy)


# ---- a training save's shape (what `train --resume` reads through load_dcp)


def _training_state(fill: float = 0.5) -> dict:
    """A save's three parts, as a training save nests them: model, optimizer (state per parameter), trainer."""
    return {"model": {"layer.weight": torch.full((3, 4), fill), "layer.bias": torch.full((3,), fill)},
            "optimizer": {"state": {"layer.weight": {"exp_avg": torch.full((3, 4), fill),
                                                     "exp_avg_sq": torch.full((3, 4), fill),
                                                     "step": torch.tensor(4.0)}}},
            "trainer": {"step": torch.tensor(4, dtype=torch.int64)}}


def _save_state(save: Path, state: dict) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(save)), no_dist=True)
    write_checksums(save, no_dist=True)  # the save's last file, as a training save writes it
    return save


def test_a_training_save_loads(tmp_path):
    state = _training_state(0.0)
    load_dcp(state, _save_state(tmp_path / "step-000004", _training_state()), no_dist=True)
    assert torch.equal(state["model"]["layer.weight"], torch.full((3, 4), 0.5))


def test_a_training_save_without_its_checksum_file_is_not_resumed(tmp_path):
    save = _save_state(tmp_path / "step-000004", _training_state())
    (save / CHECKSUMS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{CHECKSUMS_FILE}: missing from {save}"):
        load_dcp(_training_state(0.0), save, no_dist=True)


@pytest.mark.parametrize("part, name", [("model", "model.layer.weight"),
                                        ("optimizer", "optimizer.state.layer.weight.exp_avg_sq")])
def test_a_training_save_holding_nan_is_not_resumed(tmp_path, part, name):
    state = _training_state()
    if part == "model":
        state["model"]["layer.weight"][1, 2] = float("nan")
    else:
        state["optimizer"]["state"]["layer.weight"]["exp_avg_sq"][0, 0] = float("inf")
    save = _save_state(tmp_path / "step-000004", state)  # a save refuses NaN: this one was written around that
    with pytest.raises(ValueError, match=rf"{save}/__0_0\.distcp: tensor '{name}' holds NaN or inf"):
        load_dcp(_training_state(0.0), save, no_dist=True)


# ---- a native checkpoint exported


def test_convert_export_refuses_a_native_checkpoint_holding_nan(copy, tmp_path, capsys):
    state, _ = load_native_state(copy)
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name][0, 0] = float("inf")
    for path in copy.glob("*.distcp"):
        path.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(copy)), no_dist=True)
    write_checksums(copy, no_dist=True)
    err = _one_line_export_error(copy, tmp_path, capsys)
    assert f"{copy}/__0_0.distcp: tensor {name!r} holds NaN or inf" in err, err


# ---- a Hugging Face directory (init: checkpoint, convert import, merge-lora's base)


@pytest.fixture()
def poisoned_hf(native_dir, tmp_path) -> Path:  # noqa: F811
    hf = tmp_path / "hf"
    shutil.copytree(native_dir.parent / "hf", hf)
    (shard,) = hf.glob("*.safetensors")
    tensors = load_file(shard)
    tensors[EXPERT][2, 5] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return hf


def test_loading_a_hugging_face_directory_holding_nan_is_refused(poisoned_hf):
    with pytest.raises(ValueError, match=rf"{poisoned_hf}/model\.safetensors: tensor '{EXPERT}' holds NaN or inf"):
        from_hf(poisoned_hf)


def test_merge_lora_refuses_a_base_holding_nan(native_dir, poisoned_hf, tmp_path, capsys):  # noqa: F811
    from openrecipes.checkpoint.lora import save_peft_adapter
    from openrecipes.models.common.lora import LoraSpec, apply_lora

    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj",))
    model = from_hf(native_dir.parent / "hf")  # the adapter is trained on the clean base
    apply_lora(model, spec)
    save_peft_adapter(model, spec, tmp_path / "adapter")
    assert main(["convert", "merge-lora", str(poisoned_hf), str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"tensor '{EXPERT}' holds NaN or inf" in err, err
    assert not (tmp_path / "merged").exists()
