"""A run whose recipe builds its rows (data.build) records what the build read; a resume after the input, the
tokenizer or a chat template file changed is refused in one line naming it, instead of training on rows the recipe
no longer builds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from openrecipes.cli import main
from openrecipes.config.recipe import DataBuild
from openrecipes.data.bundled import CONVERSATIONS, TOKENIZER
from openrecipes.data.manifest import BUILD_INPUTS_FILE, check_build_inputs, input_sha256


@pytest.fixture()
def inputs(tmp_path) -> tuple[Path, Path]:
    """A copy of the bundled conversations and tokenizer, which the tests may change."""
    shutil.copy(CONVERSATIONS, tmp_path / "conversations.jsonl")
    shutil.copytree(TOKENIZER, tmp_path / "tokenizer")
    return tmp_path / "conversations.jsonl", tmp_path / "tokenizer"


def _spec(inputs: tuple[Path, Path], **fields) -> DataBuild:
    return DataBuild(input=str(inputs[0]), tokenizer=str(inputs[1]), row_tokens=64, rows=8, **fields)


def _drop_last_conversation(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))


def test_the_first_call_records_and_later_calls_check(inputs, tmp_path):
    rows = tmp_path / "rows"
    rows.mkdir()
    spec = _spec(inputs)
    check_build_inputs(spec, rows)
    recorded = json.loads((rows / BUILD_INPUTS_FILE).read_text())["inputs"]
    assert recorded["data.build.input"] == {"path": str(inputs[0]), "sha256": input_sha256(inputs[0])}
    assert set(recorded) == {"data.build.input", "data.build.tokenizer"}
    check_build_inputs(spec, rows)  # nothing changed: passes

    _drop_last_conversation(inputs[0])
    with pytest.raises(ValueError, match=rf"^data\.build\.input: {inputs[0]} has sha256 [0-9a-f]{{64}}, the rows in "
                                         rf"{rows} were built from sha256 {recorded['data.build.input']['sha256']}"):
        check_build_inputs(spec, rows)


def test_a_changed_tokenizer_file_and_a_missing_input_are_named(inputs, tmp_path):
    rows = tmp_path / "rows"
    rows.mkdir()
    spec = _spec(inputs)
    check_build_inputs(spec, rows)
    config = inputs[1] / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 7}', 1))
    with pytest.raises(ValueError, match=rf"^data\.build\.tokenizer: {inputs[1]} has sha256"):
        check_build_inputs(spec, rows)
    shutil.copytree(TOKENIZER, inputs[1], dirs_exist_ok=True)  # restored: passes again
    check_build_inputs(spec, rows)
    inputs[0].unlink()
    with pytest.raises(ValueError, match=rf"^data\.build\.input: {inputs[0]} is missing, the rows in"):
        check_build_inputs(spec, rows)


def test_a_chat_template_file_is_an_input(inputs, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text((TOKENIZER / "chat_template.jinja").read_text())
    rows = tmp_path / "rows"
    rows.mkdir()
    spec = _spec(inputs, chat_template=str(template))
    check_build_inputs(spec, rows)
    template.write_text(template.read_text() + "\n")
    with pytest.raises(ValueError, match=rf"^data\.build\.chat_template: {template} has sha256"):
        check_build_inputs(spec, rows)


@pytest.mark.parametrize("field, value", [("row_tokens", 32), ("seed", 7), ("format", "pretrain"),
                                          ("chat_template", "muse_spark"), ("template_kwargs", {"x": "y"})])
def test_rows_another_build_made_are_refused_by_the_setting(inputs, tmp_path, field, value):
    """Settings are recorded beside the inputs: rows built with other settings are another build's, even where
    every input is the same (a built-in template's name is a setting, not a file)."""
    rows = tmp_path / "rows"
    rows.mkdir()
    check_build_inputs(_spec(inputs), rows)
    other = _spec(inputs).model_copy(update={field: value})
    with pytest.raises(ValueError, match=rf"^data\.build\.{field}: the rows in {rows} were built with {field}="):
        check_build_inputs(other, rows)
    check_build_inputs(_spec(inputs), rows)  # the same settings still pass


def test_a_record_without_settings_checks_the_inputs_only(inputs, tmp_path):
    """Rows recorded before the settings were: their inputs are still checked, their settings cannot be."""
    rows = tmp_path / "rows"
    rows.mkdir()
    check_build_inputs(_spec(inputs), rows)
    record = json.loads((rows / BUILD_INPUTS_FILE).read_text())
    del record["settings"]
    (rows / BUILD_INPUTS_FILE).write_text(json.dumps(record))
    check_build_inputs(_spec(inputs).model_copy(update={"seed": 7}), rows)
    _drop_last_conversation(inputs[0])
    with pytest.raises(ValueError, match=r"^data\.build\.input: "):
        check_build_inputs(_spec(inputs), rows)


def test_a_damaged_record_is_named(inputs, tmp_path):
    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / BUILD_INPUTS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=rf"{rows / BUILD_INPUTS_FILE}: damaged record of the build's inputs"):
        check_build_inputs(_spec(inputs), rows)


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_train_resume_refuses_a_changed_input(inputs, tmp_path, capsys, one_thread):
    run_dir = tmp_path / "run"
    recipe = {"model": "qwen3-moe-tiny", "layout": {"max_tokens_per_gpu": 128}, "precision": "fp32", "steps": 2,
              "global_batch": 4, "run_dir": str(run_dir), "logging": {"progress": False},
              "data": {"build": {"input": str(inputs[0]), "tokenizer": str(inputs[1]), "row_tokens": 64,
                                 "rows": 16}}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path), "--stop-after", "0"]) == 0
    assert (run_dir / "rows" / BUILD_INPUTS_FILE).is_file()
    capsys.readouterr()

    _drop_last_conversation(inputs[0])
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"data.build.input: {inputs[0]} has sha256" in err, err
    assert "resuming from" not in err
