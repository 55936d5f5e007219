"""Native Qwen3-VL-MoE against transformers' Qwen3VLMoeForConditionalGeneration: a random tiny model saved by
transformers, loaded through ``openrecipes.from_hf``; fp32, CPU; images (two sizes) in the input and text only."""

import pytest
import torch
import torch.nn.functional as F

import openrecipes

transformers = pytest.importorskip("transformers")

IMAGE, START, END = 120, 122, 123
TINY = dict(
    text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                     num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 1]),
    image_token_id=IMAGE, video_token_id=121, vision_start_token_id=START, vision_end_token_id=END)
GRID = torch.tensor([[1, 4, 6], [1, 2, 2]])  # two images: 4x6 and 2x2 patches (6 and 1 merged tokens)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    reference = transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(**TINY))
    with torch.no_grad():  # larger weights than the default init, so every part moves the output
        for param in reference.parameters():
            param.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    reference.save_pretrained(path)
    return reference.train(), openrecipes.from_hf(path, dtype=torch.float32), path


def _inputs(images: bool):
    generator = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(0, 100, (n,), generator=generator).tolist()  # noqa: E731
    if not images:
        return torch.tensor([text(12), text(12)]), {}
    tokens = [(GRID[i].prod() // 4).item() for i in range(len(GRID))]
    row = (text(2) + [START] + [IMAGE] * tokens[0] + [END] + text(3) + [START] + [IMAGE] * tokens[1] + [END]
           + text(4))
    pixels = torch.randn(int(GRID.prod(-1).sum()), 3 * 2 * 4 * 4, generator=generator)
    return torch.tensor([row]), {"pixel_values": pixels, "image_grid_thw": GRID}


def _loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


@pytest.mark.parametrize("images", [True, False], ids=["images", "text-only"])
def test_logits_loss_and_grads_match_transformers(models, images):
    from openrecipes.models.qwen3_vl_moe import hf

    reference, native, _ = models
    reference.zero_grad(), native.zero_grad()
    input_ids, vision = _inputs(images)
    labels = input_ids.masked_fill(input_ids == IMAGE, -100)  # image tokens are not predicted
    extra = {"mm_token_type_ids": (input_ids == IMAGE).int()} if images else {}
    out = reference(input_ids=input_ids, labels=labels, **vision, **extra)
    logits = native(input_ids, **vision)
    assert (logits - out.logits).abs().max().item() <= 1e-5 * max(1.0, out.logits.abs().max().item())
    loss = _loss(logits, labels)
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    out.loss.backward(), loss.backward()
    native_grads = ((name, torch.zeros_like(p) if p.grad is None else p.grad) for name, p in native.named_parameters())
    grads = dict(hf.to_hf(native_grads, native.config, "fused"))
    expected = {name: p.grad for name, p in reference.named_parameters()}
    assert grads.keys() == expected.keys()
    vision_grads = 0
    for name, grad in grads.items():
        if expected[name] is None:  # not reached by this input (the vision tower in text-only rows)
            assert not images and name.startswith("model.visual.") and not grad.abs().any(), name
            continue
        scale = max(expected[name].abs().max().item(), 1e-3)
        assert (grad - expected[name]).abs().max().item() <= 1e-5 * scale, name
        vision_grads += name.startswith("model.visual.") and bool(expected[name].abs().any())
    assert vision_grads > 0 if images else vision_grads == 0


def test_mrope_positions_match_transformers(models):
    from openrecipes.models.qwen3_vl_moe.model import mrope_positions

    reference, native, _ = models
    input_ids, vision = _inputs(True)
    input_ids = torch.cat([input_ids, input_ids.flip(1)])  # a second row: the images in the other order
    grid = torch.cat([GRID, GRID.flip(0)])
    expected, _ = reference.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), image_grid_thw=grid)
    assert torch.equal(mrope_positions(input_ids, grid, native.config), expected)
    with pytest.raises(ValueError, match="more images in input_ids"):
        mrope_positions(input_ids, GRID, native.config)


def test_config_round_trips_and_refuses_unknown_keys(models):
    from openrecipes.models.qwen3_vl_moe import Qwen3VLMoeConfig

    reference, native, _ = models
    raw = reference.config.to_dict()
    assert Qwen3VLMoeConfig.from_hf_dict(raw) == native.config
    assert Qwen3VLMoeConfig.from_hf_dict(native.config.to_hf_dict()) == native.config
    # transformers reads the config openrecipes writes to the same model
    assert transformers.Qwen3VLMoeConfig(**native.config.to_hf_dict()).to_dict()["text_config"]["hidden_size"] == 32
    with pytest.raises(ValueError, match="'window_stride'"):
        Qwen3VLMoeConfig.from_hf_dict({**raw, "vision_config": {**raw["vision_config"], "window_stride": 2}})
    with pytest.raises(ValueError, match="mrope_interleaved"):
        text = {**raw["text_config"], "rope_parameters": {**raw["text_config"]["rope_parameters"],
                                                          "mrope_interleaved": False}}
        Qwen3VLMoeConfig.from_hf_dict({**raw, "text_config": text})


