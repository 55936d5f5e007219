import argparse

import pytest
from .card_fixtures import CATALOG, line_of

from openrecipes.cards.checks import half_unit
from openrecipes.cards.cli import _validate
from openrecipes.cards.validate import CardError, load_card, validate_paths


def errors_of(path):
    _, problems = validate_paths([path])
    return [p for p in problems if p.severity == "error"]


def only_error(path):
    errors = errors_of(path)
    assert len(errors) == 1, [str(e) for e in errors]
    return errors[0]


def test_unchanged_copy_is_valid(qwen, write_card):
    assert errors_of(write_card(qwen)) == []


def test_wrong_type_names_field_path_file_and_line(qwen, write_card):
    qwen["layout"]["tp"] = "1"
    path = write_card(qwen)
    with pytest.raises(CardError) as caught:
        load_card(path)
    (problem,) = caught.value.problems
    assert problem.path == "layout.tp"
    assert problem.file == str(path)
    assert problem.line == line_of(path, "  tp: '1'")
    assert str(problem).startswith(f"{path}:{problem.line}: layout.tp:")


def test_unknown_key_is_an_error(qwen, write_card):
    qwen["layout"]["tpp"] = 1
    problem = only_error(write_card(qwen))
    assert problem.path == "layout.tpp"
    assert "unknown field" in problem.message


def test_nested_list_path_and_missing_field(qwen, write_card):
    qwen["correctness"]["component_tests"][0]["result"] = "maybe"
    del qwen["result"]["window_tokens"]
    paths = {p.path for p in errors_of(write_card(qwen))}
    assert paths == {"correctness.component_tests[0].result", "result.window_tokens"}


def test_inconsistent_mfu(qwen, write_card):
    qwen["result"]["mfu"] = 0.15
    problem = only_error(write_card(qwen))
    assert problem.path == "result.mfu"
    assert "0.1275" in problem.message  # the computed value is shown


def test_mfu_coarser_than_one_percent_is_rejected(qwen, write_card):
    qwen["result"]["mfu"] = 0.1  # "within rounding" of one decimal, but off by 22%
    assert only_error(write_card(qwen)).path == "result.mfu"


def test_gpu_count_must_equal_tp_pp_cp_dp(qwen, write_card):
    qwen["gpu"]["count"] = 16
    problem = only_error(write_card(qwen))
    assert problem.path == "layout"
    assert "tp·pp·cp·dp" in problem.message and "16" in problem.message


def test_expert_parallel_must_fold_onto_the_ranks(qwen, write_card):
    qwen["layout"]["ep"] = 16
    assert only_error(write_card(qwen)).path == "layout.ep"


def test_window_tokens(qwen, write_card):
    qwen["result"]["window_tokens"] = 15728640 + 8192
    assert only_error(write_card(qwen)).path == "result.window_tokens"
    qwen["result"]["window_tokens"] = 15728640
    qwen["result"]["window"] = [5, 20]
    assert only_error(write_card(qwen)).path == "result.window"


def test_price_at_the_instance_price(qwen, write_card):
    qwen["result"]["usd_per_million_tokens"] = 0.40
    problem = only_error(write_card(qwen))
    assert problem.path == "result.usd_per_million_tokens"
    # a card may state its own price, which then decides
    qwen["result"]["usd_per_gpu_hour"] = 10.0
    assert errors_of(write_card(qwen)) == []


def test_price_band_for_an_unknown_instance(qwen, write_card):
    qwen["gpu"]["instance"] = "on-premises cluster"
    assert errors_of(write_card(qwen)) == []
    qwen["result"]["usd_per_million_tokens"] = 30.0  # ~750 USD per GPU-hour
    assert only_error(write_card(qwen)).path == "result.usd_per_million_tokens"


def test_layer_split_must_add_up(muse, write_card):
    assert errors_of(write_card(muse)) == []
    muse["layout"]["layer_split"]["first"] = 4
    problem = only_error(write_card(muse))
    assert problem.path == "layout.layer_split" and "62" in problem.message


def test_unknown_model_skips_layer_check_with_a_note(qwen, write_card):
    qwen["model"] = "Some-Other-MoE"
    _, problems = validate_paths([write_card(qwen)])
    assert [p.severity for p in problems] == ["note"]
    assert problems[0].path == "layout.layer_split"


