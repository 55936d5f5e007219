"""Model families: the contract each family package declares, in one ``ModelFamily`` object.

A family declares its named configs, how to read and write a Hugging Face config and map tensor names, how to build
the native model, the shape the planner works on, its chat format, and a plain-string sharding plan that
``openrecipes.parallel`` applies. The checkpoint code, the planner, the registry and the parallel step are written
once against this contract; ``openrecipes.models.registry`` lists the families (one line each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from openrecipes.models.shape import ModelShape


TP_STYLES = ("colwise", "rowwise")


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """Where the parts parallelism splits live (module paths from the model, or from a decoder layer) and how.

    ``attention_tp``: tensor-parallel style per attention projection (``colwise``: split the output features by head;
    ``rowwise``: split the input features, output reduce-scattered over the sequence). Every attention module
    exposes ``num_heads`` and ``num_kv_heads`` (what tensor parallelism splits), ``head_dim`` and an assignable
    ``backend`` (a kernel name or a callable: context parallelism's).
    ``experts``: the grouped expert weights (E, ...), split over expert-parallel ranks by their first dimension;
    ``etp`` splits the dimension named for each.
    ``replicated``: name patterns of the tensors whole on every TP rank (their gradients are summed over it): dense
    MLPs and shared experts among them, which run on each rank's sequence slice like the norms.
    ``dense_layer``: whether a decoder layer's block at ``moe`` is a dense MLP rather than a MoE block (DeepSeek-V3's
    first layers); such a layer has no experts, so expert parallelism and expert recompute pass it by.
    """

    layers: str                         # the ModuleDict of decoder layers, keyed by global layer index
    embedding: str                      # dropped by every pipeline stage but the first
    final_norm: str                     # dropped by every stage but the last
    lm_head: str                        # dropped by every stage but the last
    attention: str                      # within a decoder layer
    moe: str                            # within a decoder layer: router + experts + token_dispatcher (or a dense MLP)
    attention_tp: dict[str, str]
    experts: dict[str, int]             # within ``moe.experts``: each grouped weight -> the dim of its FFN width
    replicated: tuple[str, ...]
    dense_layer: Callable[[nn.Module], bool] = lambda layer: False
    # a ModuleDict (or None where the model holds none) of layers built like the decoder layers that run after them
    # outside ``layers`` (DeepSeek-V3's multi-token-prediction layers): expert parallelism, recompute, compile and
    # FSDP2 treat them as decoder layers; pipeline stages never hold them (a recipe's ``mtp`` refuses pp)
    extra_layers: str | None = None

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers, then the ``extra_layers`` the model holds."""
        extra = None if self.extra_layers is None else self.part(model, self.extra_layers)
        return list(model.get_submodule(self.layers).values()) + (list(extra.values()) if extra is not None else [])

    def layer_dict(self, model: nn.Module) -> nn.ModuleDict:
        return model.get_submodule(self.layers)

    def attention_of(self, layer: nn.Module) -> nn.Module:
        return layer.get_submodule(self.attention)

    def moe_of(self, layer: nn.Module) -> nn.Module | None:
        """The layer's MoE block, or None where the layer is dense."""
        return None if self.dense_layer(layer) else layer.get_submodule(self.moe)

    def feed_forward_of(self, layer: nn.Module) -> nn.Module:
        """The block after attention: a MoE block or a dense MLP."""
        return layer.get_submodule(self.moe)

    def experts_of(self, layer: nn.Module) -> nn.Module:
        """What expert recompute checkpoints: the routed experts, or a dense layer's whole MLP."""
        block = self.moe_of(layer)
        return self.feed_forward_of(layer) if block is None else block.experts

    def moe_blocks(self, layers: Iterable[nn.Module]) -> list[nn.Module]:
        """The MoE blocks of ``layers``, in order (dense layers left out)."""
        return [block for block in map(self.moe_of, layers) if block is not None]

    def part(self, model: nn.Module, path: str) -> nn.Module | None:
        """The submodule at ``path``, or None where a pipeline stage dropped it."""
        parent, _, name = path.rpartition(".")
        return getattr(model.get_submodule(parent) if parent else model, name)

    def drop(self, model: nn.Module, path: str) -> None:
        """Set the submodule at ``path`` to None (a pipeline stage that does not run it)."""
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, None)


@dataclass(frozen=True, kw_only=True)
class ImageInputs:
    """What a family whose model takes images declares, so training is written once for every such family.

    Its forward takes the microbatch's image inputs as keywords (``pixel_values``, ``image_grid_thw``,
    ``image_tokens_held``: data/image_batch.py) and places the held image features at its image tokens.
    ``towers``: module paths of the encoders, never trained (no gradients, no optimizer state); ``projection``:
    module paths of what maps their features into the decoder, trained or frozen by the recipe
    (``vision.train_projection``).
    """

    towers: tuple[str, ...]
    projection: tuple[str, ...]
    image_token_id: Callable[[Any], int]                       # config -> the image placeholder token's id
    patch_geometry: Callable[[Any], tuple[int, int, int]]      # config -> (patch, temporal patch, merge) sizes
    # (config, input_ids, per-document position_ids (B, T), image_grid_thw, image_tokens_held) -> the positions the
    # forward takes for the whole rows (before context parallelism cuts them)
    positions: Callable[..., torch.Tensor]
    first_stage_layers: Callable[[Any], int]                   # config -> decoder layers the towers' stage must run
    # (config, module path) -> whether the config's model holds that declared tower or projection: a family whose
    # towers are optional (Muse Spark: each with its config section) leaves out what a config lacks; a config whose
    # model holds no projection takes no images (a text-only config)
    holds: Callable[[Any, str], bool] = lambda config, path: True

    def modules(self, config: Any) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """(towers, projection) the config's model holds, or None when it takes no images."""
        if not all(self.holds(config, path) for path in self.projection):
            return None
        return (tuple(p for p in self.towers if self.holds(config, p)),
                tuple(p for p in self.projection if self.holds(config, p)))


