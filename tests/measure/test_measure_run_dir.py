"""`openrecipes measure` on synthetic run directories with known step times."""

import json
import math

import pytest

import openrecipes.cli as cli
from openrecipes.measure import measure_run_dir

ROWS, ROW_TOKENS, GPUS = 128, 8192, 8
N_QWEN = 3_041_656_832


@pytest.fixture
def run_cli(monkeypatch):
    monkeypatch.setattr(cli, "VERB_MODULES", {"measure": "openrecipes.measure.cli"})
    return cli.main


def make_run(path, step_times, *, active=N_QWEN, gpu="H200", skip_steps=(), extra_lines=(), memory=None,
             reserved=None):
    path.mkdir(parents=True, exist_ok=True)
    run = {
        "command": "openrecipes train x.yaml",
        "model": {"name": "qwen3-30b-a3b", "active_params": active, "total_params": 30_532_122_624,
                  "num_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "head_dim": 128},
        "gpu": {"type": gpu, "count": GPUS},
        "world_size": GPUS, "global_batch": ROWS, "row_tokens": ROW_TOKENS, "steps": len(step_times),
    }
    (path / "run.json").write_text(json.dumps(run))
    lines = []
    for step, seconds in enumerate(step_times):
        if step in skip_steps:
            continue
        lines.append(json.dumps({
            "step": step, "loss": 2.0, "step_time_s": seconds, "tokens": ROWS * ROW_TOKENS,
            "supervised_tokens": 700_000, "sum_doc_len_sq": ROWS * 4096**2, "lr": 1e-6, "grad_norm": 1.0,
            "peak_memory_gib": None if memory is None else memory[step],
            **({} if reserved is None else {"peak_reserved_gib": reserved[step]}),
        }))
    lines += list(extra_lines)
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_known_step_times_give_exact_throughput_and_cv(tmp_path):
    # window steps 5..19 alternate 10 s and 12 s (8 x 10, 7 x 12); warm-up steps are slow and ignored
    times = [100.0] * 5 + [10.0 if i % 2 == 0 else 12.0 for i in range(15)]
    result = measure_run_dir(make_run(tmp_path / "run", times, memory=[50.0 + s for s in range(20)]))
    window_time = 8 * 10.0 + 7 * 12.0
    assert result.window_tokens == 15_728_640
    assert result.window_time_s == window_time
    assert result.tokens_per_s_per_gpu == pytest.approx(15_728_640 / window_time / GPUS, rel=1e-12)
    mean = window_time / 15
    std = math.sqrt((8 * (10 - mean) ** 2 + 7 * (12 - mean) ** 2) / 15)  # population std
    assert result.step_time_cv == pytest.approx(std / mean, rel=1e-12)
    assert result.gpu_hours == pytest.approx(GPUS * (500 + window_time) / 3600)
    assert result.peak_memory_gib == 69.0 and result.peak_reserved_gib is None  # runs that did not record it
    # model FLOPs: 6N per token plus 6 * layers * heads * head_dim * sum s^2 over the window
    flops = 6 * N_QWEN * 15_728_640 + 6 * 48 * 32 * 128 * 15 * ROWS * 4096**2
    assert result.model_tflops_per_gpu == pytest.approx(flops / window_time / GPUS / 1e12, rel=1e-12)
    assert result.notes == []


def test_the_allocators_peak_reserve_is_measured_beside_the_allocated_peak(tmp_path, run_cli, capsys):
    reserved = [60.0 + (s % 7) for s in range(20)]  # largest (66) at step 6, not the last
    run = make_run(tmp_path / "run", [1.0] * 20, memory=[50.0] * 20, reserved=reserved)
    assert measure_run_dir(run).peak_reserved_gib == 66.0
    assert run_cli(["measure", str(run)]) == 0
    assert "50.0 GiB allocated, 66.0 GiB reserved" in capsys.readouterr().out


def test_qwen_card_reproduced_from_a_run_dir(tmp_path, run_cli, capsys):
    seconds = 15_728_640 / GPUS / 6913.23 / 15  # constant step time giving the card's throughput
    run = make_run(tmp_path / "run", [seconds] * 20)
    assert run_cli(["measure", str(run), "--instance", "AWS p5en.48xlarge", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tokens_per_s_per_gpu"] == pytest.approx(6913.23, rel=1e-9)
    assert round(data["mfu"], 4) == 0.1276
    assert f"{data['usd_per_million_tokens']:.2f}" == "0.32"
    assert data["step_time_cv"] == pytest.approx(0.0, abs=1e-12)
    assert data["window_tokens"] == 15_728_640


def test_muse_card_reproduced_with_explicit_price(tmp_path, run_cli, capsys):
    seconds = 15_728_640 / GPUS / 333.12 / 15
    run = make_run(tmp_path / "run", [seconds] * 20, active=44_432_883_712)
    assert run_cli(["measure", str(run), "--usd-per-gpu-hour", "7.912"]) == 0
    table = capsys.readouterr().out
    assert "333.12" in table and "9.0 %" in table and "$6.60" in table
    assert "population (ddof=0)" in table


def test_table_names_default_price_source(tmp_path, run_cli, capsys):
    run = make_run(tmp_path / "run", [2.0] * 20)
    assert run_cli(["measure", str(run)]) == 0
    assert "default instance AWS p5en.48xlarge of H200" in capsys.readouterr().out


def test_missing_window_step_is_an_error(tmp_path, run_cli, capsys):
    run = make_run(tmp_path / "run", [2.0] * 20, skip_steps=(7, 12))
    assert run_cli(["measure", str(run)]) == 2
    err = capsys.readouterr().err
    assert "window 5-19 is incomplete" in err and "7, 12" in err
    # the same run measured over a window without the holes is fine
    assert run_cli(["measure", str(run), "--window", "13", "19"]) == 0


@pytest.mark.parametrize("last", [19, 10**18])  # 10**18: listing the missing steps never ended
def test_window_beyond_the_run_is_an_error(tmp_path, last):
    run = make_run(tmp_path / "run", [2.0] * 10)
    with pytest.raises(ValueError, match="goes past the last recorded step 9.*--window FIRST LAST"):
        measure_run_dir(run, window=(5, last))


def test_missing_run_json_is_an_error(tmp_path, run_cli, capsys):
    run = make_run(tmp_path / "run", [2.0] * 20)
    (run / "run.json").unlink()
    assert run_cli(["measure", str(run)]) == 2
    assert "run.json not found" in capsys.readouterr().err


def test_malformed_metrics_line_names_file_and_line(tmp_path, run_cli, capsys):
    run = make_run(tmp_path / "run", [2.0] * 20, extra_lines=['{"step": 20, "loss": '])
    assert run_cli(["measure", str(run)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:21: malformed JSON" in err


def test_repeated_step_is_an_error(tmp_path):
    run = make_run(tmp_path / "run", [2.0] * 20, extra_lines=[json.dumps({"step": 3, "step_time_s": 1.0})])
    with pytest.raises(ValueError, match=r"metrics.jsonl:21: step 3 repeats line 4"):
        measure_run_dir(run)


def test_hardware_file_adds_a_gpu_and_an_instance(tmp_path):
    run = make_run(tmp_path / "run", [2.0] * 20, gpu="X1")
    extra = tmp_path / "hw.yaml"
    extra.write_text(
        "gpus:\n  X1: {peak_bf16_dense_flops: 1.0e+15, default_instance: lab}\n"
        "instances:\n  lab: {usd_per_gpu_hour: 1.5}\n  other: {usd_per_gpu_hour: 3.0}\n"
    )
    result = measure_run_dir(run, hardware_files=[extra])
    expected_tps = 15_728_640 / 30.0 / GPUS
    assert result.mfu == pytest.approx(6 * N_QWEN * expected_tps / 1e15)
    assert result.usd_per_million_tokens == pytest.approx(1.5 / (expected_tps * 3600) * 1e6)
    other = measure_run_dir(run, hardware_files=[extra], instance="other")
    assert other.usd_per_million_tokens == pytest.approx(2 * result.usd_per_million_tokens)
    # without the file the GPU is unknown: MFU and price are left out with a note, not guessed
    bare = measure_run_dir(run)
    assert bare.mfu is None and bare.usd_per_million_tokens is None
    assert any("X1" in note for note in bare.notes)


def test_bad_hardware_file_names_the_field(tmp_path):
    run = make_run(tmp_path / "run", [2.0] * 20)
    extra = tmp_path / "hw.yaml"
    extra.write_text("gpus:\n  H200: {peak_bf16_dense_flops: -1}\n")
    with pytest.raises(ValueError, match=r"hw.yaml: gpus.H200.peak_bf16_dense_flops"):
        measure_run_dir(run, hardware_files=[extra])


def test_unknown_instance_and_gpu_are_errors(tmp_path):
    run = make_run(tmp_path / "run", [2.0] * 20)
    with pytest.raises(ValueError, match="unknown instance"):
        measure_run_dir(run, instance="nope")
    with pytest.raises(ValueError, match="unknown GPU type"):
        measure_run_dir(run, gpu_type="Z9")


def test_a_shorter_run_is_measured_from_step_5_to_its_last(tmp_path, run_cli, capsys):
    run = make_run(tmp_path / "run", [2.0] * 12)
    result = measure_run_dir(run)
    assert result.window == (5, 11) and result.window_steps == 7
    assert any("fewer than 20 steps" in note for note in result.notes)
    assert measure_run_dir(make_run(tmp_path / "long", [2.0] * 30)).window == (5, 19)  # the seeds' window
    assert run_cli(["measure", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["window"] == [5, 11]


def test_a_run_without_step_5_says_how_to_set_the_window(tmp_path, run_cli, capsys):
    run = make_run(tmp_path / "run", [2.0] * 4)
    assert run_cli(["measure", str(run)]) == 2
    assert "give --window FIRST LAST" in capsys.readouterr().err
    assert measure_run_dir(run, window=(1, 3)).window_steps == 3


def test_a_cpu_run_is_not_priced_at_a_gpu_instance(tmp_path):
    run = make_run(tmp_path / "run", [2.0] * 20, gpu="cpu")
    with pytest.raises(ValueError, match="its price is for a H200 GPU-hour, but .* records a CPU run"):
        measure_run_dir(run, instance="AWS p5en.48xlarge")
    assert measure_run_dir(run, usd_per_gpu_hour=0.1).usd_per_million_tokens is not None  # the user's own rate
    assert measure_run_dir(run).usd_per_gpu_hour is None


def test_a_cpu_run_is_not_relabelled_as_a_gpu(tmp_path, run_cli, capsys):
    run = make_run(tmp_path / "run", [2.0] * 20, gpu="cpu")
    assert run_cli(["measure", str(run), "--gpu", "H200"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"openrecipes measure: error: --gpu H200: {run / 'run.json'} records a CPU run (gpu.type cpu); its step "
        "times are not a H200's, so neither its MFU nor its price would be; measure it without --gpu"]
    assert run_cli(["measure", str(run)]) == 0
    assert f"{GPUS} x cpu" in capsys.readouterr().out
    gpu_run = make_run(tmp_path / "gpu", [2.0] * 20, gpu="NVIDIA H200 NVL")  # a name the table does not know
    assert run_cli(["measure", str(gpu_run), "--gpu", "H200"]) == 0


@pytest.mark.parametrize("seconds", [1e308, float("inf")])
def test_a_step_time_past_a_year_is_named_by_line(tmp_path, seconds):
    run = make_run(tmp_path / "run", [2.0] * 5 + [seconds] * 2 + [2.0] * 3)  # two of 1e308 overflowed the sum
    with pytest.raises(ValueError, match=r"metrics\.jsonl:\d+: step 5: step_time_s must be positive and at most"):
        measure_run_dir(run, window=(2, 8))
