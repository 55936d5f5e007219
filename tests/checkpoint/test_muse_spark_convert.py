"""Muse Spark HF layout: text-only import/export/audit, fp32 tensors kept, other modalities skipped and counted."""

import json

import pytest
import torch
from safetensors.torch import save_file

import openrecipes
from openrecipes.checkpoint.hf import iter_native_tensors, read_config, save_hf
from openrecipes.checkpoint.native import import_hf, load_native_state
from openrecipes.checkpoint.safetensors_io import INDEX_NAME, HFCheckpoint
from openrecipes.cli import main
from openrecipes.models.common.attention import Documents
from openrecipes.models.common.precision import check_fp32_parameters, fp32_parameter_names
from openrecipes.models.muse_spark.hf import expected_hf_shapes
from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.registry import get_config
from tests.checkpoint.test_convert import all_tensors

FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.expert_bias", "residual_gate.weight")
NON_TEXT = {
    "model.vision_tower.blocks.0.attn.qkv.weight": torch.randn(12, 4),
    "model.vision_tower.patch_embed.weight": torch.randn(4, 3),
    "model.multi_modal_projector.linear_1.weight": torch.randn(4, 4).to(torch.bfloat16),
    "model.audio_tower.conv1.weight": torch.randn(2, 2),
}


@pytest.fixture()
def model():
    model = build_muse_spark(get_config("muse-spark-tiny"), seed=3).to(torch.bfloat16)
    with torch.no_grad():  # distinct values in the tensors that start at constants, so copying them is visible
        for name, param in model.named_parameters():
            if name.endswith(("expert_bias", "residual_gate.weight")):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


@pytest.fixture()
def hf_dir(model, tmp_path):
    path = tmp_path / "hf"
    save_hf(model, path, max_shard_bytes=150_000)  # several shards + index
    return path


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_layout_and_dtypes(model, tmp_path, layout):
    save_hf(model, tmp_path / layout, expert_layout=layout)
    tensors = all_tensors(tmp_path / layout)
    config = get_config("muse-spark-tiny")
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected_hf_shapes(config, layout)
    assert all(name.startswith("model.language_model.") or name == "lm_head.weight" for name in tensors)
    if layout == "per_expert":
        assert tensors["model.language_model.layers.1.mlp.experts.7.down_proj.weight"].shape == (32, 32)
        assert len(tensors) == 4 * (18 + 3 * 8) + 3
    else:  # transformers 5's Qwen3-MoE layout: (E, 2F, L) with the gate rows first, and (E, L, F)
        assert tensors["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 32)
        assert tensors["model.language_model.layers.1.mlp.experts.down_proj"].shape == (8, 32, 32)
        assert len(tensors) == 4 * (18 + 2) + 3
    assert "model.language_model.embed_tokens.weight" in tensors and "model.language_model.norm.weight" in tensors
    for name, tensor in tensors.items():
        assert tensor.dtype == (torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16), name
    assert json.loads((tmp_path / layout / "config.json").read_text())["model_type"] == "muse_spark"


def test_fused_is_the_default_layout(hf_dir):
    assert all_tensors(hf_dir).keys() == expected_hf_shapes(get_config("muse-spark-tiny"), "fused").keys()
    assert expected_hf_shapes(get_config("muse-spark-tiny")) == expected_hf_shapes(get_config("muse-spark-tiny"),
                                                                                   "fused")


def test_cli_round_trip_is_bitwise_and_keeps_fp32(model, hf_dir, tmp_path):
    assert (hf_dir / INDEX_NAME).is_file()
    assert main(["convert", "import", str(hf_dir), str(tmp_path / "native")]) == 0
    state, _ = load_native_state(tmp_path / "native")
    assert {state[name].dtype for name in fp32_parameter_names(model)} == {torch.float32}
    assert state["model.language_model.layers.0.mlp.experts.gate_proj"].shape == (8, 32, 32)
    assert state["model.language_model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert state["model.language_model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "back")]) == 0
    before, after = all_tensors(hf_dir), all_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    fp32 = 0
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name
        fp32 += after[name].dtype == torch.float32
    assert fp32 == 4 * 4  # router weight, expert bias and two residual gates in each of the 4 layers
    assert main(["convert", "audit", str(hf_dir), str(tmp_path / "back")]) == 0


