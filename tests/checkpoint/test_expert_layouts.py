"""Fused (transformers 5: gate_up_proj and down_proj, 3-D per layer) and per-expert checkpoints: both read, both
written, both round trips bitwise, the fused one read as transformers holds Qwen3-MoE."""

import json

import pytest
import torch
from safetensors.torch import save_file

import openrecipes
from openrecipes.checkpoint.hf import save_hf
from openrecipes.checkpoint.native import export_hf, import_hf
from openrecipes.cli import main
from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.muse_spark import hf as muse_hf
from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config
from tests.checkpoint.test_convert import all_tensors

LAYOUTS = ["fused", "per_expert"]


def _bitwise_equal(a_dir, b_dir):
    before, after = all_tensors(a_dir), all_tensors(b_dir)
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name


@pytest.fixture(scope="module")
def muse():
    return build_muse_spark(get_config("muse-spark-tiny"), seed=11).to(torch.bfloat16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_muse_round_trip_is_bitwise_in_each_layout(muse, tmp_path, layout):
    save_hf(muse, tmp_path / "source", expert_layout=layout, max_shard_bytes=150_000)
    assert main(["convert", "import", str(tmp_path / "source"), str(tmp_path / "native")]) == 0
    manifest = json.loads((tmp_path / "native" / "openrecipes.json").read_text())
    assert manifest["expert_layout"] == layout
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "back")]) == 0  # the source's
    _bitwise_equal(tmp_path / "source", tmp_path / "back")
    assert main(["convert", "audit", str(tmp_path / "source"), str(tmp_path / "back")]) == 0
    other = LAYOUTS[1 - LAYOUTS.index(layout)]  # asked for the other layout: what save_hf writes in it
    assert main(["convert", "export", "--expert-layout", other, str(tmp_path / "native"), str(tmp_path / "x")]) == 0
    save_hf(muse, tmp_path / "reference", expert_layout=other)
    _bitwise_equal(tmp_path / "reference", tmp_path / "x")
    loaded = openrecipes.from_hf(tmp_path / "source")
    for name, param in muse.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], param), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qwen3_round_trip_is_bitwise_in_each_layout(tmp_path, layout):
    model = build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=2)
    save_hf(model, tmp_path / "source", expert_layout=layout)
    import_hf(tmp_path / "source", tmp_path / "native")
    export_hf(tmp_path / "native", tmp_path / "back")
    _bitwise_equal(tmp_path / "source", tmp_path / "back")
    loaded = openrecipes.from_hf(tmp_path / "source")
    for name, param in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], param), name


def test_fused_layout_is_transformers_qwen3_moe(tmp_path):
    from tests.models.hf_reference import make_hf_model

    hf_model = make_hf_model("wide_heads")
    hf_model.save_pretrained(tmp_path)  # config.json (and per-expert tensors, replaced next)
    for file in tmp_path.glob("*.safetensors*"):
        file.unlink()
    state = hf_model.state_dict()
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 64, 64)  # (E, 2F, D)
    save_file({name: t.contiguous() for name, t in state.items()}, str(tmp_path / "model.safetensors"))
    native = openrecipes.from_hf(tmp_path)
    experts = native.model.layers["1"].mlp.experts
    fused = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(experts.gate_proj, fused[:, :32]) and torch.equal(experts.up_proj, fused[:, 32:])
    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(native(ids), hf_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_full_text_decoder_tensor_counts():
    full = get_config("muse-spark-open-816b-a42b")
    fused = muse_hf.expected_hf_shapes(full, "fused")
    per_expert = muse_hf.expected_hf_shapes(full, "per_expert")
    # 18 non-expert tensors per layer + 2 fused expert tensors (or 3 x 256), plus embedding, final norm, LM head
    assert len(fused) == 62 * 20 + 3 == 1_243
    assert len(per_expert) == 62 * (18 + 3 * 256) + 3 == 48_735
    assert fused["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (256, 8192, 4096)
    assert fused["model.language_model.layers.0.mlp.experts.down_proj"] == (256, 4096, 4096)


def _rewrite(path, change):
    tensors = all_tensors(path)
    change(tensors)
    for file in path.glob("*.safetensors*"):
        file.unlink()
    save_file(tensors, str(path / "model.safetensors"))


def test_bad_fused_tensors_name_themselves(muse, tmp_path):
    save_hf(muse, tmp_path / "hf")
    key = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    _rewrite(tmp_path / "hf", lambda t: t.update({key: t[key][:, :48].clone()}))
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.gate_up_proj.*\(8, 48, 32\).*\(8, 64, 32\)"):
        openrecipes.from_hf(tmp_path / "hf")

    save_hf(muse, tmp_path / "mixed", expert_layout="per_expert")
    fused = dict(muse_hf.to_hf(muse.named_parameters(), muse.config, "fused"))
    _rewrite(tmp_path / "mixed", lambda t: t.update({key: fused[key].detach()}))
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.gate_proj is stored in more than one layout"):
        openrecipes.from_hf(tmp_path / "mixed")


def test_export_needs_both_halves_and_a_known_layout():
    keys = ExpertKeyMap("model.layers")
    lonely = [("model.layers.0.mlp.experts.gate_proj", torch.zeros(2, 3, 4))]
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts: gate_proj has no partner"):
        list(keys.to_hf(lonely, 2, "fused"))
    with pytest.raises(ValueError, match="expert layout"):
        list(keys.to_hf(lonely, 2, "stacked"))
    with pytest.raises(ValueError, match=r"expected 3 experts"):
        list(keys.to_hf(lonely, 3, "per_expert"))
