"""The planner's refit, the failure classes, the local runner's time limit and early end, and the Slurm scripts."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import pytest

from openrecipes.config.recipe import load_recipe
from openrecipes.config.layout import LayoutConfig
from openrecipes.tune.predict import Planner, Prediction, Target, fit_calibration, resolve_target
from openrecipes.tune.runner import LocalRunner, TrialRun, classify_failure
from openrecipes.tune.slurm_runner import SlurmRunner, slurm_minutes


def _prediction(step: float, units: int, tps: float = 1000.0) -> Prediction:
    return Prediction(tokens_per_s_per_gpu=tps, step_time_s=step, layer_microbatches=units, allocated_gib=1.0,
                      peak_reserved_gib=1.2, capacity_gib=80.0)


def test_refit_recovers_a_scale_and_a_per_microbatch_cost():
    truth_a, truth_b = 2.5, 0.01
    pairs = []
    for step, units in ((0.1, 4), (0.3, 16), (0.2, 32), (0.05, 8)):
        p = _prediction(step, units)
        measured_step = truth_a * step + truth_b * units
        pairs.append((p, p.tokens_per_s_per_gpu * step / measured_step, None))
    fit = fit_calibration(pairs)
    assert fit.step_scale == pytest.approx(truth_a, rel=1e-6)
    assert fit.per_layer_microbatch_s == pytest.approx(truth_b, rel=1e-6)
    for p, measured, _ in pairs:
        assert fit.tokens_per_s_per_gpu(p) == pytest.approx(measured, rel=1e-6)


def test_refit_from_one_trial_is_a_ratio_and_memory_is_offset():
    p = _prediction(0.1, 4)
    fit = fit_calibration([(p, 250.0, 1.5)])
    assert fit.per_layer_microbatch_s == 0 and fit.tokens_per_s_per_gpu(p) == pytest.approx(250.0)
    assert fit.memory_offset_gib == pytest.approx(0.5)  # measured 1.5 GiB against 1.0 predicted
    big = Prediction(tokens_per_s_per_gpu=1.0, step_time_s=1.0, layer_microbatches=1, allocated_gib=60.0,
                     peak_reserved_gib=79.8, capacity_gib=80.0)
    assert fit_calibration([]).fits(big) and not fit.fits(big)


def test_a_measured_allocator_reserve_replaces_the_prior_per_compile_mode():
    def prediction(compiled: bool) -> Prediction:
        return Prediction(tokens_per_s_per_gpu=1.0, step_time_s=1.0, layer_microbatches=1, allocated_gib=100.0,
                          peak_reserved_gib=110.6, capacity_gib=140.0, compiled=compiled, context_gib=0.6)

    eager, compiled = prediction(False), prediction(True)
    assert fit_calibration([]).peak_gib(eager) == pytest.approx(110.6)  # the planner's 1.10 until measured
    # an eager trial measured 100 GiB allocated, 102 reserved: both modes take 1.02 until a compiled one is measured
    one = fit_calibration([(eager, 1.0, 100.0)], reserved=[(False, 100.0, 102.0)])
    assert one.peak_gib(eager) == pytest.approx(102.6) and one.peak_gib(compiled) == pytest.approx(102.6)
    both = fit_calibration([(eager, 1.0, 100.0)], reserved=[(False, 100.0, 102.0), (True, 50.0, 53.0),
                                                             (True, 80.0, 80.0), (False, 90.0, 85.0)])
    assert both.reserve_ratio == (pytest.approx(1.02), pytest.approx(1.06))  # the largest, never below 1
    assert both.peak_gib(compiled) == pytest.approx(106.6)
    assert both.fits(compiled) and not both.fits(compiled, margin=0.25)


def test_compiled_memory_follows_the_eager_offset_and_the_saving():
    def prediction(compiled: bool, logits: float) -> Prediction:
        return Prediction(tokens_per_s_per_gpu=1.0, step_time_s=1.0, layer_microbatches=1, allocated_gib=100.0,
                          peak_reserved_gib=110.0, capacity_gib=140.0, compiled=compiled, logits_gib_per_byte=logits)

    eager, compiled = prediction(False, 1.0), prediction(True, 1.0)
    prior = fit_calibration([(eager, 1.0, 108.0)], saving_prior=8.0)  # eager measured 8 GiB above
    assert prior.peak_gib(eager) == pytest.approx(118.0) and prior.peak_gib(compiled) == pytest.approx(110.0)
    both = fit_calibration([(eager, 1.0, 108.0), (compiled, 1.0, 98.0)], saving_prior=8.0)
    assert both.compiled_saving_bytes == pytest.approx(10.0)  # 108 - 98 over one GiB of logits per byte
    only_compiled = fit_calibration([(compiled, 1.0, 98.0)], saving_prior=8.0)
    assert only_compiled.peak_gib(compiled) == pytest.approx(108.0) and only_compiled.peak_gib(eager) == \
        pytest.approx(116.0)


def test_planner_refuses_what_train_refuses(start_yaml):
    start = load_recipe(start_yaml)
    planner = Planner(start, Target(count=2, gpu_type="cpu"), 256)
    assert planner.refusal(start) is None
    assert "layout.dp" in planner.refusal(start.model_copy(update={"layout": start.layout.model_copy(
        update={"dp": 4})}))
    assert "sequence_parallel" in planner.refusal(start.model_copy(update={"layout": start.layout.model_copy(
        update={"dp": 1, "tp": 2})}))
    two = LayoutConfig(dp=2, max_tokens_per_gpu=256)
    with pytest.raises(ValueError, match="world size"):
        resolve_target("4xH200", two)
    assert resolve_target("cpu", two) == Target(count=2, gpu_type="cpu")
    # dp left out is the world size, as train takes it: from --gpus, or from --nproc for CPU processes
    unset = LayoutConfig(tp=2, sequence_parallel=True, max_tokens_per_gpu=256)
    assert resolve_target("4xH200", unset) == Target(count=4, gpu_type="H200")
    assert resolve_target("cpu", LayoutConfig(max_tokens_per_gpu=256), nproc=3) == Target(count=3, gpu_type="cpu")
    with pytest.raises(ValueError, match="world size"):
        resolve_target("3xH200", unset)  # tp=2 does not divide 3


@pytest.mark.parametrize("code,log,expected", [
    (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out_of_memory"),
    (-9, "", "out_of_memory"),
    (1, "openrecipes train: stopped: step 3: non-finite loss nan or gradient norm nan", "non_finite_loss"),
    (2, "openrecipes train: error: layout.dp: tp·pp·cp·dp = 4 must equal the world size 2", "refused_layout"),
    (1, "Traceback ...\nRuntimeError: injected failure on rank 1 at step 3 (debug.fail_at)", "crash"),
])
def test_failure_classes(code, log, expected):
    failure, detail = classify_failure(code, log)
    assert failure == expected and detail


def test_a_crash_is_described_by_the_first_worker_exception():
    log = ("[rank1]:   File \"loop.py\", line 149\n"
           "[rank1]: RuntimeError: injected failure on rank 1 at step 3 (debug.fail_at)\n"
           "[rank0]: RuntimeError: Connection closed by peer\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
           "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert classify_failure(1, log) == ("crash", "RuntimeError: injected failure on rank 1 at step 3 (debug.fail_at)")


class _Sleeper(LocalRunner):
    def command(self, trial):
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_local_runner_stops_a_trial_at_its_time_limit(tmp_path):
    (tmp_path / "trial").mkdir()
    run = TrialRun(recipe_path=tmp_path / "r.yaml", run_dir=tmp_path / "trial" / "run", nproc=1, timeout_s=1.0,
                   window=(1, 2))
    started = time.monotonic()
    outcome = _Sleeper(poll_s=0.1).run(run)
    assert outcome.failure == "timeout" and time.monotonic() - started < 30


def test_slurm_runner_writes_the_launcher_script(tmp_path, start_yaml):
    trial_dir = tmp_path / "trials" / "001-abc"
    trial_dir.mkdir(parents=True)
    recipe = trial_dir / "recipe.yaml"
    recipe.write_text(start_yaml.read_text())
    run = TrialRun(recipe_path=recipe, run_dir=trial_dir / "run", nproc=16, timeout_s=600, window=(5, 19))
    runner = SlurmRunner(gpus_per_node=8, partition="gpu")
    script = runner.script(run).path.read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script and str(recipe.resolve()) in script
    assert "-m openrecipes train" in script and "--nproc 8 --nnodes 2" in script
    # the trial's limit of 600 s, in Slurm's minutes, ending SLURM_ENFORCE_S (60 s) before it, so Slurm's TIMEOUT
    # comes before the tuner's scancel; a short limit still asks for a minute
    assert "#SBATCH --time=9" in script and slurm_minutes(179) == "1" and slurm_minutes(180) == "2"
    assert slurm_minutes(3) == "1"
    with pytest.raises(ValueError, match="whole nodes"):
        SlurmRunner(gpus_per_node=3).script(run)


FAKE_TRAIN = '''
import json, sys, time
from pathlib import Path
from openrecipes.config.rundir import METRICS_FILE, RunGpuInfo, RunInfo, RunModelInfo, write_run_info
run_dir, steps, times = Path(sys.argv[1]), int(sys.argv[2]), [float(t) for t in sys.argv[3].split(",")]
run_dir.mkdir(parents=True)
write_run_info(run_dir, RunInfo(command="fake", started="2026-12-01T00:00:00Z", model=RunModelInfo(
    name="tiny", active_params=1000, num_layers=1, hidden_size=8, num_attention_heads=1, head_dim=8),
    gpu=RunGpuInfo(type="cpu", count=1), world_size=1, global_batch=1, row_tokens=64, steps=steps))
with open(run_dir / METRICS_FILE, "a") as metrics:
    for step in range(steps):
        time.sleep(0.1)
        metrics.write(json.dumps({"step": step, "loss": 1.0, "grad_norm": 1.0, "tokens": 64,
                                  "step_time_s": times[step % len(times)]}) + "\\n")
        metrics.flush()
time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)  # what a run does after its last step
'''


class _FakeTrain(LocalRunner):
    def __init__(self, script: Path, steps: int, times: str, linger_s: float = 0.0) -> None:
        super().__init__(poll_s=0.05)
        self.script, self.steps, self.times, self.linger_s = script, steps, times, linger_s

    def command(self, trial):
        return [sys.executable, str(self.script), str(trial.run_dir), str(self.steps), self.times, str(self.linger_s)]


@pytest.mark.parametrize("times,slower_than,ends_early", [("1.0,1.001", 0.0, True), ("1.0,1.001", 0.99, True),
                                                          ("1.0,1.2", 0.0, False), ("1.0,1.001", 1.01, False)])
def test_a_trial_ends_once_its_window_is_stable(tmp_path, times, slower_than, ends_early):
    """Steady step times (1.0005 s on average): the trial is stopped once 4 window steps are recorded, and measured
    over those, unless a trial as fast was measured (here 1.01 s); step times varying by 9 % (above the 2 % bound)
    run all 30 steps."""
    from openrecipes.tune.runner import STABLE_MIN_STEPS

    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    (tmp_path / "trial").mkdir()
    run = TrialRun(recipe_path=tmp_path / "r.yaml", run_dir=tmp_path / "trial" / "run", nproc=1, timeout_s=60,
                   window=(2, 29), stable_cv=0.02, end_if_slower_than_s=slower_than)
    outcome = _FakeTrain(script, 30, times).run(run)
    assert outcome.ok, outcome.detail
    first, last = outcome.measured["window"]
    recorded = len((run.run_dir / "metrics.jsonl").read_text().splitlines())
    if ends_early:
        assert first == 2 and STABLE_MIN_STEPS - 1 <= last - first < 10 and recorded < 20
        assert outcome.measured["step_time_cv"] <= 0.02
    else:
        assert (first, last) == (2, 29) and recorded == 30
    if ends_early:  # without the bound the same trial runs all its steps
        again = _FakeTrain(script, 30, times).run(replace(run, run_dir=tmp_path / "trial" / "all",
                                                                  end_if_slower_than_s=None))
        assert again.measured["window"] == (2, 29)


def test_a_trial_ends_once_its_last_step_is_recorded(tmp_path):
    """What a run does after its last step (a LoRA adapter's save, the teardown of a large process; here a 60 s
    sleep) is not waited for: the trial is stopped and measured over its whole window."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    (tmp_path / "trial").mkdir()
    run = TrialRun(recipe_path=tmp_path / "r.yaml", run_dir=tmp_path / "trial" / "run", nproc=1, timeout_s=50,
                   window=(2, 7), steps=8)
    outcome = _FakeTrain(script, 8, "1.0,1.2", linger_s=60).run(run)
    assert outcome.ok, outcome.detail  # before its limit of 50 s, which a run that lingers would reach
    assert outcome.measured["window"] == (2, 7) and outcome.wall_s < 40
    unbounded = _FakeTrain(script, 8, "1.0,1.2", linger_s=60).run(
        replace(run, run_dir=tmp_path / "trial" / "lingers", steps=None, timeout_s=3))
    assert unbounded.failure == "timeout"  # without ``steps`` the runner waits for the process


