"""A model run chunk by chunk (``forward(..., layers=range)``, how an interleaved pipeline rank runs each of its
virtual stages) gives the whole forward's logits: the embedding belongs to layer 0's chunk, norm and head to the last."""

import pytest
import torch

from openrecipes.models.families import family_for_config
from openrecipes.models.registry import get_config


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "muse-spark-tiny"])
def test_chunks_in_order_give_the_whole_forward(name):
    config = get_config(name)
    model = family_for_config(config).build(config, device="cpu", dtype=torch.float32, seed=0)
    input_ids = torch.randint(1, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(input_ids)
        h = input_ids
        for chunk in (range(0, 1), range(1, 3), range(3, config.num_hidden_layers)):
            h = model(h, layers=chunk)
        middle = model(model(input_ids, layers=range(0, 1)), layers=range(1, 3))
    assert torch.equal(h, whole)
    assert middle.shape == (2, 24, config.hidden_size)  # a middle chunk hands on hidden states
