"""HF <-> native checkpoint conversion, audit, and bad-input handling."""

import json

import pytest
import torch
from safetensors.torch import load_file

from openrecipes.checkpoint.audit import audit
from openrecipes.checkpoint.hf import from_hf, save_hf
from openrecipes.checkpoint.native import export_hf, import_hf
from openrecipes.checkpoint.safetensors_io import INDEX_NAME
from openrecipes.cli import main
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config


@pytest.fixture()
def hf_dir(tmp_path):
    model = build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=3)
    # mixed dtypes must survive the round trip tensor by tensor
    model.model.layers["0"].mlp.gate.weight.data = model.model.layers["0"].mlp.gate.weight.data.to(torch.bfloat16)
    path = tmp_path / "hf"
    save_hf(model, path, max_shard_bytes=200_000)  # forces several shards + index
    return path


def all_tensors(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_round_trip_is_bitwise(hf_dir, tmp_path):
    assert (hf_dir / INDEX_NAME).is_file()
    assert main(["convert", "import", str(hf_dir), str(tmp_path / "native")]) == 0
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "back")]) == 0
    before, after = all_tensors(hf_dir), all_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert before[name].shape == after[name].shape, name
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name
    assert before["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert main(["convert", "audit", str(hf_dir), str(tmp_path / "back")]) == 0


def test_audit_reports_every_kind_of_difference(hf_dir, tmp_path, capsys):
    tensors = all_tensors(hf_dir)
    tensors.pop("model.layers.1.self_attn.q_proj.weight")                      # missing
    tensors["extra.weight"] = torch.zeros(2)                                   # extra
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()   # reshaped
    tensors["lm_head.weight"] = tensors["lm_head.weight"].double()             # dtype change
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] + 1e-3  # value change
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import save_file
    save_file(tensors, str(other / "model.safetensors"))
    (other / "config.json").write_text((hf_dir / "config.json").read_text())

    report = audit(hf_dir, other)
    assert report.missing == ["model.layers.1.self_attn.q_proj.weight"]
    assert report.extra == ["extra.weight"]
    assert [r[0] for r in report.reshaped] == ["model.norm.weight"]
    assert [d[0] for d in report.dtype_changed] == ["lm_head.weight"]
    assert abs(report.max_abs_diff - 1e-3) < 1e-6
    assert not report.passed()
    assert main(["convert", "audit", str(hf_dir), str(other)]) == 1
    assert "missing" in capsys.readouterr().out


def test_audit_atol_allows_small_differences(hf_dir, tmp_path):
    tensors = all_tensors(hf_dir)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-6
    other = tmp_path / "near"
    other.mkdir()
    from safetensors.torch import save_file
    save_file(tensors, str(other / "model.safetensors"))
    (other / "config.json").write_text((hf_dir / "config.json").read_text())
    assert main(["convert", "audit", str(hf_dir), str(other)]) == 1
    assert main(["convert", "audit", str(hf_dir), str(other), "--atol", "1e-5"]) == 0


