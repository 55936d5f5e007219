"""Muse Spark's perception towers against independent FP64 references written plainly here, one clip or image at a
time (explicit loops over frames and windows, raster-order patches, attention as softmax(q kᵀ) v): the waveform audio
encoder with its projector, and the NaViT vision tower with its adapter and projection, for images and a video."""

import math

import pytest
import torch

from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.muse_spark.tower_config import MuseSparkAudioConfig, MuseSparkVisionConfig
from openrecipes.models.registry import get_config

TINY = "muse-spark-tiny-full"


@pytest.fixture(scope="module")
def model():
    model = build_muse_spark(get_config(TINY), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger weights than the init (norms and biases too), so every part moves the output
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return model


def weights(model, prefix):
    return {name.removeprefix(prefix): p.detach().double() for name, p in model.named_parameters()
            if name.startswith(prefix)}


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def rotate(x, angles):
    """Rotate-half RoPE of x (tokens, heads, d) by angles (tokens, d/2): dimension i turns with i + d/2."""
    half = x.shape[-1] // 2
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def block(x, w, prefix, heads, angles, act):
    """One pre-norm block (LayerNorm eps 1e-6) over the tokens of one image slice or one clip."""
    tokens, width = x.shape
    d = width // heads
    y = layer_norm(x, w[f"{prefix}norm1.weight"], w[f"{prefix}norm1.bias"], 1e-6)
    qkv = (y @ w[f"{prefix}attn.qkv.weight"].T + w[f"{prefix}attn.qkv.bias"]).view(tokens, 3, heads, d)
    q, k, v = rotate(qkv[:, 0], angles), rotate(qkv[:, 1], angles), qkv[:, 2]
    out = torch.empty(tokens, heads, d, dtype=x.dtype)
    for h in range(heads):
        scores = q[:, h] @ k[:, h].T / math.sqrt(d)
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h]
    x = x + out.reshape(tokens, width) @ w[f"{prefix}attn.proj.weight"].T + w[f"{prefix}attn.proj.bias"]
    y = layer_norm(x, w[f"{prefix}norm2.weight"], w[f"{prefix}norm2.bias"], 1e-6)
    y = act(y @ w[f"{prefix}mlp.linear_fc1.weight"].T + w[f"{prefix}mlp.linear_fc1.bias"])
    return x + y @ w[f"{prefix}mlp.linear_fc2.weight"].T + w[f"{prefix}mlp.linear_fc2.bias"]


# ---- audio ----

