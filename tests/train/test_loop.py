"""The training loop on CPU: per-token loss, accumulation, resume, recompute, non-finite stops, checkpoints."""

import json

import pytest
import torch
import torch.nn.functional as F

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.train import engine
from openrecipes.checkpoint.training_save import latest_checkpoint
from openrecipes.train.loop import TrainingStopped, train
from openrecipes.parallel.mesh import single_process


def losses(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_metrics_and_run_files(make_recipe):
    run_dir = train(make_recipe(), command="test")
    records = losses(run_dir)
    assert [r["step"] for r in records] == list(range(6))
    for key in ("loss", "grad_norm", "lr", "tokens", "supervised_tokens", "step_time_s", "sum_doc_len_sq",
                "peak_memory_gib"):
        assert key in records[0]
    assert records[0]["tokens"] == 4 * 64
    assert records[-1]["loss"] < records[0]["loss"]
    info = json.loads((run_dir / "run.json").read_text())
    assert info["model"]["active_params"] == 190_464 and info["gpu"]["type"] == "cpu"
    assert (run_dir / "recipe.yaml").is_file() and latest_checkpoint(run_dir).name == "step-000005"


def test_startup_phases_are_recorded(make_recipe):
    from openrecipes.config.rundir import read_startup

    run_dir = train(make_recipe(steps=2), command="test")
    phases = read_startup(run_dir)
    # every phase before the first step ended, in order, each a non-negative number of seconds
    assert [p for p in phases if p != "launch"] == ["setup", "build", "optimizer", "first_step"]
    assert all(v >= 0 for v in phases.values())
    (run_dir / "startup.json").write_text('{"phases_s": [1]}')
    assert read_startup(run_dir) is None


def test_loss_is_the_per_token_loss_of_the_global_batch(make_recipe):
    recipe = make_recipe(steps=1, optimizer__lr=1e-9, optimizer__min_lr=0.0)  # min_lr may not exceed lr
    run_dir = train(recipe, command="test")
    from openrecipes.data.batching import RowLoader, load_rows
    from openrecipes.models.qwen3_moe import build_qwen3_moe
    from openrecipes.models.registry import get_config

    model = build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=0)
    loader = RowLoader(dataset=load_rows(recipe.data.rows), global_batch=4, dp_rank=0, dp_size=1,
                       rows_per_microbatch=4)
    (batch,) = loader.microbatches(0)
    # the loss recomputed straightforwardly: every document of every row alone
    total, count = 0.0, 0
    for row in range(4):
        bounds = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [64]
        for start, end in zip(bounds[:-1], bounds[1:]):
            ids = batch["input_ids"][row:row + 1, start:end]
            with torch.no_grad():
                doc_logits = model(ids)
            mask = batch["loss_mask"][row, start + 1:end].double()
            ce = F.cross_entropy(doc_logits[0, :-1].double(), ids[0, 1:], reduction="none")
            total += float((ce * mask).sum())
            count += int(mask.sum())
    assert losses(run_dir)[0]["supervised_tokens"] == count
    assert losses(run_dir)[0]["loss"] == pytest.approx(total / count, rel=1e-5)


def test_gradient_accumulation_matches_one_microbatch(make_recipe, tmp_path):
    one = train(make_recipe(steps=3, layout__max_tokens_per_gpu=256, run_dir=str(tmp_path / "a")), command="t")
    four = train(make_recipe(steps=3, layout__max_tokens_per_gpu=64, run_dir=str(tmp_path / "b")), command="t")
    for a, b in zip(losses(one), losses(four)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("precision,aware", [("fp32", False), ("bf16", True)])
def test_resume_continues_exactly(make_recipe, tmp_path, precision, aware):
    overrides = dict(precision=precision, optimizer__precision_aware=aware, optimizer__moment_dtype="bf16"
                     if aware else "fp32")
    whole = train(make_recipe(run_dir=str(tmp_path / "whole"), **overrides), command="t")
    interrupted = make_recipe(run_dir=str(tmp_path / "cut"), **overrides)
    train(interrupted, command="t", stop_after=2)
    assert [r["step"] for r in losses(tmp_path / "cut")] == [0, 1, 2]
    train(interrupted, command="t", resume=True)
    expected, got = losses(whole), losses(tmp_path / "cut")
    assert [r["step"] for r in got] == list(range(6))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in expected]


