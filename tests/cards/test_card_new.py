"""`openrecipes card new`: a card from two tiny CPU runs, checked against measure, convergence and the site."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from openrecipes.cards.validate import load_card
from openrecipes.cli import main

WINDOW = (1, 5)


def _train(rows: Path, run_dir: Path, max_tokens_per_gpu: int) -> Path:
    from openrecipes.train.loop import train
    from openrecipes.config.recipe import recipe_from_dict

    tree = {
        "model": "qwen3-moe-tiny", "data": {"rows": str(rows)},
        "layout": {"max_tokens_per_gpu": max_tokens_per_gpu}, "precision": "fp32", "steps": 6, "global_batch": 4,
        "optimizer": {"lr": 3e-3, "warmup_fraction": 0.2, "min_lr": 3e-4, "weight_decay": 0.1},
        "run_dir": str(run_dir), "logging": {"progress": False}, "checkpoint": {"at_end": False},
    }
    return train(recipe_from_dict(tree), command=f"openrecipes train {run_dir.name}.yaml")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A candidate (2 rows per microbatch) and a reference (1 row per microbatch) of the same recipe."""
    from openrecipes.config.recipe import DataBuild
    from openrecipes.data.build import build

    root = tmp_path_factory.mktemp("card-new")
    rows = root / "rows"
    build(DataBuild(loss_mask="qwen3", row_tokens=64, rows=48, seed=1), rows, progress=False)  # bundled data
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["verify", "optimizer", "--json", "--hidden", "16", "--experts", "4", "--top-k", "2",
                     "--ffn", "8", "--tokens", "32"])
    assert code == 0
    (root / "optimizer.json").write_text(out.getvalue())
    return {"root": root, "rows": rows, "component": root / "optimizer.json",
            "cand": _train(rows, root / "cand", 128), "ref": _train(rows, root / "ref", 64)}


def _new(runs, out: Path, *extra: str, cand: Path | None = None, ref: Path | None = None) -> int:
    return main(["card", "new", str(cand or runs["cand"]), "--reference", str(ref or runs["ref"]),
                 "--out", str(out), "--author", "openrecipes tests", "--window", *map(str, WINDOW),
                 "--gpu-memory-gb", "16", *extra])


def _copy_run(runs, name: str, source: str = "ref") -> Path:
    target = runs["root"] / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(runs[source], target)
    return target


