"""Muse Spark's forward with images, a video and audio: tower features replace the embeddings of their tokens, and a
tiny complete Muse Spark with frozen towers takes an optimizer step on an image-text batch (CPU)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.registry import get_config

CONFIG = get_config("muse-spark-tiny-full")
IMAGE, VIDEO, AUDIO = CONFIG.image_token_id, CONFIG.video_token_id, CONFIG.audio_token_id
WIDTH = 3 * 2 * 4 * 4  # C · temporal patch · patch · patch


def _text(generator, n):
    return torch.randint(0, 200, (n,), generator=generator).tolist()


def test_features_replace_the_embeddings_at_their_tokens():
    model = build_muse_spark(CONFIG, seed=1)
    generator = torch.Generator().manual_seed(0)
    rows = [_text(generator, 2) + [IMAGE] * 6 + _text(generator, 3) + [AUDIO] * 16 + _text(generator, 2),
            _text(generator, 4) + [VIDEO] * 4 + [IMAGE] * 1 + _text(generator, 20)]
    ids = torch.tensor(rows)
    media = dict(pixel_values=torch.randn(24 + 4, WIDTH, generator=generator),
                 image_grid_thw=torch.tensor([[1, 4, 6], [1, 2, 2]]),
                 pixel_values_videos=torch.randn(16, WIDTH, generator=generator),
                 video_grid_thw=torch.tensor([[2, 2, 4]]),
                 audio_values=torch.randn(1, 137, generator=generator), audio_lengths=torch.tensor([137]))
    with torch.no_grad():
        got = model(ids, **media)
        towers = model.model
        h = towers.language_model.embed_tokens(ids)
        h[ids == IMAGE] = towers.multi_modal_projector(towers.vision_tower(media["pixel_values"],
                                                                           media["image_grid_thw"]))
        h[ids == VIDEO] = towers.multi_modal_projector(towers.vision_tower(media["pixel_values_videos"],
                                                                           media["video_grid_thw"]))
        h[ids == AUDIO] = towers.audio_projector(towers.audio_tower(media["audio_values"], media["audio_lengths"])[0])
        embedding, towers.language_model.embed_tokens = towers.language_model.embed_tokens, None
        expected = model(h)  # the decoder on hidden states, as a later pipeline stage runs it
        towers.language_model.embed_tokens = embedding
        assert torch.equal(got, expected)
        # the features move the logits: other pixels change them from the first image token on
        other = model(ids, **{**media, "pixel_values": media["pixel_values"] + 1.0})
    first = rows[0].index(IMAGE)
    assert torch.equal(other[0, :first], got[0, :first]) and not torch.allclose(other[0, first:], got[0, first:])
    with pytest.raises(ValueError, match="input_ids hold 7 tokens of image_token_id 250, the inputs give 6"):
        model(ids, pixel_values=media["pixel_values"][:24], image_grid_thw=media["image_grid_thw"][:1])
    text_only = build_muse_spark(CONFIG.text_only(), seed=1)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only(ids, pixel_values=media["pixel_values"], image_grid_thw=media["image_grid_thw"])


def test_frozen_towers_take_no_gradient_in_an_image_text_step():
    pytest.importorskip("PIL")
    from openrecipes.data.images import ImageProcessorConfig, preprocess_images

    model = build_muse_spark(CONFIG, seed=2)
    towers = [model.model.vision_tower, model.model.audio_tower, model.model.audio_projector]
    for tower in towers:
        tower.requires_grad_(False)
    processor = ImageProcessorConfig(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                     max_pixels=24 * 24)
    rng = np.random.default_rng(0)
    pixels, grids = preprocess_images([rng.integers(0, 256, (23, 17, 3), dtype=np.uint8),
                                       rng.integers(0, 256, (9, 30, 3), dtype=np.uint8)], processor)
    tokens = [int(t * h * w) // 4 for t, h, w in grids.tolist()]
    generator = torch.Generator().manual_seed(1)
    rows = [_text(generator, 3) + [IMAGE] * tokens[0] + _text(generator, 12),
            _text(generator, 2) + [IMAGE] * tokens[1] + _text(generator, 13)]
    width = max(len(row) for row in rows)
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    labels = ids.masked_fill(ids == IMAGE, -100)  # image tokens are never supervised
    labels[1, len(rows[1]):] = -100

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    frozen_before = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    projector_before = model.model.multi_modal_projector.linear.weight.detach().clone()
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        logits = model(ids, pixel_values=pixels, image_grid_thw=grids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        if not losses:
            assert all(p.grad is None for tower in towers for p in tower.parameters())
            assert model.model.multi_modal_projector.linear.weight.grad.abs().sum() > 0
            assert model.model.language_model.layers["0"].self_attn.q_proj.weight.grad.abs().sum() > 0
        optimizer.step()
        losses.append(loss.item())
    assert len(optimizer.state) == len(trainable) < len(list(model.parameters()))  # no state for the towers
    assert all(torch.equal(p, frozen_before[name]) for name, p in model.named_parameters() if not p.requires_grad)
    assert not torch.equal(model.model.multi_modal_projector.linear.weight, projector_before)
    assert losses[1] < losses[0] and all(np.isfinite(losses))
