"""Hugging Face training argument names in a recipe (YAML or --set) are refused with what the recipe calls them."""

from pathlib import Path

import pytest
import yaml

from openrecipes.cli import main
from openrecipes.config.hf_names import HF_TRAINING_NAMES
from openrecipes.config.recipe import load_recipe

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"
OURS = {"learning_rate": "optimizer.lr", "num_train_epochs": "epochs", "warmup_steps": "optimizer.warmup_fraction",
        "per_device_train_batch_size": "global_batch", "max_seq_length": "data.build.row_tokens"}


@pytest.mark.parametrize("key", sorted(OURS))
def test_set_with_a_hugging_face_name_names_our_key(key, capsys):
    assert main(["train", str(EXAMPLE), "--set", f"{key}=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{key}: Extra inputs are not permitted" in err
    assert f"a recipe sets {OURS[key]}" in err


@pytest.mark.parametrize("key", sorted(HF_TRAINING_NAMES))
def test_a_yaml_key_with_a_hugging_face_name_names_our_key(key, tmp_path):
    tree = yaml.safe_load(EXAMPLE.read_text())
    tree[key] = 1
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ValueError) as error:
        load_recipe(path)
    assert str(error.value) == (f"{path}: {key}: Extra inputs are not permitted ({key} is a Hugging Face training "
                                f"argument; a recipe sets {HF_TRAINING_NAMES[key]})")


def test_the_hint_holds_inside_a_section_too():
    with pytest.raises(ValueError, match=r"optimizer\.learning_rate: .*a recipe sets optimizer\.lr\)$"):
        load_recipe(EXAMPLE, ["optimizer.learning_rate=1e-4"])


def test_every_named_key_exists_in_the_recipe():
    """The hints point at keys a recipe takes (the first word of each, a dotted path from the top)."""
    from openrecipes.config.recipe import Recipe

    for ours in set(HF_TRAINING_NAMES.values()):
        model = Recipe
        for part in ours.split()[0].split("."):
            assert part in model.model_fields, ours
            annotation = model.model_fields[part].annotation
            model = next((a for a in (annotation, *getattr(annotation, "__args__", ())) if hasattr(a, "model_fields")),
                         None)


@pytest.mark.parametrize("key, ours", [("r", "rank"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout"),
                                       ("target_modules", "targets")])
def test_peft_lora_names_get_the_recipe_key(key, ours):
    lora = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-lora.yaml"
    with pytest.raises(ValueError) as error:
        load_recipe(lora, [f"lora.{key}=16"])
    assert str(error.value) == (f"{lora}: lora.{key}: Extra inputs are not permitted (did you mean '{ours}'? PEFT's "
                                f"LoraConfig calls lora.{ours} {key})")
    load_recipe(lora, [f"lora.{ours}={'[q_proj]' if ours == 'targets' else 0 if ours == 'dropout' else 16}"])
