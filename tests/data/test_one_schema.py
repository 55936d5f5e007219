"""The data-build options have one schema, the recipe's ``data.build`` (config/recipe.py: ``DataBuild``): the CLI's
flags are its fields, with its choices and defaults; the kernel names have one pydantic-free home."""

import argparse
import ast
import typing
from pathlib import Path

import pytest

from openrecipes.config import kernel_names
from openrecipes.config.recipe import DataBuild, Kernels
from openrecipes.data import cli as data_cli

SRC = Path(__file__).resolve().parents[2] / "src" / "openrecipes"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers(dest="verb"))
    return parser


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def test_every_recipe_key_is_a_flag_with_the_recipes_choices():
    build = _subparser(_build_parser(), "data", "build")
    by_dest = {action.dest: action for action in build._actions}
    for name, field in DataBuild.model_fields.items():
        action = by_dest[name]
        literal = [a for a in (field.annotation, *typing.get_args(field.annotation))
                   if typing.get_origin(a) is typing.Literal]
        if literal and typing.get_origin(field.annotation) is not dict:
            assert list(action.choices) == list(typing.get_args(literal[0])), name
        assert action.default is argparse.SUPPRESS, f"{name}: the default is the recipe's, not the parser's"


def test_flags_not_given_take_the_recipes_defaults_and_bad_ones_are_named(tmp_path):
    parser = _build_parser()
    args = parser.parse_args(["data", "build", "--row-tokens", "64", "--out", str(tmp_path)])
    assert data_cli.spec_from_args(args) == DataBuild(row_tokens=64)
    args = parser.parse_args(["data", "build", "--row-tokens", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="^--row-tokens: "):
        data_cli.spec_from_args(args)
    args = parser.parse_args(["data", "build", "--format", "pretrain", "--chat-template", "qwen3", "--row-tokens", "8",
                              "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="^--chat-template apply to format sft only"):
        data_cli.spec_from_args(args)
    args = parser.parse_args(["data", "build", "x.jsonl", "--row-tokens", "8", "--template-kwargs", "think=false",
                              "--role-map", "developer=system", "--out", str(tmp_path)])
    spec = data_cli.spec_from_args(args)
    assert (spec.input, spec.template_kwargs, spec.role_map) == ("x.jsonl", {"think": False}, {"developer": "system"})


def _imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_sft_and_pretraining_builds_share_a_third_module_not_each_other():
    assert "openrecipes.data.build" not in _imported(SRC / "data" / "pretrain.py")
    assert "openrecipes.data.packed" in _imported(SRC / "data" / "pretrain.py") & _imported(SRC / "data" / "build.py")


def test_kernel_names_have_one_pydantic_free_home():
    assert not any(module.startswith("pydantic") for module in _imported(SRC / "config" / "kernel_names.py"))
    assert typing.get_args(Kernels.model_fields["attention"].annotation) == kernel_names.ATTENTION_BACKENDS
    assert typing.get_args(Kernels.model_fields["experts"].annotation) == kernel_names.EXPERT_BACKENDS
