"""The package's shape: dependencies point down the layers, torch.distributed stays in the parallel engine, and
every registered model family declares the whole contract."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "openrecipes"

# what each package may import from openrecipes (besides itself); cli/demo/__init__ sit on top and may use all
ALLOWED = {
    "config": {"utils"},
    "utils": set(),
    "data": {"config", "utils"},
    "models": {"config", "utils"},
    "parallel": {"config", "models", "utils"},
    "optim": {"parallel", "utils"},
    "checkpoint": {"config", "data", "models", "parallel", "utils"},
    "measure": {"config", "utils"},
    "plan": {"config", "measure", "models", "utils"},  # measure: the MFU formula
    # train asks the planner (which imports none of these) whether a run fits the host before starting it
    "train": {"checkpoint", "config", "data", "models", "optim", "parallel", "plan", "utils"},
    "verify": {"config", "data", "measure", "models", "optim", "utils"},
    "cards": {"config", "data", "measure", "models", "utils", "verify"},
    "site": {"cards", "config", "utils"},
    # the tuner sits on top: it runs train (as a process), measure and verify, and writes cards and the site
    "tune": {"cards", "config", "data", "measure", "plan", "site", "train", "utils", "verify"},
}
DISTRIBUTED_PACKAGES = {"parallel", "train", "checkpoint"}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    package = _package(path)
    if package not in ALLOWED:
        return
    for module, names in _imports(path):
        if module.startswith("torch.distributed"):
            assert package in DISTRIBUTED_PACKAGES, f"{path.name} imports {module}"
        if not module.startswith("openrecipes."):
            continue
        other = module.split(".")[1]
        if other == package:
            continue
        assert other in ALLOWED[package], f"{package} must not import {module}"
        private = [name for name in names if name.startswith("_")]
        assert not private, f"{path.name} imports private {private} from {module}"


def test_every_family_declares_the_whole_contract():
    import torch

    from openrecipes.data.templates import LOSS_MASKS
    from openrecipes.models.common.kernels import KernelOptions
    from openrecipes.models.families import TP_STYLES, family_for_config, family_for_model
    from openrecipes.models.registry import families
    from openrecipes.models.shape import ModelShape

    assert len(families()) >= 2
    for family in families():
        assert family.named_configs and family.model_types and family.chat_format in LOSS_MASKS
        plan = family.sharding
        assert set(plan.attention_tp.values()) <= set(TP_STYLES) and plan.replicated and plan.experts
        for name, factory in family.named_configs.items():
            config = factory()
            assert family_for_config(config) is family
            assert isinstance(family.planner_shape(config, name), ModelShape)
        # the smallest named config is built and every path of the sharding plan resolves in it
        config = min((f() for f in family.named_configs.values()), key=lambda c: c.hidden_size)
        model = family.build(config, device="cpu", dtype=torch.float32, seed=0, kernels=KernelOptions())
        assert isinstance(model, family.model_class) and family_for_model(model) is family
        for path in (plan.embedding, plan.final_norm, plan.lm_head):
            model.get_submodule(path)
        layers = plan.decoder_layers(model)
        assert len(layers) == config.num_hidden_layers
        attention, moe = plan.attention_of(layers[0]), plan.moe_of(layers[0])
        assert attention.head_dim > 0 and attention.backend == "auto"
        assert all(hasattr(attention, name) for name in plan.attention_tp)
        for weight, ffn_dim in plan.experts.items():
            assert getattr(moe.experts, weight).dim() > ffn_dim
        names = [n for n, _ in model.named_parameters()]
        covered = [n for n in names if ".experts." in n or any(part in n for part in plan.replicated)
                   or any(f".{p}." in n for p in plan.attention_tp)]
        assert covered == names
        if family.images is not None:  # its towers and projection name modules, and with the decoder cover the model
            paths = family.images.towers + family.images.projection
            encoder = [f"{p}.{n}" for p in paths for n, _ in model.get_submodule(p).named_parameters()]
            decoder = (plan.layers, plan.embedding, plan.final_norm, plan.lm_head)
            assert encoder and len(set(encoder)) == len(encoder)
            assert sorted(encoder + [n for n in names if n.startswith(decoder)]) == sorted(names)
            assert 0 <= family.images.image_token_id(config) < config.vocab_size
            assert all(size > 0 for size in family.images.patch_geometry(config))
        # the router load-balancing loss: declared only by a family whose model routes with softmax top-k routers
        # (what models/common/router_loss.py pools), through config fields every named config holds
        from openrecipes.models.common.moe import SoftmaxTopKRouter

        if family.aux_loss is not None:
            assert any(isinstance(m, SoftmaxTopKRouter) for m in model.modules()), family.name
            for factory in family.named_configs.values():
                assert isinstance(family.aux_loss.requested(factory()), bool)
                assert family.aux_loss.coefficient(factory()) >= 0
                assert isinstance(getattr(factory(), family.aux_loss.request_key), bool)
        config_dict = family.config_to_hf(config)
        assert config_dict["model_type"] in family.model_types
