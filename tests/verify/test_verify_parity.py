"""verify parity: the native model against transformers on a saved tiny checkpoint."""

import json

import pytest
import torch

from openrecipes import cli
from tests.models.hf_reference import make_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    make_hf_model("wide_heads").save_pretrained(path)
    return path


def test_parity_passes_on_a_saved_checkpoint(hf_dir, capsys):
    assert cli.main(["verify", "parity", str(hf_dir), "--tokens", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["problems"] == []
    assert 0 <= out["logits_error"] <= 1e-5 and out["loss_error"] <= 1e-5
    # every native parameter is compared, the fused gate_up_proj split into gate and up
    assert any(name.endswith("experts.gate_proj") for name in out["grad_errors"])
    assert any(name.endswith("experts.up_proj") for name in out["grad_errors"])
    assert len(out["grad_errors"]) == 27


def test_a_wrong_native_implementation_fails(hf_dir, capsys, monkeypatch):
    from openrecipes.models.common import moe

    real = moe.LocalTokenDispatcher.__call__

    def doubled(self, x_TD, routing, experts):
        return real(self, x_TD, routing, experts) * 1.001

    monkeypatch.setattr(moe.LocalTokenDispatcher, "__call__", doubled)
    assert cli.main(["verify", "parity", str(hf_dir), "--tokens", "16", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["passed"] and any("logits" in p for p in out["problems"])


def test_tight_gradient_threshold_is_honoured(hf_dir, capsys):
    assert cli.main(["verify", "parity", str(hf_dir), "--tokens", "16", "--grad-tolerance", "1e-12"]) == 1
    assert "gradient of" in capsys.readouterr().out


def test_missing_directory_is_a_user_error(tmp_path, capsys):
    assert cli.main(["verify", "parity", str(tmp_path / "nope")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_missing_transformers_is_a_clear_error(hf_dir, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    assert cli.main(["verify", "parity", str(hf_dir)]) == 2
    assert "pip install transformers" in capsys.readouterr().err
    assert torch.__version__  # torch itself still imports


@pytest.fixture(scope="module")
def pad_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_pad")
    make_hf_model("pad_token").save_pretrained(path)
    return path


def test_pad_token_is_always_in_the_input(pad_dir):
    from openrecipes.verify.parity import parity_input_ids
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(pad_dir)
    for seed in range(5):
        ids = parity_input_ids(config, batch=2, tokens=16, seed=seed)
        assert (ids == config.pad_token_id).sum(dim=1).min() >= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_pad_row_with_a_gradient_fails_whatever_the_seed(pad_dir, capsys, monkeypatch, seed):
    import openrecipes

    assert cli.main(["verify", "parity", str(pad_dir), "--tokens", "16", "--seed", str(seed)]) == 0
    real = openrecipes.from_hf

    def without_padding_idx(*args, **kwargs):
        model = real(*args, **kwargs)
        model.model.embed_tokens.padding_idx = None  # the pad row then gets a gradient like any other
        return model

    monkeypatch.setattr(openrecipes, "from_hf", without_padding_idx)
    assert cli.main(["verify", "parity", str(pad_dir), "--tokens", "16", "--seed", str(seed), "--json"]) == 1
    assert "model.embed_tokens.weight" in capsys.readouterr().out


def _parity(path, capsys) -> tuple[int, dict]:
    status = cli.main(["verify", "parity", str(path), "--tokens", "16", "--json"])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("variant", ["tiny", "norm_eps"])
def test_parity_runs_on_deepseek_v3_with_its_frozen_correction_bias(tmp_path, capsys, variant):
    from tests.models.test_deepseek_v3_parity import make_hf_model as make_deepseek

    make_deepseek(variant).save_pretrained(tmp_path)
    status, out = _parity(tmp_path, capsys)
    assert status == 0 and out["passed"], out["problems"]
    assert not any("e_score_correction_bias" in name for name in out["grad_errors"])  # frozen: not compared
    assert any(name.endswith("mlp.experts.gate_proj") for name in out["grad_errors"])


def test_parity_catches_deepseek_v3s_latent_norm_epsilon(tmp_path, capsys, monkeypatch):
    """With the latent norms built on the config's rms_norm_eps (1e-2 here), as they once were, parity fails."""
    from openrecipes.models.deepseek_v3 import model as deepseek_model
    from tests.models.test_deepseek_v3_parity import make_hf_model as make_deepseek

    make_deepseek("norm_eps").save_pretrained(tmp_path)
    monkeypatch.setattr(deepseek_model, "LATENT_NORM_EPS", 1e-2)
    status, out = _parity(tmp_path, capsys)
    assert status == 1 and any("logits" in problem for problem in out["problems"]), out


def test_parity_runs_on_qwen3_vl_moe_text(tmp_path, capsys):
    from tests.models.test_qwen3_vl_moe_parity import TINY

    torch.manual_seed(0)
    reference = pytest.importorskip("transformers").Qwen3VLMoeForConditionalGeneration(
        pytest.importorskip("transformers").Qwen3VLMoeConfig(**TINY))
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0, 0.2)
    reference.save_pretrained(tmp_path)
    status, out = _parity(tmp_path, capsys)
    assert status == 0 and out["passed"], out["problems"]
    assert any("language_model" in name or name.startswith("model.layers") for name in out["grad_errors"])


def test_fp64_runs_on_an_moe_checkpoint(hf_dir, capsys):
    """transformers' grouped experts take no float64: the reference runs its eager experts."""
    assert cli.main(["verify", "parity", str(hf_dir), "--tokens", "16", "--dtype", "fp64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["dtype"] == "fp64", out


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    from tests.models.test_qwen3_5_moe_parity import make_hf_model as make_qwen3_5

    path = tmp_path_factory.mktemp("qwen3_5")
    make_qwen3_5("tiny").save_pretrained(path)
    return path


def test_a_gradient_within_the_models_own_fp32_rounding_passes_and_says_so(qwen3_5_dir, capsys):
    """Qwen3.5's delta rule rounds past 1e-4 in fp32 on 70-token rows: judged by 8x the native model's own fp32
    distance from its fp64 gradient, named in the report."""
    status = cli.main(["verify", "parity", str(qwen3_5_dir), "--tokens", "70", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 0 and out["passed"], out["problems"]
    assert out["rounding_limits"] and all(out["grad_errors"][name] <= limit
                                          for name, limit in out["rounding_limits"].items())


def test_the_rounding_allowance_does_not_hide_a_wrong_gradient(qwen3_5_dir, capsys, monkeypatch):
    """A gradient 1 % off (in fp32 and fp64 alike, as a wrong implementation would be) still fails."""
    import openrecipes

    real = openrecipes.from_hf

    def scaled_a_log(*args, **kwargs):
        model = real(*args, **kwargs)
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.register_hook(lambda grad: grad * 1.01)
        return model

    monkeypatch.setattr(openrecipes, "from_hf", scaled_a_log)
    assert cli.main(["verify", "parity", str(qwen3_5_dir), "--tokens", "70", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert any("A_log" in problem for problem in out["problems"]), out


def test_a_checkpoint_transformers_cannot_run_is_said_so(tmp_path, capsys):
    """Every layer linear attention: openrecipes reads it, transformers' own forward fails; the error says whose."""
    import transformers

    from tests.models.test_qwen3_5_moe_parity import TINY

    config = transformers.Qwen3_5MoeTextConfig(**{**TINY, "layer_types": ["linear_attention"] * 4})
    torch.manual_seed(0)
    transformers.Qwen3_5MoeForCausalLM(config).save_pretrained(tmp_path)
    assert cli.main(["verify", "parity", str(tmp_path), "--tokens", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("openrecipes verify: error: ") and "transformers' own" in err[-1], err