def test_recompute_changes_no_number(make_recipe, tmp_path):
    plain = train(make_recipe(steps=2, run_dir=str(tmp_path / "a")), command="t")
    for granularity in ("full", "selective"):
        again = train(make_recipe(steps=2, run_dir=str(tmp_path / granularity), recompute__granularity=granularity),
                      command="t")
        assert [r["loss"] for r in losses(again)] == [r["loss"] for r in losses(plain)]
        assert [r["grad_norm"] for r in losses(again)] == [r["grad_norm"] for r in losses(plain)]


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(make_recipe, monkeypatch):
    recipe = make_recipe(checkpoint__every=2)
    real = engine.microbatch_loss_sum
    calls = {"n": 0}

    def poisoned(model, batch, *args, **kwargs):
        calls["n"] += 1
        loss = real(model, batch, *args, **kwargs)
        return loss * float("nan") if calls["n"] == 7 else loss  # step 3 (two microbatches per step)

    monkeypatch.setattr(engine, "microbatch_loss_sum", poisoned)
    with pytest.raises(TrainingStopped, match="step 3: non-finite"):
        train(recipe, command="t")
    assert latest_checkpoint(recipe.run_dir).name == "step-000001"


def test_skip_option_skips_the_update_and_continues(make_recipe, monkeypatch):
    recipe = make_recipe(debug__skip_nonfinite_steps=True)
    real = engine.microbatch_loss_sum
    calls = {"n": 0}

    def poisoned(model, batch, *args, **kwargs):
        calls["n"] += 1
        return real(model, batch, *args, **kwargs) * (float("nan") if calls["n"] == 3 else 1.0)  # step 1

    monkeypatch.setattr(engine, "microbatch_loss_sum", poisoned)
    run_dir = train(recipe, command="t")
    records = losses(run_dir)
    assert records[1]["loss"] == "nan" and len(records) == 6


def test_a_crashed_save_does_not_replace_the_last_good_checkpoint(make_recipe, monkeypatch):
    from openrecipes.checkpoint import training_save as checkpointing

    recipe = make_recipe(checkpoint__every=2)
    real_save = checkpointing.dcp.save
    calls = {"n": 0}

    def crashing_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("killed during save")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpointing.dcp, "save", crashing_save)
    with pytest.raises(OSError):
        train(recipe, command="t")
    assert latest_checkpoint(recipe.run_dir).name == "step-000001"
    assert not (recipe.run_dir and (checkpointing.Path(recipe.run_dir) / "checkpoints" / "step-000003").exists())


def test_existing_run_dir_is_not_overwritten(make_recipe):
    recipe = make_recipe(steps=1)
    train(recipe, command="t")
    with pytest.raises(ValueError, match="already holds a run"):
        train(recipe, command="t")


