"""Inputs that used to end in a traceback get one clear line naming the file, line or field."""

import json
from pathlib import Path

import pytest
import torch

from openrecipes.cli import main
from openrecipes.parallel.mesh import single_process

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3-sft.yaml"


def _example_recipe(*overrides):
    """The tiny example recipe loaded with ``--set`` ``overrides``."""
    from openrecipes.config.recipe import load_recipe

    return load_recipe(EXAMPLE, list(overrides))


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_a_lone_surrogate_names_the_line(tmp_path, capsys):
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "a\udc80b"},
                                               {"role": "assistant", "content": "x"}]}) + "\n")
    code, err = _run(capsys, "data", "build", str(source), "--loss-mask", "qwen3", "--row-tokens", "64",
                     "--out", str(tmp_path / "rows"), "--no-progress")
    assert code == 2 and "line 1" in err and "surrogate" in err


def test_deeply_nested_json_names_the_line(tmp_path, capsys):
    source = tmp_path / "c.jsonl"
    source.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    code, err = _run(capsys, "data", "build", str(source), "--loss-mask", "qwen3", "--row-tokens", "64",
                     "--out", str(tmp_path / "rows"), "--no-progress")
    assert code == 2 and "line 1" in err and "nested too deeply" in err


def test_a_400_digit_loss_names_the_file_and_line(tmp_path, capsys):
    big, ok = tmp_path / "big.jsonl", tmp_path / "ok.jsonl"
    big.write_text('{"step": 0, "loss": 1' + "0" * 400 + '}\n{"step": 1, "loss": 2.0}\n')
    ok.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 2.0}\n')
    code, err = _run(capsys, "verify", "convergence", str(big), str(ok))
    assert code == 2 and "big.jsonl:1" in err and "too large" in err


def test_an_override_of_the_wrong_type_names_the_field():
    from openrecipes.checkpoint.hf import recipe_model_config
    from openrecipes.config.recipe import recipe_from_dict

    tree = {"model": "qwen3-moe-tiny", "data": {"rows": "rows"}, "layout": {"max_tokens_per_gpu": 64},
            "steps": 1, "global_batch": 1, "model_overrides": {"num_hidden_layers": "abc"}}
    with pytest.raises(ValueError, match=r"model_overrides\.num_hidden_layers: expected an integer"):
        recipe_model_config(recipe_from_dict(tree))


def test_a_run_dir_too_long_for_a_path_is_refused():
    from openrecipes.config.recipe import recipe_from_dict

    tree = {"model": "qwen3-moe-tiny", "data": {"rows": "rows"}, "layout": {"max_tokens_per_gpu": 64},
            "steps": 1, "global_batch": 1, "run_dir": "x" * 5000}
    with pytest.raises(ValueError, match="run_dir.*too long"):
        recipe_from_dict(tree)


def test_weights_that_cannot_fit_are_refused_before_allocating():
    from openrecipes.checkpoint.hf import recipe_model_config
    from openrecipes.config.recipe import recipe_from_dict
    from openrecipes.train.engine import check_weights_fit

    tree = {"model": "qwen3-moe-tiny", "data": {"rows": "rows"}, "layout": {"max_tokens_per_gpu": 64},
            "steps": 1, "global_batch": 1, "model_overrides": {"num_experts": 1_000_000_000}}
    recipe = recipe_from_dict(tree)
    with pytest.raises(ValueError, match=r"model_overrides: [\d,]+ parameters need"):
        check_weights_fit(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))


def _conversation(tmp_path, record):
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps(record) + "\n")
    return source


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": "no"}]},
     "'tool_calls' must be a list of objects"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], "tools": "no"},
     "'tools' must be a list of objects"),
])
def test_tool_fields_of_the_wrong_type_name_the_line(tmp_path, capsys, record, message):
    code, err = _run(capsys, "data", "build", str(_conversation(tmp_path, record)), "--loss-mask", "qwen3",
                     "--row-tokens", "64", "--out", str(tmp_path / "rows"), "--no-progress")
    assert code == 2 and "line 1" in err and message in err


@pytest.mark.parametrize("template, message", [("{% for x in %}\n", "chat template line 1"),
                                               ('{{ "".__class__.__mro__ }}\n', "unsafe")])
