"""Every verb registers, and `--help` works on every verb and sub-verb."""

import argparse

import pytest

from openrecipes.cli import VERB_MODULES, build_parser, main


def _all_help_paths():
    parser = build_parser()
    paths = []

    def walk(p, prefix):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    paths.append(prefix + [name])
                    walk(sub, prefix + [name])

    walk(parser, [])
    return paths


def test_every_registered_verb_is_reachable():
    top_level = {path[0] for path in _all_help_paths()}
    assert top_level == set(VERB_MODULES)


@pytest.mark.parametrize("path", _all_help_paths(), ids=lambda p: " ".join(p))
def test_help(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_models_table_lists_active_params(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "3,041,656,832" in out
