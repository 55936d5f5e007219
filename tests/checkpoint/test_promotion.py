"""Promote on import: bf16 residual gates in a source checkpoint load as fp32 with identical values, export writes
the source's dtypes unless asked otherwise, and the audit reports promotions as such."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import openrecipes
from openrecipes.checkpoint import native
from openrecipes.checkpoint.audit import audit
from openrecipes.checkpoint.hf import save_hf
from openrecipes.checkpoint.native import export_hf, import_hf, load_native_state
from openrecipes.cli import main
from openrecipes.models.common.precision import check_fp32_parameters
from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.registry import get_config
from tests.checkpoint.test_convert import all_tensors

GATES = ("residual_gate.weight",)
ROUTER = ("mlp.gate.weight", "mlp.gate.expert_bias")


@pytest.fixture()
def source_dir(tmp_path):
    """Stored as the published checkpoint is: bf16, fp32 router tensors, and the residual gates in bf16."""
    model = build_muse_spark(get_config("muse-spark-tiny"), seed=3).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(GATES):  # replacing .data goes around KeepFP32: the way to write bf16 gates
                noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name)))
                param.data = (1.0 + 0.1 * noise).to(torch.bfloat16)
    save_hf(model, tmp_path / "source", max_shard_bytes=150_000)
    return tmp_path / "source"


def test_the_source_has_bf16_gates_and_fp32_router(source_dir):
    dtypes = {name: t.dtype for name, t in all_tensors(source_dir).items()}
    assert [n for n, d in dtypes.items() if d == torch.float32] == sorted(
        n for n in dtypes if n.endswith(ROUTER))
    assert sum(n.endswith(GATES) for n in dtypes) == 8 and {dtypes[n] for n in dtypes if n.endswith(GATES)} == {
        torch.bfloat16}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_bf16_residual_gates_load_as_fp32_with_identical_values(source_dir, dtype):
    tensors = all_tensors(source_dir)
    loaded = openrecipes.from_hf(source_dir, dtype=dtype)
    check_fp32_parameters(loaded)
    for name, param in loaded.named_parameters():
        if name.endswith(GATES + ROUTER):
            assert param.dtype == torch.float32, name
            assert torch.equal(param, tensors[name].float()), name
        else:
            assert param.dtype == torch.bfloat16, name


def test_import_promotes_and_export_writes_the_source_dtypes(source_dir, tmp_path, capsys):
    assert main(["convert", "import", str(source_dir), str(tmp_path / "native")]) == 0
    assert "8 promoted to fp32" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "native" / "openrecipes.json").read_text())
    gate = "model.language_model.layers.2.mlp_residual_gate.weight"
    assert manifest["tensors"][gate] == {"shape": [64], "dtype": "float32", "source_dtype": "bfloat16"}
    assert len(manifest["promoted"]) == 8 and all(n.endswith(GATES) for n in manifest["promoted"])
    router = "model.language_model.layers.2.mlp.gate.weight"
    assert manifest["tensors"][router]["source_dtype"] == manifest["tensors"][router]["dtype"] == "float32"
    state, _ = load_native_state(tmp_path / "native")
    assert state[gate].dtype == torch.float32 and torch.equal(state[gate], all_tensors(source_dir)[gate].float())

    # default: the dtypes the source had, bitwise
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "back")]) == 0
    before, after = all_tensors(source_dir), all_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name
    report = audit(source_dir, tmp_path / "back")
    assert report.passed() and report.promoted == [] and report.exact == len(before)

    # asked for: the native dtypes, gates fp32; the audit calls that a promotion and passes
    assert main(["convert", "export", "--dtypes", "native", str(tmp_path / "native"), str(tmp_path / "wide")]) == 0
    wide = all_tensors(tmp_path / "wide")
    assert {n for n, t in wide.items() if t.dtype == torch.float32} == {
        n for n in wide if n.endswith(GATES + ROUTER)}
    report = audit(source_dir, tmp_path / "wide")
    assert report.passed() and report.dtype_changed == [] and report.exact == len(before)
    assert sorted(n for n, _, _ in report.promoted) == manifest["promoted"]
    assert {(a, b) for _, a, b in report.promoted} == {("bfloat16", "float32")}
    assert re.search(r"promoted to fp32 +8 \(values unchanged\)", report.table())
    capsys.readouterr()
    assert main(["convert", "audit", "--json", str(source_dir), str(tmp_path / "wide")]) == 0
    assert len(json.loads(capsys.readouterr().out)["promoted"]) == 8


def test_export_warns_when_a_value_does_not_fit_its_source_dtype(source_dir, tmp_path, monkeypatch):
    import_hf(source_dir, tmp_path / "native")
    gate = "model.language_model.layers.0.attn_residual_gate.weight"
    real_load = native.load_native_state

    def trained(path):  # a gate that moved off the bf16 grid, as training would leave it
        state, config = real_load(path)
        state[gate] = state[gate] + 1e-4
        return state, config

    monkeypatch.setattr(native, "load_native_state", trained)
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) rounded to their source dtype.*attn_residual_gate"):
        export_hf(tmp_path / "native", tmp_path / "rounded")
    assert all_tensors(tmp_path / "rounded")[gate].dtype == torch.bfloat16
    export_hf(tmp_path / "native", tmp_path / "kept", dtypes="native")
    assert torch.equal(all_tensors(tmp_path / "kept")[gate], real_load(tmp_path / "native")[0][gate] + 1e-4)
    with pytest.raises(ValueError, match="dtypes"):
        export_hf(tmp_path / "native", tmp_path / "bad", dtypes="bf16")


def test_narrowing_or_a_changed_value_is_no_promotion(source_dir, tmp_path):
    tensors = all_tensors(source_dir)
    router = "model.language_model.layers.1.mlp.gate.weight"
    gate = "model.language_model.layers.1.attn_residual_gate.weight"
    tensors[router] = tensors[router].to(torch.bfloat16)       # fp32 -> bf16: rounds, a failure
    tensors[gate] = tensors[gate].float() + 1e-3                # bf16 -> fp32 with a new value: a failure
    other = tmp_path / "other"
    other.mkdir()
    save_file(tensors, str(other / "model.safetensors"))
    (other / "config.json").write_text((source_dir / "config.json").read_text())
    report = audit(source_dir, other)
    assert report.promoted == [] and not report.passed()
    assert [n for n, _, _ in report.dtype_changed] == [gate, router]