def test_a_broken_or_escaping_template_is_a_clear_error(tmp_path, capsys, template, message):
    path = tmp_path / "t.jinja"
    path.write_text(template)
    code, err = _run(capsys, "data", "build", "--loss-mask", "qwen3", "--row-tokens", "64", "--out",
                     str(tmp_path / "rows"), "--no-progress", "--chat-template", str(path))
    assert code == 2 and message in err and "Traceback" not in err


def test_a_list_as_a_yaml_key_names_the_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\n? [a, b]\n: 1\n")
    code, err = _run(capsys, "train", str(recipe))
    assert code == 2 and "r.yaml:2: a mapping key must be a plain scalar" in err


def test_an_invalid_date_names_its_card_and_line_and_the_others_are_still_checked(tmp_path, capsys):
    from pathlib import Path

    catalog = Path(__file__).resolve().parents[1] / "recipes"
    cards = sorted(catalog.rglob("*.yaml"))[:2]
    for index, card in enumerate(cards):
        text = card.read_text()
        if index == 0:
            text = text.replace(next(line for line in text.splitlines() if line.strip().startswith("measured:")),
                                "  measured: 2026-02-31")
        (tmp_path / f"card{index}.yaml").write_text(text)
    code = main(["card", "validate", str(tmp_path)])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code != 0 and "card0.yaml:" in text and "2026-02-31" in text and "2 card(s) checked" in text


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1.0e+400"])
def test_a_nonfinite_model_override_is_refused_by_key(tmp_path, value):
    from openrecipes.config.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text("model: qwen3-moe-tiny\ndata: {rows: /nowhere}\nlayout: {max_tokens_per_gpu: 128}\n"
                    f"steps: 3\nglobal_batch: 4\nmodel_overrides: {{rope_theta: {value}}}\n")
    with pytest.raises(ValueError, match=r"model_overrides: .*rope_theta: not a finite number"):
        load_recipe(path)
    path.write_text(path.read_text().replace(f"model_overrides: {{rope_theta: {value}}}\n", ""))
    with pytest.raises(ValueError, match=r"model_overrides: .*rope_theta: not a finite number"):
        load_recipe(path, [f"model_overrides.rope_theta={value}"])
    with pytest.raises(ValueError, match=r"model_overrides: .*rope_scaling\.factor: not a finite number"):
        load_recipe(path, [f"model_overrides.rope_scaling={{factor: {value}}}"])


def test_a_finite_model_override_is_kept_as_written():
    import yaml

    from openrecipes.config.recipe import dump_recipe, recipe_from_dict

    tree = {"model": "qwen3-moe-tiny", "data": {"rows": "rows"}, "layout": {"max_tokens_per_gpu": 64},
            "steps": 1, "global_batch": 1, "model_overrides": {"rope_theta": 20000.0}}
    assert yaml.safe_load(dump_recipe(recipe_from_dict(tree)))["model_overrides"] == {"rope_theta": 20000.0}


@pytest.mark.parametrize("override, message", [
    *[(f"data.build.template_kwargs={{{name}: x}}", f"data.build.template_kwargs: .*'{name}' is set by the builder")
      for name in ("messages", "tools", "bos_token", "eos_token", "add_generation_prompt", "namespace")],
    ('kernels.compile="yes"', "kernels.compile: Input should be a valid boolean"),
    ("kernels.compile=1", "kernels.compile: Input should be a valid boolean"),
    ('layout.sequence_parallel="false"', "layout.sequence_parallel: Input should be a valid boolean"),
    ("debug.profile_timeline=true", "debug: .*profile_timeline: true needs profile_step"),
])
def test_a_recipe_field_the_run_cannot_take_as_written_is_refused_by_name(override, message):
    with pytest.raises(ValueError, match=message):
        _example_recipe(override)


def _data_build(capsys, source, out):
    return _run(capsys, "data", "build", str(source), "--loss-mask", "qwen3", "--row-tokens", "64", "--out", str(out),
                "--no-progress")


def test_a_link_loop_or_a_name_too_long_is_one_line(tmp_path, capsys):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    code, err = _data_build(capsys, tmp_path / "a.jsonl", tmp_path / "rows")
    assert code == 2 and len(err.splitlines()) == 1 and "a.jsonl" in err, err
    code, err = _data_build(capsys, tmp_path / ("x" * 300 + ".jsonl"), tmp_path / "rows")
    assert code == 2 and len(err.splitlines()) == 1 and "File name too long" in err, err