def test_export_loads_in_transformers_with_the_same_logits(models, tmp_path):
    from openrecipes.checkpoint.hf import save_hf

    _, native, _ = models
    save_hf(native, tmp_path)
    exported = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    input_ids, vision = _inputs(True)
    with torch.no_grad():
        expected = native(input_ids, **vision)
        got = exported(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), **vision).logits
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_layer_chunks_compose_to_the_whole_forward(models):
    _, native, _ = models
    input_ids, _ = _inputs(False)
    with torch.no_grad():
        whole = native(input_ids)
        hidden = native(input_ids, layers=range(0, 1))
        chunked = native(hidden, layers=range(1, 3))
    assert torch.allclose(chunked, whole, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="images need"):
        native(input_ids, layers=range(0, 1), **_inputs(True)[1])


@pytest.mark.parametrize("name", ["qwen3-vl-moe-tiny", "qwen3-vl-30b-a3b"])
def test_parameter_counts_equal_the_modules(name):
    from openrecipes.models.qwen3_vl_moe.model import Qwen3VLMoeForConditionalGeneration
    from openrecipes.models.registry import get_config

    config = get_config(name)
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(config)
    counts = {True: 0, False: 0}
    for param_name, param in model.named_parameters():
        counts[param_name.startswith("model.visual.")] += param.numel()
    assert counts == {True: config.vision.params(), False: config.total_params()}


def test_the_published_30b_config_reads_as_the_named_config():
    """Qwen/Qwen3-VL-30B-A3B-Instruct's config.json (transformers 4.x layout: rope_scaling beside rope_theta)."""
    from openrecipes.models.qwen3_vl_moe import Qwen3VLMoeConfig
    from openrecipes.models.registry import get_config

    text = dict(attention_bias=False, decoder_sparse_step=1, head_dim=128, hidden_size=2048, intermediate_size=6144,
                max_position_embeddings=262144, mlp_only_layers=[], model_type="qwen3_vl_moe_text",
                moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
                num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-06,
                rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                rope_theta=5000000, vocab_size=151936, bos_token_id=151643, eos_token_id=151645, dtype="bfloat16",
                hidden_act="silu", initializer_range=0.02, use_cache=True)
    vision = dict(deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh", hidden_size=1152,
                  in_channels=3, intermediate_size=4304, model_type="qwen3_vl_moe", num_heads=16,
                  num_position_embeddings=2304, out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, initializer_range=0.02, dtype="bfloat16")
    raw = dict(architectures=["Qwen3VLMoeForConditionalGeneration"], image_token_id=151655, model_type="qwen3_vl_moe",
               text_config=text, tie_word_embeddings=False, video_token_id=151656, vision_config=vision,
               vision_end_token_id=151653, vision_start_token_id=151652, transformers_version="4.57.0.dev0")
    assert Qwen3VLMoeConfig.from_hf_dict(raw) == get_config("qwen3-vl-30b-a3b")
    shifted = {**text, "rope_scaling": {**text["rope_scaling"], "mrope_section": [32, 16, 16]}}
    assert Qwen3VLMoeConfig.from_hf_dict({**raw, "text_config": shifted}).mrope_section == (32, 16, 16)


def test_router_load_balancing_loss_matches_transformers(models):
    from openrecipes.models.common.router_loss import RouterStatistics

    reference, native, _ = models
    input_ids, vision = _inputs(True)
    with torch.no_grad():
        out = reference(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), output_router_logits=True,
                        **vision)
        with RouterStatistics(native) as routing:
            native(input_ids, **vision)
    assert out.aux_loss is not None
    assert abs(routing.load_balancing_loss().item() - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()


def test_convert_round_trip_of_the_transformers_checkpoint_is_bitwise(models, tmp_path):
    from safetensors.torch import load_file

    from openrecipes.cli import main

    path = models[2]
    assert main(["convert", "import", str(path), str(tmp_path / "native")]) == 0
    assert main(["convert", "export", str(tmp_path / "native"), str(tmp_path / "back")]) == 0
    before, after = (load_file(p / "model.safetensors") for p in (path, tmp_path / "back"))
    assert before.keys() == after.keys() and any(name.startswith("model.visual.") for name in before)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert main(["convert", "audit", str(path), str(tmp_path / "back")]) == 0