def test_from_hf_gives_identical_logits(model, hf_dir):
    loaded = openrecipes.from_hf(hf_dir)
    for name, param in model.named_parameters():
        other = dict(loaded.named_parameters())[name]
        assert other.dtype == param.dtype and torch.equal(other, param), name
    assert not loaded.model.language_model.layers["2"].mlp.gate.expert_bias.requires_grad
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    documents = Documents.from_document_ids(torch.tensor([[0] * 10 + [1] * 14, [2] * 24]))
    positions = torch.tensor([list(range(10)) + list(range(14)), list(range(24))])
    with torch.no_grad():
        assert torch.equal(model(ids, positions, documents), loaded(ids, positions, documents))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_hf_with_a_low_dtype_keeps_fp32_tensors_unrounded(model, hf_dir, dtype):
    loaded = openrecipes.from_hf(hf_dir, dtype=dtype)
    check_fp32_parameters(loaded)
    source = dict(model.named_parameters())
    pinned = fp32_parameter_names(loaded)
    assert len(pinned) == 16
    for name, param in loaded.named_parameters():
        if name in pinned:  # full fp32 values in the file: a trip through bf16 would change them
            assert param.dtype == torch.float32 and torch.equal(param, source[name]), name
        else:
            assert param.dtype == dtype, name
    assert not loaded.model.language_model.layers["0"].mlp.gate.expert_bias.requires_grad
    wide = openrecipes.from_hf(hf_dir, dtype=torch.float64)  # up-casting reaches the pinned tensors too
    assert {p.dtype for p in wide.parameters()} == {torch.float64}


def _add_other_modalities(hf_dir):
    extra_file = hf_dir / "model-vision.safetensors"
    save_file(NON_TEXT, str(extra_file))
    index = json.loads((hf_dir / INDEX_NAME).read_text())
    index["weight_map"].update({name: extra_file.name for name in NON_TEXT})
    (hf_dir / INDEX_NAME).write_text(json.dumps(index))
    config = json.loads((hf_dir / "config.json").read_text())
    towers = get_config("muse-spark-tiny-full").to_hf_dict()
    config.update({key: towers[key] for key in ("vision_config", "audio_config", "image_token_id", "video_token_id",
                                                "audio_token_id")})
    (hf_dir / "config.json").write_text(json.dumps(config))


def test_other_modalities_are_skipped_and_counted(model, hf_dir, tmp_path):
    _add_other_modalities(hf_dir)
    checkpoint = HFCheckpoint(hf_dir)
    family, config = read_config(checkpoint)
    skipped = []
    with pytest.warns(UserWarning, match="skipped 4 tensor"):
        names = [name for name, _ in iter_native_tensors(checkpoint, family, config, skipped)]
    assert sorted(skipped) == sorted(NON_TEXT)
    assert names == [name for name, _ in model.named_parameters()]

    with pytest.warns(UserWarning, match="skipped 4 tensor"):
        assert main(["convert", "import", str(hf_dir), str(tmp_path / "native")]) == 0
    manifest = json.loads((tmp_path / "native" / "openrecipes.json").read_text())
    assert not any(name.startswith(("model.vision", "model.audio", "model.multi")) for name in manifest["tensors"])
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "text")]) == 0
    assert all_tensors(tmp_path / "text").keys() == all_tensors(hf_dir).keys() - NON_TEXT.keys()
    with pytest.warns(UserWarning, match="skipped 4"):
        loaded = openrecipes.from_hf(hf_dir)
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_unknown_text_tensor_is_still_an_error(hf_dir):
    extra = hf_dir / "model-extra.safetensors"
    save_file({"model.language_model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}, str(extra))
    index = json.loads((hf_dir / INDEX_NAME).read_text())
    index["weight_map"]["model.language_model.layers.0.mlp.shared_expert.weight"] = extra.name
    (hf_dir / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shared_expert"):
        openrecipes.from_hf(hf_dir)


def test_missing_expert_bias_names_it(hf_dir, tmp_path):
    tensors = all_tensors(hf_dir)
    tensors.pop("model.language_model.layers.3.mlp.gate.expert_bias")
    other = tmp_path / "other"
    other.mkdir()
    save_file(tensors, str(other / "model.safetensors"))
    (other / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.gate\.expert_bias"):
        import_hf(other, tmp_path / "native")