@pytest.mark.parametrize("name", ["a\nopenrecipes data: error: all is well.jsonl", "t\x1b]0;pwned\x07\x1b[2J.jsonl"])
def test_a_hostile_file_name_can_neither_add_a_line_nor_drive_the_terminal(tmp_path, capsys, name):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / name).write_text("{bad json\n")
    code, err = _data_build(capsys, folder, tmp_path / "rows")
    assert code == 2 and len(err.splitlines()) == 1 and "\x1b" not in err and "\x07" not in err, err
    assert "malformed JSON" in err


@pytest.mark.parametrize("value,message", [
    ("{a: &a [1, 1], b: [*a, *a]}", "anchor '&a' is not allowed"),
    ("{x: " + "[" * 3000 + "]" * 3000 + "}", "nesting deeper than"),
    ("!!python/object/apply:os.system [true]", "is not allowed"),
])
def test_a_set_value_is_read_as_plain_data(tmp_path, capsys, monkeypatch, value, message):
    recipe = EXAMPLE
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, "train", str(recipe), "--set", f"model_overrides={value}")  # an alias bomb hung
    assert code == 2 and len(err.splitlines()) == 1 and message in err and "--set model_overrides" in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("edit,message", [
    (lambda text: "- a list\n", "a planner file is a mapping"),
    (lambda text: text.replace("dense_matmul: ", "dense_matmul: .nan #", 1), "efficiency.dense_matmul: must be a"),
    (lambda text: "x: !!python/object/apply:os.system [true]\n" + text, "is not allowed"),
])
def test_a_hostile_planner_file_is_one_line(tmp_path, capsys, edit, message):
    from openrecipes.plan.hardware import DEFAULT_PLANNER_FILE

    planner = tmp_path / "planner.yaml"
    planner.write_text(edit(DEFAULT_PLANNER_FILE.read_text()))
    code, err = _run(capsys, "plan", "qwen3-moe-tiny", "--gpus", "8xH200", "--top", "1", "--hardware", str(planner))
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("memory", ["nan", "inf"])
def test_a_gpu_memory_that_is_no_size_is_refused(capsys, memory):
    code, err = _run(capsys, "plan", "qwen3-moe-tiny", "--gpus", "8xH200", "--top", "1", "--gpu-memory-gib", memory)
    assert code == 2 and "--gpu-memory-gib: must be a positive number" in err, err


@pytest.mark.parametrize("overrides,message", [
    ({"num_hidden_layers": 10**9}, r"num_hidden_layers: expected 1 to 10,000"),  # built layer by layer: it hung
    ({"mlp_only_layers": ["a"]}, r"mlp_only_layers: expected tuple\[int, ...\], got \['a'\]"),
    ({"mlp_only_layers": 5}, r"mlp_only_layers: expected tuple\[int, ...\], got 5"),
    ({"sliding_window": "x"}, r"sliding_window: expected int \| None, got 'x'"),
])
def test_a_model_override_of_another_type_is_refused_by_name(overrides, message):
    from openrecipes.models.resolve import resolve_model_config

    with pytest.raises(ValueError, match=rf"model_overrides\.{message}"):
        resolve_model_config("qwen3-moe-tiny", overrides=overrides)


def test_a_list_override_of_a_tuple_field_stays_a_tuple():
    from openrecipes.models.resolve import resolve_model_config

    config = resolve_model_config("qwen3-moe-tiny", overrides={"mlp_only_layers": [0], "sliding_window": 64})
    assert config.mlp_only_layers == (0,) and config.sliding_window == 64


@pytest.mark.parametrize("value", [1e999, [1], "abc", -5, 2.5, True])
def test_a_rows_manifest_count_that_is_no_size_is_named(tmp_path, value):
    from openrecipes.data.manifest import MANIFEST_FILE, read_manifest

    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"row_tokens": value}))  # 1e999 reads as inf: a traceback
    with pytest.raises(ValueError, match=rf"{MANIFEST_FILE}: row_tokens: expected an integer of at least 1"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("override, message", [
    ("seed=1000000000000000000000000000000", "seed: Input should be less than or equal to"),
    ("global_batch=1099511627776", "global_batch: Input should be less than or equal to"),
    ("steps=1000000000000000000000000000000", "steps: Input should be less than or equal to"),
    ("distributed_timeout_minutes=1.0e+300", "distributed_timeout_minutes: Input should be less than or equal to"),
    ("moe.aux_loss_coef=1.0e+308", "moe.aux_loss_coef: Input should be less than or equal to 1"),
])
def test_a_size_past_any_run_is_refused_by_its_field(override, message):
    with pytest.raises(ValueError, match=message):  # each failed deep in the run, naming no field, or hung
        _example_recipe(override)


def test_epochs_past_any_run_are_refused():
    from openrecipes.config.epochs import steps_of_epochs

    with pytest.raises(ValueError, match=r"epochs 1e\+308: 64 rows in batches of 8 make more than 1,000,000,000"):
        steps_of_epochs(1e308, rows=64, global_batch=8)


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "1", "--node-rank", "5"], "--node-rank: must be below --nnodes (1), got 5"),
    (["--nproc", "0"], "--nproc: must be at least 1, got 0"),
])
def test_a_launch_count_out_of_range_writes_nothing(tmp_path, capsys, monkeypatch, argv, message):
    recipe = EXAMPLE
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, "train", str(recipe), *argv)  # it made the run directory, then named the rows
    assert code == 2 and message in err and not any(tmp_path.iterdir()), err


