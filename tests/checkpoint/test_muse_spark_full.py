"""Muse Spark's complete checkpoint (full-checkpoint mode): a generated tiny checkpoint with every tower (vision
tower, adapter and projection, audio encoder and projector, text decoder) round-trips bitwise through `convert import
--full`/`export`, the audit compares every tensor; text-only mode stays the default and skips the towers."""

import json

import pytest
import torch
from safetensors.torch import save_file

import openrecipes
from openrecipes.checkpoint.hf import save_hf
from openrecipes.checkpoint.safetensors_io import INDEX_NAME
from openrecipes.cli import main
from openrecipes.models.muse_spark.hf import TOWER_PREFIXES, expected_hf_shapes
from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.registry import get_config
from tests.checkpoint.test_convert import all_tensors

CONFIG = get_config("muse-spark-tiny-full")


@pytest.fixture(scope="module")
def model():
    model = build_muse_spark(CONFIG, seed=5).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # no tensor left at a constant (norms 1, biases 0), so a swapped or dropped one shows
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("muse_full") / "hf"
    save_hf(model, path, max_shard_bytes=40_000)  # several shards + index
    return path


def test_full_round_trip_is_bitwise_and_the_audit_covers_every_tensor(hf_dir, tmp_path, capsys):
    source = all_tensors(hf_dir)
    assert {name: tuple(t.shape) for name, t in source.items()} == expected_hf_shapes(CONFIG)
    towers = [name for name in source if name.startswith(TOWER_PREFIXES)]
    assert len(towers) == 79 and {name.split(".")[1] for name in towers} == {
        "vision_tower", "multi_modal_projector", "audio_tower", "audio_projector"}
    assert main(["convert", "import", "--full", str(hf_dir), str(tmp_path / "native")]) == 0
    manifest = json.loads((tmp_path / "native" / "openrecipes.json").read_text())
    assert manifest["mode"] == "full" and manifest["skipped"] == 0
    assert set(manifest["tensors"]) == {name for name, _ in build_muse_spark(CONFIG, device="meta").named_parameters()}
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "back")]) == 0
    back = all_tensors(tmp_path / "back")
    assert back.keys() == source.keys()
    for name in source:
        assert source[name].dtype == back[name].dtype, name
        assert torch.equal(source[name].view(torch.uint8), back[name].view(torch.uint8)), name
    capsys.readouterr()
    assert main(["convert", "audit", "--json", str(hf_dir), str(tmp_path / "back")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["compared"] == len(source) and not report["missing"] + report["extra"]
    assert report["elements"] == sum(t.numel() for t in source.values())


def test_text_only_mode_stays_the_default(model, hf_dir, tmp_path, capsys):
    with pytest.warns(UserWarning, match="skipped 79 tensor"):
        assert main(["convert", "import", str(hf_dir), str(tmp_path / "native")]) == 0
    assert "79 tower tensor(s) skipped (text-only mode)" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "native" / "openrecipes.json").read_text())
    assert manifest["mode"] == "text-only" and manifest["skipped"] == 79
    assert all(name.startswith("model.language_model.") or name == "lm_head.weight" for name in manifest["tensors"])
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "text")]) == 0
    source = all_tensors(hf_dir)
    assert all_tensors(tmp_path / "text").keys() == {n for n in source if not n.startswith(TOWER_PREFIXES)}
    with pytest.warns(UserWarning, match="skipped 79"):
        text = openrecipes.from_hf(hf_dir)
    assert not hasattr(text.model, "vision_tower") and text.config.vision is None


def _inputs():
    generator = torch.Generator().manual_seed(1)
    text = lambda n: torch.randint(0, 200, (n,), generator=generator).tolist()  # noqa: E731
    # an image of 4x6 patches (6 tokens), a video of 2 slices of 2x2 patches (2 tokens), a clip of 200 samples
    row = text(3) + [250] * 6 + text(2) + [251] * 2 + text(2) + [252] * 24 + text(3)
    width = 3 * 2 * 4 * 4
    return torch.tensor([row]), dict(
        pixel_values=torch.randn(24, width, generator=generator), image_grid_thw=torch.tensor([[1, 4, 6]]),
        pixel_values_videos=torch.randn(8, width, generator=generator), video_grid_thw=torch.tensor([[2, 2, 2]]),
        audio_values=torch.randn(1, 200, generator=generator), audio_lengths=torch.tensor([200]))


def test_from_hf_full_gives_identical_logits_with_every_modality(model, hf_dir):
    loaded = openrecipes.from_hf(hf_dir, full=True)
    mine = dict(model.named_parameters())
    assert {name: (p.dtype, p.shape) for name, p in loaded.named_parameters()} == {
        name: (p.dtype, p.shape) for name, p in mine.items()}
    assert all(torch.equal(p, mine[name]) for name, p in loaded.named_parameters())
    ids, media = _inputs()
    with torch.no_grad():
        expected = model(ids, **{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in media.items()})
        got = loaded(ids, **{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in media.items()})
    assert torch.equal(expected, got)


def test_full_mode_names_an_unknown_tower_tensor(hf_dir, tmp_path):
    extra = tmp_path / "model-extra.safetensors"
    name = "model.vision_tower.blocks.0.attn.extra.weight"
    save_file({name: torch.zeros(2)}, str(extra))
    copy = tmp_path / "hf"
    copy.mkdir()
    for path in hf_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / extra.name).write_bytes(extra.read_bytes())
    index = json.loads((copy / INDEX_NAME).read_text())
    index["weight_map"][name] = extra.name
    (copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.vision_tower\.blocks\.0\.attn\.extra\.weight'"):
        openrecipes.from_hf(copy, full=True)
    with pytest.warns(UserWarning, match="skipped 80"):
        openrecipes.from_hf(copy)  # text-only mode skips every tower tensor