@dataclass(frozen=True, kw_only=True)
class RouterAuxLoss:
    """What a family declares when its router takes transformers' load-balancing loss (a softmax top-k router:
    models/common/router_loss.py) and the recipe's ``moe.aux_loss_coef`` may turn it on: the config fields, by their
    Hugging Face names, through which a checkpoint asks its own forward to add the loss and with what weight (a
    recipe must then match it). A family without one (its router balances otherwise) has the loss refused."""

    request_key: str = "output_router_logits"       # bool: the checkpoint's forward adds the loss
    coefficient_key: str = "router_aux_loss_coef"   # float: the weight it adds it with

    def requested(self, config: Any) -> bool:
        return bool(getattr(config, self.request_key))

    def coefficient(self, config: Any) -> float:
        return float(getattr(config, self.coefficient_key))


@dataclass(frozen=True, kw_only=True)
class MultiTokenPrediction:
    """What a family declares when its checkpoints may hold multi-token-prediction layers (DeepSeek-V3's, after the
    last decoder layer), so import, export and the recipe's ``mtp`` are written once. A config says how many the
    model holds; a run keeps them only when its recipe trains them (``checkpoint.hf.recipe_model_config``)."""

    held: Callable[[Any], int]                  # config -> the MTP layers its model holds
    keep: Callable[[Any, bool], Any]            # (config, keep) -> the config holding (True) or leaving out its own
    # (HF name, config) -> the native parts of a held MTP layer's tensor (as ``ModelFamily.native_parts``); None for
    # any other tensor
    native_parts: Callable[[str, Any], list[tuple[str, Any]] | None]


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    name: str
    named_configs: dict[str, Callable[[], Any]]               # registry name -> config factory
    model_class: type                                         # what ``build`` returns
    planner_shape: Callable[[Any, str], ModelShape]           # (config, name) -> the planner's shape
    chat_format: str                                          # its loss mask / built-in chat template name
    sharding: ShardingPlan
    model_types: tuple[str, ...]                              # config.json "model_type" values it reads
    config_class: type
    config_from_hf: Callable[[dict[str, Any], str], Any]      # (raw config.json, source name) -> config
    config_to_hf: Callable[[Any], dict[str, Any]]
    build: Callable[..., nn.Module]                           # build(config, *, device, dtype, seed, kernels)
    # HF name -> [(native name, part)]: which native parameter(s) it fills and where (common/hf_experts.Part)
    native_parts: Callable[[str], list[tuple[str, Any]]]
    # (native (name, tensor) stream, config, expert layout or None for the family's default) -> HF tensors
    to_hf: Callable[[Iterable[tuple[str, torch.Tensor]], Any, str | None], Iterator[tuple[str, torch.Tensor]]]
    # (HF name, config) -> true for a tensor import skips (and counts): a tower the config does not hold (text-only),
    # an MTP layer a run does not train; a string is the phrase the import's note says of such tensors
    ignored_key: Callable[[str, Any], bool | str] | None = None
    # config -> the config of the text model alone (text-only mode), for families whose checkpoints also hold
    # perception towers that the language model can run without; None: the family has no such mode
    text_only: Callable[[Any], Any] | None = None
    images: ImageInputs | None = None                         # None: a text-only model
    aux_loss: RouterAuxLoss | None = None                     # None: the router load-balancing loss is refused
    mtp: MultiTokenPrediction | None = None                   # None: no MTP layers (a recipe's mtp is refused)
    # (layout field, why) for each parallel dimension the family's model does not run split; the layout rules
    # refuse those before any process starts (config/layout.py unsupported_reason)
    not_split: tuple[tuple[str, str], ...] = ()


def _families() -> tuple[ModelFamily, ...]:
    from openrecipes.models.registry import families

    return families()


def family_for_model_type(model_type: str | None, *, source: str) -> ModelFamily:
    for family in _families():
        if model_type in family.model_types:
            return family
    known = sorted(t for f in _families() for t in f.model_types)
    raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: {known}")


def family_for_config(config: Any) -> ModelFamily:
    for family in _families():
        if isinstance(config, family.config_class):
            return family
    raise ValueError(f"no model family for config of type {type(config).__name__}")


def family_for_model(model: nn.Module) -> ModelFamily:
    for family in _families():
        if isinstance(model, family.model_class):
            return family
    raise ValueError(f"no model family builds {type(model).__name__}")