def test_which_trials_may_end_early():
    from openrecipes.tune.trial import early_end_s

    records = [{"status": "ok", "measured": {"step_time_mean_s": 2.0}}, {"status": "failed", "measured": None},
               {"status": "ok", "measured": {"step_time_mean_s": 1.5}}]
    assert early_end_s("start", [], 0.02) is None  # the reference of every other trial runs all its steps
    assert early_end_s("ranked", [], 0.02) is None  # nothing measured yet: it may be the winner
    assert early_end_s("ranked", records, 0.02) == pytest.approx(1.53)  # slower than the fastest, past the bound
    assert early_end_s("around-best", records, 0.02) == pytest.approx(1.53)
    assert early_end_s("remeasure", records, 0.02) == early_end_s("ablation", [], 0.02) == 0.0
    assert early_end_s("remeasure", records, None) is None  # --stable-cv 0


def test_failure_text_is_one_line_cut_at_a_word():
    from openrecipes.tune.progress import failure_text

    detail = "CUDA out of memory.\nTried to allocate 2.00 GiB;  GPU 0 has a total capacity of 139.8 GiB " * 4
    text = failure_text({"class": "out_of_memory", "detail": detail}, limit=60)
    assert "\n" not in text and "  " not in text
    assert text.startswith("out_of_memory: CUDA out of memory. Tried") and text.endswith(" …")
    cut = text.removeprefix("out_of_memory: ").removesuffix(" …")
    assert len(cut) <= 60 and (cut + " ") in " ".join(detail.split()) + " "  # ends at a whole word
    assert failure_text({"class": "timeout", "detail": "short"}) == "timeout: short"


