import pytest
from pydantic import ValidationError

from openrecipes.config.layout import (LayoutConfig, LayoutModel, expert_data_parallel_size, rank_layers,
                                         stage_layer_counts, validate_layout, virtual_stage_layers)
from openrecipes.config.layout_space import enumerate_layouts

MUSE = dict(tp=4, pp=16, ep=8, dp=2, sequence_parallel=True, pp_first_stage_layers=3, pp_last_stage_layers=3,
            max_tokens_per_gpu=8192)


def test_seed_layouts_validate_with_their_stage_counts():
    counts = validate_layout(LayoutConfig(**MUSE), world_size=128, model=LayoutModel(num_layers=62, num_experts=256))
    assert counts == [3] + [4] * 14 + [3]
    qwen = LayoutConfig(ep=8, dp=8, max_tokens_per_gpu=16384, rows_per_microbatch=2)
    assert validate_layout(qwen, world_size=8, model=LayoutModel(num_layers=48, num_experts=128)) == [48]
    gb200 = LayoutConfig(tp=4, pp=6, ep=32, dp=8, sequence_parallel=True, pp_first_stage_layers=9,
                         pp_last_stage_layers=9, max_tokens_per_gpu=4096)
    muse = LayoutModel(num_layers=62, num_experts=256)
    assert validate_layout(gb200, world_size=192, model=muse) == [9, 11, 11, 11, 11, 9]
    assert expert_data_parallel_size(gb200) == 1
    assert expert_data_parallel_size(LayoutConfig(**MUSE)) == 1
    assert expert_data_parallel_size(LayoutConfig(tp=2, ep=2, dp=4, max_tokens_per_gpu=1)) == 4


@pytest.mark.parametrize("change, field", [
    (dict(dp=4), "dp"),  # world size 256 != 128
    (dict(ep=3), "ep"),  # 3 does not divide 256 experts
    (dict(ep=16, etp=2, tp=4, dp=2), "ep"),  # ep*etp = 32 does not divide tp*cp*dp = 8
    (dict(tp=1, dp=8, sequence_parallel=True), "sequence_parallel"),
    (dict(pp_first_stage_layers=4), "pp_first_stage_layers"),  # 62-4-3 = 55 over 14 stages
    (dict(vpp=3), "vpp"),
])
def test_validation_errors_name_the_field(change, field):
    with pytest.raises(ValueError) as info:
        validate_layout(LayoutConfig(**{**MUSE, **change}), world_size=128,
                        model=LayoutModel(num_layers=62, num_experts=256))
    assert str(info.value).startswith(f"layout.{field}: ")


def test_even_split_required_without_first_last():
    with pytest.raises(ValueError, match="^layout.pp: "):
        stage_layer_counts(LayoutConfig(pp=4, max_tokens_per_gpu=1), 62)
    assert stage_layer_counts(LayoutConfig(pp=2, max_tokens_per_gpu=1), 62) == [31, 31]
    assert stage_layer_counts(LayoutConfig(pp=3, pp_last_stage_layers=2, max_tokens_per_gpu=1), 62) == [30, 30, 2]
    with pytest.raises(ValueError, match="pp_first_stage_layers"):
        stage_layer_counts(LayoutConfig(pp=1, pp_first_stage_layers=3, max_tokens_per_gpu=1), 62)


def test_interleaved_chunks_take_turns_over_the_ranks():
    # 16 layers over pp=2 x vpp=2 with a lighter first stage (6 + 10): rank 0 holds 3 + 3, rank 1 holds 5 + 5
    layout = LayoutConfig(pp=2, vpp=2, pp_first_stage_layers=6, pp_last_stage_layers=10, max_tokens_per_gpu=1)
    assert virtual_stage_layers(layout, 16) == [range(0, 3), range(3, 8), range(8, 11), range(11, 16)]
    assert rank_layers(layout, 16, 0) == [(0, range(0, 3)), (2, range(8, 11))]
    assert rank_layers(layout, 16, 1) == [(1, range(3, 8)), (3, range(11, 16))]
    # without interleaving a rank's one chunk is its stage
    plain = LayoutConfig(pp=3, pp_last_stage_layers=2, max_tokens_per_gpu=1)
    assert [layers for _, layers in (rank_layers(plain, 62, r)[0] for r in range(3))] == [
        range(0, 30), range(30, 60), range(60, 62)]
    with pytest.raises(ValueError, match="^layout.vpp: "):
        virtual_stage_layers(LayoutConfig(pp=2, vpp=3, max_tokens_per_gpu=1), 16)


def test_model_forbids_unknown_keys_and_bad_sizes():
    with pytest.raises(ValidationError):
        LayoutConfig(tp=1, max_tokens_per_gpu=1, zero_stage=3)
    with pytest.raises(ValidationError):
        LayoutConfig(tp=0, max_tokens_per_gpu=1)


def test_enumeration_returns_only_valid_layouts():
    model = LayoutModel(num_layers=12, num_experts=8, kv_heads=4)
    layouts = enumerate_layouts(16, model=model, max_tokens_per_gpu=4096)
    assert len(layouts) > 10
    assert len({l.model_dump_json() for l in layouts}) == len(layouts)
    for layout in layouts:
        validate_layout(layout, world_size=16, model=model)
        assert 4 % layout.tp == 0 and layout.sequence_parallel == (layout.tp > 1)
    # uneven first/last splits are found, e.g. 12 layers on 4 stages as 3 + 3 + 3 + 3 and 2 + 4 + 4 + 2
    pp4 = {(l.pp_first_stage_layers, l.pp_last_stage_layers) for l in layouts if l.pp == 4}
    assert (None, None) in pp4 and (2, 2) in pp4
    assert {l.ep for l in layouts} == {1, 2, 4, 8}