def test_plan_lora_without_targets_is_refused(capsys):
    code, err = _run(capsys, "plan", "qwen3-moe-tiny", "--gpus", "8xH200", "--lora-rank", "8", "--lora-targets", ",")
    assert code == 2 and "--lora-targets: name at least one module" in err, err


@pytest.mark.parametrize("override", ['run_dir="a\\0b"', 'data.build={input: "x\\0y", row_tokens: 8}'])
def test_a_nul_in_a_recipe_string_is_named_by_its_field(override):
    with pytest.raises(ValueError, match=r"(run_dir|data\.build\.input): holds a NUL character"):
        _example_recipe(override)


@pytest.mark.parametrize("overrides,message", [
    ({"rms_norm_eps": -1.0}, "rms_norm_eps: expected a number above 0"),  # each trained to a NaN at step 0
    ({"rope_theta": 0.0}, "rope_theta: expected a number above 0"),
    ({"eos_token_id": -5}, "eos_token_id: expected a number of at least 0"),  # each trained to the end
    ({"max_position_embeddings": -1}, "max_position_embeddings: expected a number above 0"),
])
def test_a_model_override_out_of_range_is_refused_by_name(overrides, message):
    from openrecipes.models.resolve import resolve_model_config

    with pytest.raises(ValueError, match=rf"model_overrides\.{message}"):
        resolve_model_config("qwen3-moe-tiny", overrides=overrides)


def test_a_recipe_that_is_a_pipe_is_refused_without_waiting(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "r.yaml")  # opening it for reading waited for a writer that never came
    code, err = _run(capsys, "train", str(tmp_path / "r.yaml"))
    assert code == 2 and "r.yaml: is not a regular file" in err, err


@pytest.mark.parametrize("argv, message", [
    (["verify", "convergence", "a.jsonl", "b.jsonl", "--correlation", "nan"], "correlation must be in [-1, 1], got nan"),
    (["verify", "optimizer", "--lr", "-1"], "argument --lr: -1 is not a finite number > 0"),
    (["verify", "optimizer", "--weight-decay", "nan"], "argument --weight-decay: nan is not a finite number >= 0"),
])
def test_a_verify_setting_out_of_range_is_refused(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)  # nan passed or failed every curve, --lr -1 passed the component test
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.9}\n')
    try:
        code, err = _run(capsys, *argv)
    except SystemExit as stop:  # argparse's own refusal
        code, err = stop.code, capsys.readouterr().err
    assert code == 2 and message in err, err


@pytest.mark.parametrize("content, message", [
    (b'{"step": 0, "loss": 1.0}\n{"step": 1, "loss": \xff}\n', r"a\.jsonl:2: not UTF-8 text"),
    (b'{"step": 0, "loss": 1.0}\n{"step": 1, "n": ' + b"9" * 5000 + b"}\n", r"a\.jsonl:2: unreadable JSON"),
])
def test_an_unreadable_json_line_is_named_by_file_and_line(tmp_path, content, message):
    from openrecipes.utils import iter_json_lines

    (tmp_path / "a.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        list(iter_json_lines(tmp_path / "a.jsonl"))


def test_a_csv_field_past_the_csv_limit_is_named(tmp_path):
    from openrecipes.verify.curves import read_csv_curve

    (tmp_path / "l.csv").write_text("step,loss\n0," + "9" * 200_000 + "\n")  # csv.Error was a traceback
    with pytest.raises(ValueError, match=r"l\.csv: unreadable CSV"):
        read_csv_curve(tmp_path / "l.csv")
