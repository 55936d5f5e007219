"""A DeepSeek-V3 checkpoint's multi-token-prediction layer: imported, kept and exported bitwise (from_hf/save_hf and
`convert import`/`export`), its copies of the shared embedding and head checked equal, and skipped with a note (never
silently) by a model that does not hold it."""

import json

import pytest
import torch

import openrecipes
from openrecipes.checkpoint.audit import audit
from openrecipes.checkpoint.hf import from_hf, save_hf
from openrecipes.checkpoint.native import export_hf, import_hf
from openrecipes.models.deepseek_v3 import hf
from openrecipes.models.deepseek_v3.config import DeepseekV3Config
from openrecipes.models.deepseek_v3.model import build_deepseek_v3
from tests.models.test_deepseek_v3_parity import TINY, make_hf_model

pytest.importorskip("transformers")
MTP = TINY["num_hidden_layers"]  # the MTP layer's index in the checkpoint's names


def _with_mtp_layer(path, *, head_copy_offset: float = 0.0):
    """transformers' tiny checkpoint plus one MTP layer as DeepSeek publishes it (per-expert tensors, bf16 norms, the
    embedding and head copied under the layer's name)."""
    from safetensors.torch import load_file, save_file

    make_hf_model("tiny").save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    config = DeepseekV3Config.from_hf_dict(raw)
    native = build_deepseek_v3(config, seed=7)
    layer = [(n, p.detach()) for n, p in native.named_parameters() if n.startswith("model.mtp_layers.")]
    weights = next(path.glob("*.safetensors"))
    tensors = load_file(weights)
    for name, tensor in hf.to_hf(layer, config):
        tensors[name] = tensor.bfloat16() if name.endswith("norm.weight") else tensor
    tensors[f"model.layers.{MTP}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{MTP}.shared_head.head.weight"] = tensors["lm_head.weight"] + head_copy_offset
    save_file(tensors, weights, metadata={"format": "pt"})
    return {name for name in tensors if name.startswith(f"model.layers.{MTP}.")}


def test_from_hf_keeps_the_mtp_layer_and_save_hf_writes_it_back_bitwise(tmp_path):
    mtp_names = _with_mtp_layer(tmp_path / "hf")
    assert f"model.layers.{MTP}.eh_proj.weight" in mtp_names and f"model.layers.{MTP}.enorm.weight" in mtp_names
    assert f"model.layers.{MTP}.mlp.experts.7.down_proj.weight" in mtp_names
    model = openrecipes.from_hf(tmp_path / "hf")
    assert list(model.model.mtp_layers) == [str(MTP)] and model.config.mtp_layers == 1
    assert model.model.mtp_layers[str(MTP)].enorm.weight.dtype == torch.bfloat16  # the file's dtype kept
    save_hf(model, tmp_path / "out")
    report = audit(tmp_path / "hf", tmp_path / "out")
    assert report.passed() and report.exact == report.compared, report.table()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_convert_import_and_export_keep_the_mtp_layer_bitwise(tmp_path):
    _with_mtp_layer(tmp_path / "hf")
    manifest = import_hf(tmp_path / "hf", tmp_path / "native")
    assert manifest["skipped"] == 0
    assert any(name.startswith("model.mtp_layers.") for name in manifest["tensors"])
    export_hf(tmp_path / "native", tmp_path / "out")
    report = audit(tmp_path / "hf", tmp_path / "out")
    assert report.passed() and report.exact == report.compared, report.table()


def test_a_model_without_the_mtp_layer_skips_it_with_a_note(tmp_path):
    mtp_names = _with_mtp_layer(tmp_path / "hf")
    with pytest.warns(UserWarning, match=rf"skipped {len(mtp_names)} tensor\(s\) of the multi-token-prediction "
                                         rf"layer model\.layers\.{MTP} \(not trained by this run"):
        model = from_hf(tmp_path / "hf", keep_mtp=False)
    assert model.model.mtp_layers is None and model.config.to_hf_dict()["num_nextn_predict_layers"] == 0


def test_a_head_copy_that_differs_from_the_head_is_refused(tmp_path):
    _with_mtp_layer(tmp_path / "hf", head_copy_offset=1e-3)
    with pytest.raises(ValueError, match=rf"'model\.layers\.{MTP}\.shared_head\.head\.weight'.* differs from "
                                         r"'lm_head\.weight'|'lm_head\.weight'.* differs from "
                                         rf"'model\.layers\.{MTP}\.shared_head\.head\.weight'"):
        openrecipes.from_hf(tmp_path / "hf")
