"""The loss-mask names have one definition (config.recipe.LossMaskName); every message listing them reads it."""

from typing import get_args

import pytest

from openrecipes.cli import main
from openrecipes.config.recipe import LossMaskName
from openrecipes.data.templates import LOSS_MASKS, get_loss_mask


def test_every_name_the_recipe_accepts_has_a_format():
    assert list(LOSS_MASKS) == list(get_args(LossMaskName))
    assert all(LOSS_MASKS[name].name == name for name in LOSS_MASKS)


def test_the_cli_offers_every_format_and_the_recipes_default(tmp_path, capsys):
    from openrecipes.config.recipe import DataBuild

    with pytest.raises(SystemExit):
        main(["data", "build", "--loss-mask", "llama", "--row-tokens", "64", "--out", str(tmp_path / "rows")])
    err = capsys.readouterr().err
    assert "--loss-mask" in err and all(name in err for name in LOSS_MASKS), err
    assert not (tmp_path / "rows").exists()
    with pytest.raises(SystemExit):
        main(["data", "build", "--help"])
    default = DataBuild.model_fields["loss_mask"].default
    assert f"(default: {default})" in " ".join(capsys.readouterr().out.split())


def test_an_unknown_loss_mask_lists_every_format():
    with pytest.raises(ValueError) as error:
        get_loss_mask("llama")
    assert all(name in str(error.value) for name in LOSS_MASKS)
