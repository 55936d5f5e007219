"""Trained weights out: a training save as a Hugging Face directory that transformers loads with the engine's logits."""

import json

import pytest
import torch

from openrecipes.checkpoint.hf import save_hf
from openrecipes.checkpoint.safe_load import load_dcp
from openrecipes.cli import main
from openrecipes.data.bundled import TOKENIZER
from openrecipes.models.families import family_for_config
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config
from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.train import engine
from openrecipes.checkpoint.training_save import latest_checkpoint
from openrecipes.train.loop import train


@pytest.fixture(scope="module")
def source_hf(tmp_path_factory):
    """A tiny HF directory with a generation_config.json, the model a run starts from."""
    path = tmp_path_factory.mktemp("source") / "hf"
    save_hf(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=5), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7}) + "\n")
    return path


@pytest.fixture()
def trained(make_recipe, source_hf):
    recipe = make_recipe(model=str(source_hf), init="checkpoint", steps=3, checkpoint__export_hf=True)
    return recipe, train(recipe, command="test")


def engine_logits(recipe, ckpt, ids):
    """The engine's own model with the save's weights (the trained state, as a resume would load it)."""
    config = recipe_model_config(recipe)
    model = family_for_config(config).build(config, device="cpu", dtype=torch.float32, seed=0)
    state = {"model": model.state_dict()}
    load_dcp(state, ckpt, no_dist=True)
    with torch.no_grad():
        return model(ids)


def test_train_exports_what_transformers_loads_with_the_engines_logits(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe, run_dir = trained
    hf = run_dir / "hf"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the files the rows were built with
        assert (hf / name).read_bytes() == (TOKENIZER / name).read_bytes()
    assert json.loads((hf / "generation_config.json").read_text())["temperature"] == 0.7
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager",
                                                 use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    ids = torch.tensor([tokenizer.encode("Hello there, how are you doing today?")])
    with torch.no_grad():
        theirs = model(ids).logits
    ours = engine_logits(recipe, latest_checkpoint(run_dir), ids)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # the trained weights, not the starting point
    start = AutoModelForCausalLM.from_pretrained(recipe.model, dtype=torch.float32, attn_implementation="eager",
                                                 use_safetensors=True).eval()
    with torch.no_grad():
        assert not torch.allclose(start(ids).logits, theirs)


def test_convert_export_accepts_a_training_save(trained, tmp_path):
    from safetensors.torch import load_file

    _, run_dir = trained
    ckpt = latest_checkpoint(run_dir)
    assert main(["convert", "export", str(ckpt), str(tmp_path / "out"), "--max-shard-gib", "0.0002"]) == 0
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    exported = {k: v for shard in shards for k, v in load_file(shard).items()}
    single = load_file(run_dir / "hf" / "model.safetensors")
    assert exported.keys() == single.keys()
    assert all(torch.equal(exported[k], single[k]) for k in single)


def test_bf16_recipe_exports_bf16_except_pinned_tensors(make_recipe, tmp_path):
    from safetensors.torch import load_file

    run_dir = train(make_recipe(steps=1, precision="bf16"), command="test")
    out = tmp_path / "bf16"
    assert main(["convert", "export", str(latest_checkpoint(run_dir)), str(out)]) == 0
    dtypes = {t.dtype for t in load_file(out / "model.safetensors").values()}
    assert dtypes == {torch.bfloat16}


def test_a_save_that_is_not_the_recipes_model_is_refused(trained, tmp_path, capsys):
    recipe, run_dir = trained
    text = (run_dir / "recipe.yaml").read_text()
    (run_dir / "recipe.yaml").write_text(text.replace("model_overrides: {}", "model_overrides: {num_hidden_layers: 2}"))
    assert main(["convert", "export", str(latest_checkpoint(run_dir)), str(tmp_path / "x")]) == 2
    assert "has changed since the run" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_changed_tokenizer_is_named(make_recipe, rows_dir, tmp_path, capsys):
    import shutil

    rows = tmp_path / "rows"
    shutil.copytree(rows_dir, rows)
    tokenizer = tmp_path / "tok"
    shutil.copytree(TOKENIZER, tokenizer)
    manifest = json.loads((rows / "manifest.json").read_text())
    manifest["tokenizer"]["directory"] = str(tokenizer)
    (rows / "manifest.json").write_text(json.dumps(manifest))
    run_dir = train(make_recipe(steps=1, data__rows=str(rows)), command="test")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    assert main(["convert", "export", str(latest_checkpoint(run_dir)), str(tmp_path / "x")]) == 2
    assert "tokenizer_config.json has changed since the rows were built" in capsys.readouterr().err


def test_export_hf_needs_the_last_save(make_recipe):
    with pytest.raises(ValueError, match="export_hf needs at_end"):
        make_recipe(checkpoint__export_hf=True, checkpoint__at_end=False)


def test_an_export_of_a_registry_model_stops_at_the_chat_end_and_is_readable(make_recipe, tmp_path):
    import os
    import stat

    from transformers import AutoTokenizer, GenerationConfig

    run_dir = train(make_recipe(steps=1), command="test")  # qwen3-moe-tiny: its config names no token ids
    out = tmp_path / "export"
    old = os.umask(0o022)
    try:
        assert main(["convert", "export", str(latest_checkpoint(run_dir)), str(out)]) == 0
    finally:
        os.umask(old)
    tokenizer = AutoTokenizer.from_pretrained(out)
    im_end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == im_end
    generation = GenerationConfig.from_pretrained(out)
    assert im_end in generation.eos_token_id and generation.pad_token_id == pad
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