def test_card_validates_and_carries_measure_convergence_and_the_run(runs, tmp_path):
    from openrecipes.measure import measure_run_dir
    from openrecipes.verify.convergence import Thresholds, check_convergence
    from openrecipes.verify.curves import read_loss_curve

    out = tmp_path / "recipes" / "qwen3-moe-tiny" / "cpu" / "tiny.yaml"
    assert _new(runs, out, "--component-test", str(runs["component"])) == 0
    loaded = load_card(out)
    assert loaded.ok, [str(p) for p in loaded.problems]
    card = loaded.card
    assert "&id" not in loaded.text and "*id" not in loaded.text  # no anchors or aliases

    measured = measure_run_dir(runs["cand"], window=WINDOW).to_dict()
    res = card.result
    assert res.tokens_per_s_per_gpu == measured["tokens_per_s_per_gpu"]
    assert res.step_time_cv_percent == measured["step_time_cv"] * 100
    assert res.window_tokens == measured["window_tokens"] and res.window == list(WINDOW)
    assert res.gpu_hours == measured["gpu_hours"] and res.active_params.count == measured["active_params"]
    # a CPU has no peak FLOP/s and no price here: left out, and said so
    assert res.mfu is None and "MFU not computed" in res.mfu_note and res.usd_per_million_tokens is None
    assert card.gpu.type == "cpu" and card.gpu.count == 1

    report = check_convergence(read_loss_curve(runs["cand"]), read_loss_curve(runs["ref"]), Thresholds())
    conv = card.correctness.convergence
    assert (conv.result == "pass") == report.passed and conv.steps == len(report.steps) == 6
    assert conv.correlation == pytest.approx(report.correlation, abs=1e-15)
    assert conv.final_loss_difference == report.final_loss_difference
    assert conv.pointwise_failures == report.pointwise_failures
    assert card.correctness.result == "pass" and card.correctness.configuration == "pass"
    assert "layout.max_tokens_per_gpu 128 vs 64" in card.correctness.rules
    assert "1 row(s) of 64 tokens" in card.correctness.reference  # the reference's own layout

    component = json.loads(runs["component"].read_text())
    [test] = card.correctness.component_tests
    assert test.result == "pass" and test.detail == component["summary"] and test.gpu == "cpu"

    run = json.loads((runs["cand"] / "run.json").read_text())
    assert card.run == run["command"] and card.stack.pytorch == run["versions"]["torch"]
    manifest = json.loads((runs["rows"] / "manifest.json").read_text())
    assert card.workload.dataset.rows_sha256 == manifest["rows_sha256"]
    assert card.workload.dataset.build.parquet_sha256 == manifest["parquet_sha256"]
    assert card.layout.rows_per_microbatch == 2 and card.workload.row_tokens == 64
    records = [json.loads(line) for line in (runs["cand"] / "metrics.jsonl").read_text().splitlines()]
    assert [p.loss for p in card.curves.candidate] == [r["loss"] for r in records]
    assert len(card.curves.reference) == 6
    # the candidate's step time and tokens/s/GPU per step beside its loss (a CPU run records no memory)
    assert [p.step_time_s for p in card.curves.candidate] == [r["step_time_s"] for r in records]
    assert [p.tokens_per_s_per_gpu for p in card.curves.candidate] == pytest.approx(
        [r["tokens"] / r["step_time_s"] / 1 for r in records])
    assert all(p.peak_memory_gib is None for p in card.curves.candidate) and card.curves.memory_phases_gib is None
    assert [(p.grad_norm, p.lr) for p in card.curves.candidate] == [(r["grad_norm"], r["lr"]) for r in records]
    # the resolved recipe is the card's own field, not pasted into the notes
    assert card.recipe == (runs["cand"] / "recipe.yaml").read_text() and "recipe.yaml" not in (card.notes or "")

    from openrecipes.site.build import build_site

    site = build_site(tmp_path / "recipes", tmp_path / "site")
    html = (site.out / site.pages[0]).read_text()
    # loss (both arms), step time, tokens/s, gradient norm, learning rate
    assert html.count("<polyline") == 6 and 'data-points="6"' in html
    assert 'id="curve-step-time-s"' in html and 'id="recipe-yaml"' in html


def test_gpu_type_and_price_give_consistent_mfu_and_cost(runs, tmp_path):
    from openrecipes.measure import measure_run_dir

    out = tmp_path / "h200.yaml"
    named = _copy_run(runs, "gpu-named", "cand")  # a GPU run whose run.json does not name the GPU as sold
    info = json.loads((named / "run.json").read_text())
    info["gpu"] = {"type": "NVIDIA H200 (driver name)", "count": info["gpu"]["count"]}
    (named / "run.json").write_text(json.dumps(info))
    assert _new(runs, out, "--gpu", "h200", "--instance", "AWS p5en.48xlarge", cand=named) == 0
    loaded = load_card(out)
    assert loaded.ok, [str(p) for p in loaded.problems]
    measured = measure_run_dir(named, window=WINDOW, gpu_type="H200", instance="AWS p5en.48xlarge")
    assert loaded.card.result.mfu == measured.mfu and loaded.card.result.mfu_note is None
    assert loaded.card.result.usd_per_million_tokens == measured.usd_per_million_tokens
    assert loaded.card.gpu.instance == "AWS p5en.48xlarge" and loaded.card.gpu.memory_gb == 16.0
    assert loaded.card.gpu.type == "H200"