def test_missing_shard_names_the_file(hf_dir):
    index = json.loads((hf_dir / INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (hf_dir / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        from_hf(hf_dir)


def test_truncated_file_names_the_file(hf_dir):
    shard = sorted(hf_dir.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=shard.name):
        from_hf(hf_dir)


def test_wrong_shape_and_unknown_key_name_the_tensor(tmp_path):
    model = build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=0)
    path = tmp_path / "hf"
    save_hf(model, path)
    tensors = load_file(path / "model.safetensors")
    from safetensors.torch import save_file

    bad = dict(tensors)
    bad["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight.*model\.safetensors"):
        from_hf(path)

    unknown = dict(tensors)
    unknown["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(3)
    save_file(unknown, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="shared_expert"):
        from_hf(path)

    missing_expert = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    save_file(missing_expert, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        from_hf(path)


def test_failed_export_leaves_no_complete_looking_directory(hf_dir, tmp_path, monkeypatch):
    import_hf(hf_dir, tmp_path / "native")
    import openrecipes.checkpoint.safetensors_io as io

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(io, "save_file", explode)
    with pytest.raises(OSError):
        export_hf(tmp_path / "native", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out.partial") for p in tmp_path.iterdir())


def test_incomplete_native_checkpoint_is_refused(hf_dir, tmp_path):
    import_hf(hf_dir, tmp_path / "native")
    (tmp_path / "native" / "openrecipes.json").unlink()
    with pytest.raises(FileNotFoundError, match="openrecipes.json"):
        export_hf(tmp_path / "native", tmp_path / "out")


def test_existing_output_is_not_overwritten(hf_dir, tmp_path, capsys):
    (tmp_path / "native").mkdir()
    (tmp_path / "native" / "keep.txt").write_text("mine")
    assert main(["convert", "import", str(hf_dir), str(tmp_path / "native")]) == 2
    assert (tmp_path / "native" / "keep.txt").read_text() == "mine"
    assert "is not empty and was not written by openrecipes convert import" in capsys.readouterr().err


def _edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


def _one_line_import_error(hf_dir, tmp_path, capsys):
    assert main(["convert", "import", str(hf_dir), str(tmp_path / "native")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "native").exists()
    return err


def test_an_index_naming_a_shard_without_the_tensor_is_one_line(hf_dir, tmp_path, capsys):
    index = json.loads((hf_dir / INDEX_NAME).read_text())
    name = next(iter(index["weight_map"]))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (hf_dir / INDEX_NAME).write_text(json.dumps(index))
    err = _one_line_import_error(hf_dir, tmp_path, capsys)  # was a SafetensorError traceback
    assert f"tensor {name!r} in {hf_dir / other}: cannot be read" in err, err


def test_a_deeply_nested_index_is_one_line(hf_dir, tmp_path, capsys):
    (hf_dir / INDEX_NAME).write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError traceback
    assert f"{hf_dir / INDEX_NAME}: not a safetensors index" in _one_line_import_error(hf_dir, tmp_path, capsys)


def test_a_huge_layer_count_is_refused_before_the_config_is_built(hf_dir, tmp_path, capsys):
    import time

    _edit_config(hf_dir, num_hidden_layers=10**12)  # building this config looped over every layer (hung)
    start = time.monotonic()
    err = _one_line_import_error(hf_dir, tmp_path, capsys)
    assert "config.json: num_hidden_layers=1000000000000" in err and time.monotonic() - start < 30, err


def test_a_layer_count_without_layer_tensors_and_a_deep_config_are_one_line(hf_dir, tmp_path, capsys):
    """A folder whose tensors hold no decoder layer, under a config of 10**12 layers, was building that config
    (hung); a config.json nested a hundred thousand deep was a RecursionError traceback."""
    import time

    from safetensors.torch import load_file, save_file

    for shard in hf_dir.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(shard).items() if ".layers." not in k}, shard)
    index = json.loads((hf_dir / INDEX_NAME).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".layers." not in k}
    (hf_dir / INDEX_NAME).write_text(json.dumps(index))
    _edit_config(hf_dir, num_hidden_layers=10**12)
    start = time.monotonic()
    err = _one_line_import_error(hf_dir, tmp_path, capsys)
    assert "num_hidden_layers=1000000000000, more than 10,000, and the checkpoint holds no decoder layer tensors" in err
    assert time.monotonic() - start < 30
    (hf_dir / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    err = _one_line_import_error(hf_dir, tmp_path, capsys)
    assert "config.json: not valid JSON (nested too deeply to read)" in err, err


@pytest.mark.parametrize("size", [2**63 - 1, 2**63])
def test_sizes_no_tensor_can_have_are_one_line_naming_config_json(hf_dir, tmp_path, capsys, size):
    _edit_config(hf_dir, hidden_size=size, head_dim=16)  # was a torch RuntimeError or TypeError traceback
    err = _one_line_import_error(hf_dir, tmp_path, capsys)
    assert f"{hf_dir / 'config.json'}: the model it describes cannot be built" in err, err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nonfinite_float_field_is_refused_by_name(hf_dir, tmp_path, capsys, value):
    _edit_config(hf_dir, rms_norm_eps=value)  # NaN was imported as a norm epsilon without a word
    err = _one_line_import_error(hf_dir, tmp_path, capsys)
    assert "config.json: rms_norm_eps=" in err and "must be a finite number" in err, err


def test_audit_table_keeps_a_tensor_name_on_one_line(hf_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    for path, name in ((a, "y"), (b, "x\nresult  PASS")):  # a name read from the file, as the audit lists it
        path.mkdir()
        (path / "config.json").write_text((hf_dir / "config.json").read_text())
        save_file({name: torch.zeros(1)}, str(path / "model.safetensors"))
    assert main(["convert", "audit", str(a), str(b)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "extra    x\\nresult  PASS" in lines and "result  PASS" not in lines
