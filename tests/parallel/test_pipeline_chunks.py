"""An interleaved pipeline rank keeps its chunks' layers under the whole model's names, so every rank's checkpoint
keys are the whole model's (and together cover it), as without interleaving."""

import pytest
import torch

from openrecipes.config.layout import LayoutConfig, rank_layers
from openrecipes.models.families import family_for_config
from openrecipes.models.registry import get_config
from openrecipes.parallel.pipeline import build_pipeline, prune_to_stage


def test_interleaved_ranks_keep_the_whole_models_names():
    config = get_config("qwen3-moe-tiny")
    family = family_for_config(config)
    whole = {n for n, _ in family.build(config, device="meta", dtype=torch.float32, seed=None).named_parameters()}
    layout = LayoutConfig(pp=2, vpp=2, max_tokens_per_gpu=1)
    held = []
    for rank in range(layout.pp):
        model = family.build(config, device="meta", dtype=torch.float32, seed=None)
        keep = {i for _, layers in rank_layers(layout, config.num_hidden_layers, rank) for i in layers}
        prune_to_stage(model, family.sharding, keep, first=rank == 0, last=rank == layout.pp - 1)
        held.append({n for n, _ in model.named_parameters()})
    assert held[0] <= whole and held[1] <= whole and held[0] | held[1] == whole and not held[0] & held[1]
    # rank 0 runs layers 0 and 2 (virtual stages 0 and 2) with the embedding; rank 1 layers 1 and 3 with the head
    assert {n.split(".")[2] for n in held[0] if ".layers." in n} == {"0", "2"}
    assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" in held[1]


def test_interleaved_microbatch_counts_are_clear_errors():
    chunks = [(0, range(0, 1)), (2, range(2, 3))]
    common = dict(num_stages=4, device=torch.device("cpu"), group=None, loss_fn=None)
    with pytest.raises(ValueError, match="needs at least 2 microbatches"):
        build_pipeline(None, chunks, microbatches=1, **common)
    with pytest.raises(ValueError, match=r"^layout.vpp: .* 5 microbatches .* in 2 equal rounds"):
        build_pipeline(None, chunks, microbatches=5, **common)
