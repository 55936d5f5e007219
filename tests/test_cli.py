"""Every verb registers, and `--help` works on every verb and sub-verb."""

import argparse
import subprocess
import sys

import pytest

from openrecipes.cli import VERB_MODULES, HelpFormatter, build_parser, main


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


def _verbs_and_actions(parser, path=("openrecipes",)):
    """(path, parser) of every verb at every level, and (path, action) of every flag and argument."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield "verb", (*path, name), sub
                yield from _verbs_and_actions(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS:
            yield "action", path, action


def test_every_verb_and_flag_is_described_with_its_default():
    for kind, path, item in _verbs_and_actions(build_parser()):
        if kind == "verb":
            assert item.description, " ".join(path)
            continue
        name = "/".join(item.option_strings) or item.dest
        assert item.help, f"{' '.join(path)} {name}: no help"
        shown = item.default not in (None, False, [], (), argparse.SUPPRESS)
        if shown:  # what --help prints for it names the default
            rendered = HelpFormatter(prog="x")._get_help_string(item) % {"default": item.default}
            assert "default" in rendered.lower(), f"{' '.join(path)} {name}: default {item.default!r} not shown"


def test_help_of_a_verb_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "(default: 1)" in capsys.readouterr().out  # --nproc


def test_json_piped_to_a_closed_reader_ends_quietly(tmp_path):
    import subprocess
    import sys

    # the reader is gone before the command writes, as with `openrecipes models --json | head -c 1`
    process = subprocess.Popen([sys.executable, "-m", "openrecipes", "models", "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err.decode()
    assert process.returncode == 141


# flags about something else than which GPU: its memory, how many per node, its price
_NOT_THE_GPU_TYPE = {"--gpu-memory-gib", "--gpu-memory-gb", "--gpus-per-node", "--usd-per-gpu-hour"}


def test_one_spelling_of_the_gpu_across_verbs():
    seen = set()
    for kind, path, item in _verbs_and_actions(build_parser()):
        if kind != "action":
            continue
        names = [name for name in item.option_strings if name.startswith("--gpu") and name not in _NOT_THE_GPU_TYPE]
        if not names:
            continue
        main_name, *aliases = names
        assert main_name in ("--gpu", "--gpus"), f"{' '.join(path)} {main_name}"
        assert item.metavar == {"--gpu": "TYPE", "--gpus": "COUNTxTYPE"}[main_name], f"{' '.join(path)} {main_name}"
        assert all(alias in item.help and "deprecated" in item.help for alias in aliases), item.help
        seen.add((path[1], main_name))
    assert {("plan", "--gpus"), ("tune", "--gpus"), ("measure", "--gpu"), ("card", "--gpu")} <= seen
    # the older spelling of card new still parses, to the same place
    args = build_parser().parse_args(["card", "new", "RUN", "--reference", "R", "--out", "o.yaml", "--author", "a",
                                      "--gpu-type", "h200"])
    assert args.gpu == "h200"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"], ["plan", "--help"]])
def test_help_and_version_import_no_torch(argv):
    """Every verb registers without torch (it loads inside the verb that runs), so --help and --version answer
    in well under a second instead of the seconds torch's import takes."""
    code = ("import sys\nfrom openrecipes.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'pyarrow', 'transformers') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in result.stderr, result.stderr[-2000:]