def test_verified_only_when_every_check_holds(runs, tmp_path):
    good = tmp_path / "good.yaml"
    assert _new(runs, good, "--status", "verified") == 0
    assert load_card(good).card.status == "verified" and load_card(good).ok

    changed = _copy_run(runs, "ref-lr")
    recipe = yaml.safe_load((changed / "recipe.yaml").read_text())
    recipe["optimizer"]["lr"] = 1e-3
    (changed / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    refused = tmp_path / "refused.yaml"
    assert _new(runs, refused, "--status", "verified", ref=changed) == 2
    assert not refused.exists()

    unverified = tmp_path / "unverified.yaml"
    assert _new(runs, unverified, ref=changed) == 0
    cor = load_card(unverified).card.correctness
    assert cor.result == "fail" and cor.configuration == "fail" and "optimizer.lr" in cor.summary


def test_paths_under_the_working_directory_are_written_relative(runs, tmp_path, monkeypatch):
    from openrecipes.cards.paths import absolute_paths

    repo = tmp_path / "clone"  # a repository's catalog: an absolute path there is an error
    (repo / "recipes").mkdir(parents=True)
    (repo / ".git").mkdir()
    out = repo / "recipes" / "qwen3-moe-tiny" / "cpu" / "tiny.yaml"
    out.parent.mkdir(parents=True)
    assert _new(runs, out, "--status", "verified") == 2 and not out.exists()  # the runs lie outside the cwd
    assert _new(runs, out) == 1 and not load_card(out).ok
    assert any(str(runs["cand"]) in p.message for p in load_card(out).problems if p.severity == "error")

    monkeypatch.chdir(runs["root"])
    assert _new(runs, out, "--status", "verified", "--overwrite") == 0
    loaded = load_card(out)
    assert loaded.ok and absolute_paths(yaml.safe_load(loaded.text)) == [], [str(p) for p in loaded.problems]
    assert "from run directory cand (started" in loaded.card.notes and "candidate arm: cand;" in (
        loaded.card.correctness.convergence.note)
    assert "rows: rows\n" in loaded.card.recipe  # the resolved recipe's data.rows, relative too


def test_a_diverging_reference_fails_the_convergence_block(runs, tmp_path):
    shifted = _copy_run(runs, "ref-shifted")
    lines = [json.loads(line) for line in (shifted / "metrics.jsonl").read_text().splitlines()]
    (shifted / "metrics.jsonl").write_text("".join(json.dumps(dict(r, loss=r["loss"] * 1.3)) + "\n" for r in lines))
    out = tmp_path / "shifted.yaml"
    assert _new(runs, out, ref=shifted) == 0
    cor = load_card(out).card.correctness
    assert cor.result == "fail" and cor.convergence.result == "fail" and "convergence" in cor.summary


@pytest.mark.parametrize("status", ["verified", "unverified"])
def test_the_candidate_itself_is_no_reference(runs, tmp_path, capsys, status):
    out = tmp_path / "self.yaml"
    assert _new(runs, out, "--status", status, ref=runs["cand"]) == 2
    assert "is the candidate run itself" in capsys.readouterr().err
    copy = _copy_run(runs, "cand-copy", source="cand")  # another directory, the same metrics file
    assert _new(runs, out, "--status", status, ref=copy) == 2
    assert "byte for byte" in capsys.readouterr().err
    assert not out.exists()


def test_a_reference_on_other_rows_is_refused(runs, tmp_path, capsys):
    from openrecipes.config.recipe import DataBuild
    from openrecipes.data.build import build

    other_rows = tmp_path / "other-rows"
    build(DataBuild(loss_mask="qwen3", row_tokens=64, rows=48, seed=2), other_rows, progress=False)
    other = _copy_run(runs, "ref-other-rows")
    recipe = yaml.safe_load((other / "recipe.yaml").read_text())
    recipe["data"]["rows"] = str(other_rows)
    (other / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = tmp_path / "other.yaml"
    assert _new(runs, out, ref=other) == 2
    assert "trained on other rows" in capsys.readouterr().err and not out.exists()


def test_a_failing_component_test_fails_correctness(runs, tmp_path):
    data = json.loads(runs["component"].read_text())
    data["passed"] = False
    failing = tmp_path / "failing.json"
    failing.write_text(json.dumps(data))
    out = tmp_path / "c.yaml"
    assert _new(runs, out, "--component-test", str(failing)) == 0
    card = load_card(out).card
    assert card.correctness.result == "fail" and card.correctness.component_tests[0].result == "fail"


def test_an_invalid_card_is_written_and_exits_1(runs, tmp_path, capsys):
    # a recipe whose global batch no longer matches the measured tokens: the validator's window check fails
    tampered = _copy_run(runs, "cand-tampered", source="cand")
    recipe = yaml.safe_load((tampered / "recipe.yaml").read_text())
    recipe["global_batch"] = 3
    (tampered / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = tmp_path / "bad.yaml"
    assert _new(runs, out, cand=tampered) == 1
    assert out.exists() and "window_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("case, needle", [
    ("no-memory", "--gpu-memory-gb"),
    ("exists", "--overwrite"),
    ("missing-run", "not found"),
    ("bad-component", "field 'passed'"),
    ("inside-run", "sits inside the input"),
])
def test_bad_input_is_exit_2(runs, tmp_path, capsys, case, needle):
    out = tmp_path / "card.yaml"
    args = ["card", "new", str(runs["cand"]), "--reference", str(runs["ref"]), "--out", str(out),
            "--author", "x", "--window", "1", "5"]
    if case != "no-memory":
        args += ["--gpu-memory-gb", "16"]
    else:  # a GPU the hardware table does not know (a CPU run states its host's memory)
        unknown = _copy_run(runs, "unknown-gpu", "cand")
        info = json.loads((unknown / "run.json").read_text())
        info["gpu"] = {"type": "Some GPU", "count": info["gpu"]["count"]}
        (unknown / "run.json").write_text(json.dumps(info))
        args[2] = str(unknown)
    if case == "exists":
        out.write_text("keep me\n")
    if case == "missing-run":
        args[2] = str(tmp_path / "nope")
    if case == "inside-run":  # even with --overwrite, a run's own file is not replaced by a card
        out = runs["cand"] / "metrics.jsonl"
        before = out.read_bytes()
        args[args.index("--out") + 1] = str(out)
        args += ["--overwrite"]
    if case == "bad-component":
        (tmp_path / "c.json").write_text(json.dumps({"summary": "x"}))
        args += ["--component-test", str(tmp_path / "c.json")]
    assert main(args) == 2
    assert needle in capsys.readouterr().err
    assert case in ("exists", "inside-run") or not out.exists()
    if case == "inside-run":
        assert out.read_bytes() == before


def test_a_cpu_runs_card_states_the_memory_of_its_host_and_is_never_relabelled(runs, tmp_path, capsys):
    out = tmp_path / "card.yaml"
    args = ["card", "new", str(runs["cand"]), "--reference", str(runs["ref"]), "--out", str(out), "--author", "x",
            "--window", *map(str, WINDOW)]
    recorded = json.loads((runs["cand"] / "run.json").read_text())["gpu"]
    assert recorded["type"] == "cpu" and recorded["memory_gb"] > 0  # train records the host's memory
    assert main(args) in (0, 1) and load_card(out).card.gpu.memory_gb == recorded["memory_gb"]
    assert main([*args, "--overwrite", "--gpu", "H200"]) == 2
    assert "--gpu H200: " in capsys.readouterr().err and load_card(out).card.gpu.type == "cpu"


def test_verify_item_writes_one_item_from_the_run(runs, tmp_path, capsys):
    from openrecipes.cards.verification_load import load_verification_card
    from openrecipes.measure import measure_run_dir

    cards = tmp_path / "verification"
    cards.mkdir()
    path = cards / "qwen3-moe-tiny.yaml"
    shutil.copy(Path(__file__).resolve().parents[2] / "verification" / "qwen3-moe-tiny.yaml", path)
    before = yaml.safe_load(path.read_text())["items"]
    args = ["card", "verify-item", str(runs["cand"]), "--model", "qwen3-moe-tiny", "--workflow", "sft",
            "--cards", str(cards)]
    text = path.read_text()
    # a workflow the run did not train is refused
    assert main(args[:6] + ["pretrain"] + args[7:]) == 2
    assert "--workflow pretrain, but" in capsys.readouterr().err and path.read_text() == text
    # verified is refused: the run saved nothing, so no hash identifies its checkpoint; the card stays as it was
    assert main(args + ["--status", "verified"]) == 1 and path.read_text() == text
    assert f"items[{len(before)}].checkpoint" in capsys.readouterr().err
    assert main(args + ["--reference", str(runs["ref"])]) == 0
    loaded = load_verification_card(path)
    assert loaded.ok, [str(p) for p in loaded.problems]
    written = yaml.safe_load(path.read_text())["items"]
    assert len(written) == len(before) + 1 and written[:-1] == before  # the other items untouched
    item = loaded.card.items[-1]
    met = item.metrics
    losses = [json.loads(line)["loss"] for line in (runs["cand"] / "metrics.jsonl").read_text().splitlines()]
    assert [p.loss for p in item.loss_curve] == losses and (met.initial_loss, met.final_loss) == (losses[0], losses[-1])
    measured = measure_run_dir(runs["cand"], window=(0, 5))
    assert met.window == [0, 5] and met.steps == 6 and met.window_tokens == measured.window_tokens
    # the card keeps the run's 0-based steps; its sentence for people counts from 1, as the console does
    assert f"{losses[0]:.4f} at step 1 to {losses[-1]:.4f} at step 6; steps 1-6 average" in item.observed
    assert met.tokens_per_s_per_gpu == pytest.approx(measured.tokens_per_s_per_gpu, rel=1e-5)
    assert met.step_time_ms == pytest.approx(measured.step_time_mean_s * 1000, rel=1e-5)
    assert met.nan_steps == met.skipped_steps == 0 and item.precision == "fp32" and item.hardware.type == "cpu"
    assert item.recipe == (runs["cand"] / "recipe.yaml").read_text()
    from openrecipes.verify.convergence import Thresholds, check_convergence
    from openrecipes.verify.curves import read_loss_curve

    report = check_convergence(read_loss_curve(runs["cand"]), read_loss_curve(runs["ref"]), Thresholds())
    finite, convergence = item.checks
    assert finite.result == "pass" and convergence.result == ("pass" if report.passed else "fail")
    assert f"correlation {report.correlation:.7g}" in convergence.detail
    manifest = json.loads((runs["rows"] / "manifest.json").read_text())
    assert item.data.hashes == {"rows": manifest["rows_sha256"], "parquet": manifest["parquet_sha256"]}

    # a step whose loss is NaN: counted, left out of the curve; the same combination is replaced, not appended
    broken = _copy_run(runs, "nan-step", source="cand")
    lines = (broken / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    record["loss"] = "nan"
    lines[3] = json.dumps(record)
    (broken / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["card", "verify-item", str(broken), *args[3:], "--observed", "Step 3 diverged."]) == 0
    written = yaml.safe_load(path.read_text())["items"]
    assert len(written) == len(before) + 1 and written[:-1] == before
    assert written[-1]["metrics"]["nan_steps"] == written[-1]["metrics"]["skipped_steps"] == 1
    assert [p["step"] for p in written[-1]["loss_curve"]] == [0, 1, 2, 4, 5]
    assert written[-1]["observed"].endswith("Step 3 diverged.") and load_verification_card(path).ok


def test_peak_memory_per_stage_is_read_strictly_and_reduced_over_the_window(tmp_path):
    from openrecipes.cards.step_curves import window_stage_peaks

    records = [{"step": 0, "peak_memory_gib_per_stage": [1.0, 3.0]}, {"step": 1, "peak_memory_gib_per_stage": [2.0, 1.5]},
               {"step": 2}, {"step": 3, "peak_memory_gib_per_stage": [9.0, 9.0]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert window_stage_peaks(tmp_path, (0, 2)) == [2.0, 3.0] and window_stage_peaks(tmp_path, (2, 2)) is None
    for bad, message in (([1.0, "x"], "non-empty list of non-negative numbers"), ([1.0], "1 stages in")):
        records[1]["peak_memory_gib_per_stage"] = bad
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        with pytest.raises(ValueError, match=f"metrics.jsonl:2: step 1: .*{message}"):
            window_stage_peaks(tmp_path, (0, 3))


def _edit_run(run_dir: Path, *, step_time_s: float | None = None, gpus: int | None = None) -> None:
    if step_time_s is not None:
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({**r, "step_time_s": step_time_s}) + "\n"
                                                       for r in lines))
    if gpus is not None:
        info = json.loads((run_dir / "run.json").read_text())
        info["gpu"]["count"] = gpus
        info.pop("world_size", None)
        (run_dir / "run.json").write_text(json.dumps(info))


@pytest.mark.parametrize("case, edit, message", [
    ("nanosecond-steps", {"step_time_s": 1e-9}, r"metrics.jsonl:1: step 0: step_time_s 1e-09 is below"),
    ("64-gpus", {"gpus": 64}, r"run.json: gpu.count 64 disagrees with the recipe's layout.dp"),
])
def test_verify_item_refuses_a_run_no_hardware_could_have_written(runs, tmp_path, capsys, case, edit, message):
    cards = tmp_path / "verification"
    cards.mkdir()
    path = cards / "qwen3-moe-tiny.yaml"
    shutil.copy(Path(__file__).resolve().parents[2] / "verification" / "qwen3-moe-tiny.yaml", path)
    text = path.read_text()
    broken = _copy_run(runs, case, source="cand")
    _edit_run(broken, **edit)
    assert main(["card", "verify-item", str(broken), "--model", "qwen3-moe-tiny", "--workflow", "sft",
                 "--cards", str(cards)]) == 2
    assert re.search(message, capsys.readouterr().err) and path.read_text() == text