def audio_reference(model, wave):
    """Projected features (frames, D_text) of one clip (its valid samples only), in FP64."""
    config = model.config.audio
    w = weights(model, "model.audio_tower.")
    proj = weights(model, "model.audio_projector.")
    x = wave.double()
    x = (x - x.mean()) / torch.sqrt(((x - x.mean()) ** 2).mean() + 1e-7)
    h = x[None]  # (channels, samples)
    for i, (kernel, stride) in enumerate(zip(config.conv_kernel, config.conv_stride)):
        weight, bias = w[f"conv_layers.{i}.conv.weight"], w[f"conv_layers.{i}.conv.bias"]
        frames = (h.shape[1] - kernel) // stride + 1
        out = torch.stack([(weight * h[None, :, j * stride:j * stride + kernel]).sum((1, 2)) + bias
                           for j in range(frames)])  # (frames, channels)
        out = layer_norm(out, w[f"conv_layers.{i}.layer_norm.weight"], w[f"conv_layers.{i}.layer_norm.bias"], 1e-5)
        h = gelu(out).T
    x = layer_norm(h.T, w["feature_projection.layer_norm.weight"], w["feature_projection.layer_norm.bias"], 1e-5)
    x = x @ w["feature_projection.projection.weight"].T + w["feature_projection.projection.bias"]
    d = config.head_dim
    inv_freq = torch.tensor([config.rope_theta ** (-2 * j / d) for j in range(d // 2)], dtype=torch.float64)
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv_freq
    for i in range(config.depth):
        x = block(x, w, f"blocks.{i}.", config.num_heads, angles, gelu)
    x = layer_norm(x, w["layer_norm.weight"], w["layer_norm.bias"], 1e-5)
    x = gelu(x @ proj["linear_1.weight"].T + proj["linear_1.bias"])
    return x @ proj["linear_2.weight"].T + proj["linear_2.bias"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_audio_encoder_equals_a_per_clip_fp64_reference(model, dtype):
    lengths = [200, 137, 90]
    generator = torch.Generator().manual_seed(2)
    clips = [torch.randn(n, generator=generator) * 0.5 + 0.1 for n in lengths]
    batch = torch.full((3, max(lengths)), 1e4)  # padding far from the data: it must never reach a valid frame
    for b, clip in enumerate(clips):
        batch[b, :len(clip)] = clip
    tested = model.to(dtype)
    with torch.no_grad():
        features, frames = tested.model.audio_tower(batch.to(dtype), torch.tensor(lengths))
        got = tested.model.audio_projector(features)
    model.float()
    assert frames == [model.config.audio.num_frames(n) for n in lengths] == [24, 16, 10]
    for clip, got_clip in zip(clips, got.split(frames)):
        expected = audio_reference(model, clip)
        error = (got_clip.double() - expected).norm() / expected.norm()
        assert error <= 1e-6, error


def test_audio_errors_name_the_clip(model):
    with pytest.raises(ValueError, match="audio clip 1: 8 samples give 0 frames"):
        model.model.audio_tower(torch.zeros(2, 100), torch.tensor([100, 8]))


# ---- vision ----

def vision_reference(model, slices, h, w):
    """Projected tokens of one image or video: ``slices`` of raster-order patches (h·w, C·t·p·p), in FP64; each
    slice is attended alone, and its merged tokens come in raster order of the m×m blocks."""
    config = model.config.vision
    wt = weights(model, "model.vision_tower.")
    projection = weights(model, "model.multi_modal_projector.")["linear.weight"]
    m, d = config.spatial_merge_size, config.head_dim
    quarter = torch.tensor([config.rope_theta ** (-2 * j / (d // 2)) for j in range(d // 4)], dtype=torch.float64)
    out = []
    for patches in slices:
        x = patches.double() @ wt["patch_embed.proj.weight"].flatten(1).T + wt["patch_embed.proj.bias"]
        rows = torch.arange(h * w) // w
        cols = torch.arange(h * w) % w
        x = x + wt["position_embedding.rows.weight"][rows] + wt["position_embedding.cols.weight"][cols]
        angles = torch.cat([rows[:, None] * quarter, cols[:, None] * quarter], dim=-1)
        for i in range(config.depth):
            x = block(x, wt, f"blocks.{i}.", config.num_heads, angles, gelu_tanh)
        x = layer_norm(x, wt["post_layernorm.weight"], wt["post_layernorm.bias"], 1e-6)
        for bi in range(h // m):
            for bj in range(w // m):
                parts = [layer_norm(x[(bi * m + di) * w + bj * m + dj], wt["adapter.norm.weight"],
                                    wt["adapter.norm.bias"], 1e-6) for di in range(m) for dj in range(m)]
                y = gelu(torch.cat(parts) @ wt["adapter.linear_fc1.weight"].T + wt["adapter.linear_fc1.bias"])
                y = y @ wt["adapter.linear_fc2.weight"].T + wt["adapter.linear_fc2.bias"]
                out.append(y @ projection.T)
    return torch.stack(out)


def to_block_order(patches, h, w, m):
    """Raster-order rows -> the tower's order: the m×m patches of each merged token consecutive."""
    index = [(bi * m + di) * w + bj * m + dj for bi in range(h // m) for bj in range(w // m)
             for di in range(m) for dj in range(m)]
    return patches[index]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vision_tower_equals_a_per_image_fp64_reference(model, dtype):
    config = model.config.vision
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    generator = torch.Generator().manual_seed(3)
    # an image of 4x6 patches, a tall one of 6x2, and a video of two temporal slices of 2x4 patches
    inputs = [(1, 4, 6), (1, 6, 2), (2, 2, 4)]
    raster = [[torch.randn(h * w, width, generator=generator) for _ in range(t)] for t, h, w in inputs]
    pixels = torch.cat([to_block_order(s, h, w, 2) for (t, h, w), slices in zip(inputs, raster) for s in slices])
    tested = model.to(dtype)
    with torch.no_grad():
        got = tested.model.multi_modal_projector(tested.model.vision_tower(pixels.to(dtype), torch.tensor(inputs)))
    model.float()
    counts = [t * h * w // 4 for t, h, w in inputs]
    for (t, h, w), slices, got_one in zip(inputs, raster, got.split(counts)):
        expected = vision_reference(model, slices, h, w)
        error = (got_one.double() - expected).norm() / expected.norm()
        assert error <= 1e-6, error


def test_vision_errors_name_the_grid(model):
    width = 3 * 2 * 4 * 4
    with pytest.raises(ValueError, match=r"grid_thw\[0\].*max_patches_per_side = 16"):
        model.model.vision_tower(torch.zeros(18 * 2, width), torch.tensor([[1, 18, 2]]))
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        model.model.vision_tower(torch.zeros(3 * 2, width), torch.tensor([[1, 3, 2]]))
    with pytest.raises(ValueError, match="pixel_values has 5 patches"):
        model.model.vision_tower(torch.zeros(5, width), torch.tensor([[1, 2, 2]]))


# ---- configs ----

def test_tower_configs_round_trip_and_count_the_built_towers():
    from openrecipes.models.muse_spark.config import MuseSparkConfig

    # the tiny model, and the published decoder with towers of plausible full sizes (the widths are not published)
    large = MuseSparkConfig(
        vision=MuseSparkVisionConfig(hidden_size=1280, intermediate_size=5120, num_heads=16, out_hidden_size=4096),
        audio=MuseSparkAudioConfig(depth=32, hidden_size=1280, intermediate_size=5120, num_heads=20),
        image_token_id=1, video_token_id=2, audio_token_id=3)
    for config in (get_config(TINY), large):
        raw = config.to_hf_dict()
        assert raw["vision_config"]["depth"] == config.vision.depth and "vision" not in raw
        assert MuseSparkConfig.from_hf_dict(raw) == config
        assert config.text_only() == MuseSparkConfig.from_hf_dict(
            {k: v for k, v in raw.items() if k not in ("vision_config", "audio_config")})
        with torch.device("meta"):
            towers = build_muse_spark(config, device="meta").model
        counts = {prefix: sum(p.numel() for n, p in towers.named_parameters() if n.startswith(prefix))
                  for prefix in ("vision_tower.", "multi_modal_projector.", "audio_tower.", "audio_projector.")}
        assert counts["vision_tower."] + counts["multi_modal_projector."] == config.vision.params(config.hidden_size)
        assert counts["audio_tower."] + counts["audio_projector."] == config.audio.params(config.hidden_size)
    assert large.vision.depth == 50  # published


def test_tower_config_errors_name_the_field():
    from openrecipes.models.muse_spark.config import MuseSparkConfig

    raw = get_config(TINY).to_hf_dict()
    cases = [({"vision_config": {**raw["vision_config"], "deepstack_visual_indexes": [1]}},
              "unknown Muse Spark vision_config config field 'deepstack_visual_indexes'"),
             ({"audio_config": {**raw["audio_config"], "conv_kernel": [5]}}, "one entry per convolution"),
             ({"audio_config": {**raw["audio_config"], "num_heads": 3}}, "audio_config: hidden_size/num_heads"),
             ({"vision_config": {**raw["vision_config"], "hidden_act": "xielu"}}, "vision_config.hidden_act"),
             ({"vision_config": [1]}, "vision_config must be a JSON object"),
             ({"audio_config": {"hidden_size": 16}}, r"audio_config is missing required field\(s\) \['depth', "),
             ({"audio_token_id": None}, "audio_config is given but audio_token_id is not"),
             ({"audio_token_id": 250}, "must differ"),
             ({"image_token_id": 256}, "image_token_id=256 is outside the vocabulary")]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            MuseSparkConfig.from_hf_dict({**raw, **change}, source="x/config.json")
    assert MuseSparkConfig.from_hf_dict({**raw, "vision_config": {}, "audio_config": None}).vision is None