def test_tensorboard_and_wandb_are_clear_errors_when_missing(make_recipe, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name in ("torch.utils.tensorboard", "wandb"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(ValueError, match="logging.tensorboard"):
        train(make_recipe(steps=1, logging__tensorboard=True), command="t")
    with pytest.raises(ValueError, match="logging.wandb"):
        train(make_recipe(steps=1, logging__wandb=True), command="t")  # the failed start left no metrics file


def test_start_banner_and_a_warning_when_rows_repeat(make_recipe, capsys):
    # 48 rows; 6 steps x 4 rows = 24: half an epoch, no warning
    train(make_recipe(), command="test")
    err = capsys.readouterr().err
    assert "model qwen3-moe-tiny:" in err and "N = 190,464 active per token" in err
    assert "1 process(es), layout TP1 PP1 EP1 DP1" in err and "48 rows of 64 tokens" in err
    assert "cover 0.50 epoch(s)" in err and "warning" not in err and "note:" not in err  # fp32: no precision note
    # 30 steps x 4 rows = 120 rows of 48: each row 2.5 times
    train(make_recipe(steps=30, checkpoint__at_end=False, run_dir=str(make_recipe().run_dir) + "-long"),
          command="test")
    assert "warning: 30 steps x global_batch 4 = 120 rows, but the data has 48" in capsys.readouterr().err


def test_bf16_on_a_cpu_notes_once_that_fp32_is_faster(make_recipe, capsys):
    from openrecipes.train.banner import cpu_precision_note

    train(make_recipe(steps=2, precision="bf16", optimizer__precision_aware=True), command="test")
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert notes == ["openrecipes train: note: bf16 training on a CPU, where fp32 is usually 2-3x faster "
                     "(`--set precision=fp32 --set optimizer.precision_aware=false` trains in fp32)"]
    assert cpu_precision_note(make_recipe(precision="bf16"), "cuda") is None
    assert cpu_precision_note(make_recipe(precision="bf16", offload__fraction=0.5), "cpu").endswith(
        "(`--set precision=fp32 --set offload.fraction=0` trains in fp32)")


def test_resuming_a_finished_run_says_it_is_finished(make_recipe, capsys):
    recipe = make_recipe(steps=2)
    run_dir = train(recipe, command="test")
    before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert train(recipe, command="test", resume=True) == run_dir
    assert "is finished: its last save is step 1 of its 2 steps" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # torch.compile's first compilation takes tens of seconds on a CPU
def test_compiled_blocks_change_no_number(make_recipe, tmp_path):
    # CPU, fp32: the per-expert loop path breaks the graph around its host reads; the result must not change
    plain = train(make_recipe(steps=2, run_dir=str(tmp_path / "a"), model_overrides={"num_hidden_layers": 1},
                              recompute__granularity="full"), command="t")
    compiled = train(make_recipe(steps=2, run_dir=str(tmp_path / "b"), model_overrides={"num_hidden_layers": 1},
                                 recompute__granularity="full", kernels__compile=True), command="t")
    for a, b in zip(losses(plain), losses(compiled)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_compile_wraps_the_blocks_below_the_recompute_boundary(make_recipe):
    # full recompute hooks the layer: both its blocks are compiled; selective hooks the attention block: it stays eager
    for granularity, attention_compiled in (("full", True), ("selective", False)):
        recipe = make_recipe(recompute__granularity=granularity, kernels__compile=True)
        model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
        for layer in model.model.layers.values():
            assert (getattr(layer.self_attn, "_compiled_call_impl", None) is not None) == attention_compiled
            assert getattr(layer.mlp, "_compiled_call_impl", None) is not None
    plain_recipe = make_recipe(recompute__granularity="full")
    plain, _ = engine.build_model(plain_recipe, recipe_model_config(plain_recipe), single_process(torch.device("cpu")))
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in plain.modules())


@pytest.mark.parametrize("timeline", [False, True])
def test_a_profiled_step_writes_its_table_and_on_request_its_timeline(make_recipe, timeline):
    from openrecipes.config.rundir import PROFILE_FILE, PROFILE_TRACE_FILE

    run_dir = train(make_recipe(steps=2, debug__profile_step=1, debug__profile_timeline=timeline), command="test")
    assert "Self CPU" in (run_dir / PROFILE_FILE).read_text()
    trace = run_dir / PROFILE_TRACE_FILE
    assert trace.is_file() == timeline
    if timeline:
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(event.get("cat") == "cpu_op" for event in events)
    assert not list(run_dir.glob(".*.partial"))