def test_auto_fits_candidates_into_a_device_smaller_than_its_tables_card(monkeypatch):
    """--gpus auto on a 40 GB A100-class card or a MIG slice named like the table's full-size card: the planner fits
    into what the device reports when that is clearly less, and keeps the table's figure for the same card (an H100
    reports 79.2 GiB against the table's 79.6); --gpu-memory-gib still decides when given."""
    import types

    import torch

    from openrecipes.tune.predict import planner_hardware

    reported = {"name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "bytes": int(39.5 * 1024 ** 3)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: reported["name"])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(total_memory=reported["bytes"]))
    layout = LayoutConfig(max_tokens_per_gpu=256)
    slice_ = resolve_target("auto", layout)
    assert (slice_.gpu_type, slice_.device_memory_gib) == ("H100", 39.5)
    assert planner_hardware(slice_).gpu.memory_gib == 39.5
    assert planner_hardware(slice_, memory_gib=30.0).gpu.memory_gib == 30.0
    reported.update(name="NVIDIA H100 80GB HBM3", bytes=int(79.18 * 1024 ** 3))
    whole = resolve_target("auto", layout)
    assert planner_hardware(whole).gpu.memory_gib == planner_hardware(Target(count=1, gpu_type="H100")).gpu.memory_gib


def test_the_tuner_says_when_it_fits_into_the_devices_memory(start_yaml):
    start = load_recipe(start_yaml)
    small = Planner(start, Target(count=2, gpu_type="H100", device_memory_gib=39.5), 256)
    assert small.device_memory_note() == ("this machine's devices hold 39.5 GiB, less than the hardware table's "
                                          "H100: every candidate is fitted into 39.5 GiB")
    assert Planner(start, Target(count=2, gpu_type="H100", device_memory_gib=79.2), 256).device_memory_note() is None
    given = Planner(start, Target(count=2, gpu_type="H100", device_memory_gib=39.5), 256, memory_gib=60.0)
    assert given.device_memory_note() is None and given.hardware.gpu.memory_gib == 60.0