@pytest.mark.parametrize("where", ["dataset", "active_params", "tokenizer"])
def test_verified_card_needs_pinned_revisions(qwen, write_card, where):
    if where == "dataset":
        qwen["workload"]["dataset"]["revision"], expected = "main", "workload.dataset.revision"
    elif where == "active_params":
        qwen["result"]["active_params"]["revision"], expected = "ad44e77", "result.active_params.revision"
    else:
        build = qwen["workload"]["dataset"]["build"]
        build["tokenizer"] = build["tokenizer"].replace("9216db5781bf21249d130ec9da846c4624c16137", "unpinned")
        expected = "workload.dataset.build.tokenizer"
    problem = only_error(write_card(qwen))
    assert problem.path == expected and "pinned" in problem.message
    qwen["status"] = "unverified"
    assert errors_of(write_card(qwen)) == []


def test_verified_card_needs_passing_correctness_and_a_run(qwen, write_card):
    qwen["correctness"]["result"] = "fail"
    qwen["correctness"]["convergence"]["result"] = "fail"
    qwen["run"] = "  \n"
    paths = {p.path for p in errors_of(write_card(qwen))}
    assert paths == {"correctness.result", "correctness.convergence.result", "run"}


def test_pass_must_agree_with_the_thresholds(qwen, write_card):
    qwen["correctness"]["convergence"]["correlation"] = 0.9
    assert only_error(write_card(qwen)).path == "correctness.convergence.correlation"


def test_nan_is_not_a_measurement(qwen, write_card):
    qwen["result"]["tokens_per_s_per_gpu"] = float("nan")
    with pytest.raises(CardError) as caught:
        load_card(write_card(qwen))
    assert caught.value.problems[0].path == "result.tokens_per_s_per_gpu"


def test_half_unit():
    assert half_unit(0.0898) == pytest.approx(5e-5)
    assert half_unit(6913.23) == pytest.approx(5e-3)
    assert half_unit(7.96e-7) == pytest.approx(5e-10)
    assert half_unit(3.0) == pytest.approx(0.5)


def test_cli_walks_directories_and_fails_on_any_error(qwen, write_card, capsys, tmp_path):
    write_card(qwen, "a/ok.yaml")
    qwen["layout"]["dp"] = "8"
    bad = write_card(qwen, "a/b/bad.yaml")
    (tmp_path / "a" / "readme.txt").write_text("not a card")
    assert _validate(argparse.Namespace(paths=[tmp_path / "a"], quiet=False)) == 1
    captured = capsys.readouterr()
    assert f"{bad}:{line_of(bad, 'dp:')}: layout.dp:" in captured.err
    assert "2 card(s) checked, 1 with errors" in captured.out


def test_cli_passes_on_the_catalog(capsys):
    assert _validate(argparse.Namespace(paths=[CATALOG], quiet=True)) == 0


def test_cli_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        _validate(argparse.Namespace(paths=[tmp_path / "nope"], quiet=False))


def test_a_throughput_above_the_peak_is_an_error(qwen, write_card):
    qwen["result"]["tokens_per_s_per_gpu"] *= 10  # ten times the seed card's: an MFU of over 100 %
    qwen["result"].pop("mfu", None)
    qwen["result"].pop("usd_per_million_tokens", None)
    problems = [p for p in errors_of(write_card(qwen)) if p.path == "result.tokens_per_s_per_gpu"]
    assert problems and "above 100 %" in problems[0].message


def test_a_verified_card_on_an_unknown_gpu_states_its_peak(qwen, write_card):
    qwen["status"] = "verified"
    qwen["gpu"]["type"] = "X900"
    qwen["gpu"]["instance"] = None
    assert "gpu.type" in [p.path for p in errors_of(write_card(qwen))]
    qwen["gpu"]["peak_bf16_dense_flops"] = 989e12
    assert "gpu.type" not in [p.path for p in errors_of(write_card(qwen))]


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.patch", "patches/../../x.patch", "C:/x.patch"])
def test_a_patch_outside_the_repository_is_an_error(qwen, write_card, path):
    qwen["patches"] = [{"path": path, "sha256": "0" * 64, "description": "a patch"}]
    assert "patches[0].path" in [p.path for p in errors_of(write_card(qwen))]


def test_a_one_step_window_has_no_spread_and_a_verified_window_skips_step_0(qwen, write_card):
    qwen["result"]["window"] = [0, 0]
    qwen["result"]["window_tokens"] = qwen["workload"]["global_batch"] * qwen["workload"]["row_tokens"]
    errors = {e.path: e.message for e in errors_of(write_card(qwen))}
    assert "one step time has no spread" in errors["result.step_time_cv_percent"], errors
    assert "warm-up" in errors["result.window"], errors
