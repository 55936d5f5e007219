"""Qwen3-VL-MoE in pure PyTorch: the vision tower (vision.py) and the Qwen3-MoE decoder (its layers reused), joined
as transformers joins them: image features replace the embeddings of the image tokens, DeepStack features are added
to the image positions after the first decoder layers, and every token is rotated by M-RoPE (temporal, height and
width positions; a text token has all three equal). Parameter names follow ``Qwen3VLMoeForConditionalGeneration``,
except the experts, which are grouped 3-D tensors as in Qwen3-MoE.

Legend: B rows, T tokens per row, D hidden, V vocabulary, Dh head dim, F = Dh/2 rotary frequencies.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from openrecipes.models.common.attention import Documents
from openrecipes.models.common.init import SeededFill, build_on_meta, fill_seeded_normal_
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.norms import RMSNorm
from openrecipes.models.qwen3_moe.model import Qwen3MoeBackbone
from openrecipes.models.qwen3_vl_moe.config import Qwen3VLMoeConfig
from openrecipes.models.qwen3_vl_moe.vision import VisionModel


def mrope_axis(config: Qwen3VLMoeConfig) -> torch.Tensor:
    """For each rotary frequency, the position it follows: 0 temporal, 1 height, 2 width (interleaved sections)."""
    axis = torch.zeros(config.text.head_dim // 2, dtype=torch.long)
    for dim in (1, 2):
        axis[dim:3 * config.mrope_section[dim]:3] = dim
    return axis


def mrope_angles(position_ids_3BT: torch.Tensor, config: Qwen3VLMoeConfig) -> torch.Tensor:
    """Angles (B, T, F) in fp32: frequency i turns with the position of its axis (``mrope_axis``)."""
    head_dim = config.text.head_dim
    inv_freq = 1.0 / (config.text.rope_theta ** (torch.arange(0, head_dim, 2, device=position_ids_3BT.device)
                                                 .float() / head_dim))
    axis = mrope_axis(config).to(position_ids_3BT.device)
    chosen_BTF = position_ids_3BT.float().permute(1, 2, 0)[..., axis]
    return chosen_BTF * inv_freq


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                    config: Qwen3VLMoeConfig) -> torch.Tensor:
    """Position ids (3, B, T). Text tokens count up on all three axes; the tokens of one image (a run of image
    tokens, images in ``image_grid_thw`` order) all start at the position after the preceding token, plus their
    frame, row and column in the merged grid; the text after an image resumes at that start plus the larger of the
    merged grid's height and width."""
    rows, tokens = input_ids.shape
    m = config.vision.spatial_merge_size
    grids = iter([] if image_grid_thw is None else [[int(v) for v in g] for g in image_grid_thw.tolist()])
    out = torch.zeros(3, rows, tokens, dtype=torch.long, device=input_ids.device)
    for row, flags in enumerate((input_ids == config.image_token_id).tolist()):
        t, pos = 0, 0
        for is_image, run in itertools.groupby(flags):
            end = t + len(list(run))
            if not is_image:  # a text run: positions count up on all three axes
                out[:, row, t:end] = torch.arange(pos, pos + end - t, device=out.device)
                t, pos = end, pos + end - t
            while is_image and t < end:  # one or more images back to back
                grid = next(grids, None)
                if grid is None:
                    raise ValueError(f"row {row}: more images in input_ids than image_grid_thw entries")
                frames, h, w = grid[0], grid[1] // m, grid[2] // m
                count = frames * h * w
                if t + count > end:
                    raise ValueError(f"row {row}: the image at token {t} needs {count} image tokens, "
                                     f"the run has {end - t}")
                axes = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij")
                out[:, row, t:t + count] = torch.stack(axes).flatten(1).to(out.device) + pos
                t, pos = t + count, pos + max(h, w)
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more entries than images in input_ids")
    return out


def held_feature_index(image_grid_thw: torch.Tensor, held: torch.Tensor, merge: int) -> torch.Tensor:
    """Indices into the merged features of all images (``VisionModel``'s output) of the tokens each image's rows hold:
    tokens first .. first + count - 1 of image k, for each (first, count) of ``held``, in order."""
    tokens = (image_grid_thw.prod(dim=1) // (merge * merge)).tolist()
    offsets = [0, *itertools.accumulate(tokens)]
    index = []
    for k, (first, count) in enumerate(held.tolist()):
        if first < 0 or count < 0 or first + count > tokens[k]:
            raise ValueError(f"image {k}: tokens {first}..{first + count - 1} held, the image has {tokens[k]}")
        index.append(torch.arange(offsets[k] + first, offsets[k] + first + count))
    return torch.cat(index).to(image_grid_thw.device)


def packed_mrope_positions(position_ids: torch.Tensor, image_mask: torch.Tensor, image_grid_thw: torch.Tensor,
                           held: torch.Tensor, config: Qwen3VLMoeConfig) -> torch.Tensor:
    """M-RoPE positions (3, B, T) of packed rows from their per-document positions (B, T), restarting at 0 at each
    document: what ``mrope_positions`` gives each document on its own. The tokens of image k (its tokens first ..
    first + count - 1, the k-th run of image tokens in row-major order) stand at the position p of the run's first
    token plus their (frame, row, column) in the merged grid; the document's text after the image resumes at p plus
    the largest of the merged grid's frames, height and width. An image a row boundary cut is placed the same way
    from where its held tokens begin (p: 0 at the start of a row)."""
    m = config.vision.spatial_merge_size
    out = position_ids[None].repeat(3, 1, 1)
    flat = image_mask.reshape(-1).nonzero().flatten().tolist()
    rows, tokens = position_ids.shape
    cursor = 0
    for (frames, h, w), (first, count) in zip(image_grid_thw.tolist(), held.tolist()):
        h, w = h // m, w // m
        if count == 0:
            continue
        where = flat[cursor:cursor + count]
        cursor += count
        row, start = divmod(where[0], tokens)
        if len(where) != count or where[-1] != where[0] + count - 1 or (where[-1] // tokens) != row:
            raise ValueError(f"image tokens of row {row} at {start} do not form one run of {count}")
        k = torch.arange(first, first + count, device=out.device)
        frame, cell = k // (h * w), k % (h * w)
        grid = torch.stack([frame, cell // w, cell % w])
        base = out[0, row, start].clone()
        out[:, row, start:start + count] = base + grid
        stop = start + count
        if stop < tokens:
            ends = (position_ids[row, stop:] == 0).nonzero()  # the document ends where the next one starts
            end = stop + int(ends[0]) if ends.numel() else tokens
            out[:, row, stop:end] += base + max(frames, h, w) - out[0, row, stop]
    if cursor != len(flat):
        raise ValueError(f"input_ids hold {len(flat)} image tokens, image_tokens_held places {cursor}")
    return out


class Qwen3VLMoeModel(nn.Module):
    def __init__(self, config: Qwen3VLMoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.visual = VisionModel(config.vision)
        self.language_model = Qwen3MoeBackbone(config.text, kernels)


class Qwen3VLMoeForConditionalGeneration(nn.Module):
    """``forward(input_ids, position_ids=None, documents=None, *, pixel_values=None, image_grid_thw=None,
    image_tokens_held=None) -> logits (B, T, V)``. ``position_ids``: (B, T) for text, (3, B, T) M-RoPE positions, or
    None (computed from the image tokens and grids). ``image_tokens_held`` (K, 2): packed rows, where each image's
    tokens in ``input_ids`` are (first, count) of its own (a row boundary may cut an image) and ``position_ids``
    (B, T) restart at each document (``packed_mrope_positions``). A pipeline stage may drop the embedding or the
    final norm and head, as in Qwen3-MoE; images enter only a forward that runs the first decoder layers."""

    def __init__(self, config: Qwen3VLMoeConfig, kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3VLMoeModel(config, kernels)
        self.lm_head: nn.Linear | None = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, layers: range | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                image_tokens_held: torch.Tensor | None = None) -> torch.Tensor:
        text = self.model.language_model
        rows, tokens = input_ids.shape[:2]
        first = layers is None or layers.start == 0
        last = layers is None or layers.stop == self.config.text.num_hidden_layers
        h = text.embed_tokens(input_ids) if text.embed_tokens is not None and first else input_ids
        image_mask = deepstack = None
        # the layers this forward runs: a range, or every layer the model holds (a pipeline stage holds some)
        indices = [int(key) for key in text.layers] if layers is None else layers
        if pixel_values is not None:
            deep = len(self.config.vision.deepstack_visual_indexes)
            if text.embed_tokens is None or not set(range(deep)) <= set(indices):
                raise ValueError(f"images need a forward that runs the embedding and the first {deep} decoder "
                                 "layers (DeepStack adds image features after each)")
            if image_grid_thw is None:
                raise ValueError("pixel_values given without image_grid_thw")
            features, deepstack = self.model.visual(pixel_values, image_grid_thw)
            if image_tokens_held is not None:
                index = held_feature_index(image_grid_thw, image_tokens_held, self.config.vision.spatial_merge_size)
                features, deepstack = features[index], [d[index] for d in deepstack]
            image_mask = input_ids == self.config.image_token_id
            if int(image_mask.sum()) != features.shape[0]:
                raise ValueError(f"input_ids hold {int(image_mask.sum())} image tokens, the images give "
                                 f"{features.shape[0]} features")
            h = h.masked_scatter(image_mask[..., None], features.to(h.dtype))
        if image_tokens_held is not None and position_ids is not None and position_ids.dim() == 2:
            position_ids = packed_mrope_positions(position_ids, image_mask, image_grid_thw, image_tokens_held,
                                                  self.config)
        if position_ids is None:
            if pixel_values is not None:
                position_ids = mrope_positions(input_ids, image_grid_thw, self.config)
            else:
                position_ids = torch.arange(tokens, device=h.device).expand(rows, tokens)
        if position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        angles = mrope_angles(position_ids, self.config)
        for index in indices:
            h = text.layers[str(index)](h, angles, documents)
            if deepstack is not None and index < len(deepstack):
                h = h.masked_scatter(image_mask[..., None], h[image_mask] + deepstack[index].to(h.dtype))
        if text.norm is not None and last:
            h = text.norm(h)
        return self.lm_head(h) if self.lm_head is not None and last else h

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0, fill: SeededFill = fill_seeded_normal_) -> None:
        """Initialise every parameter (after ``to_empty``): norm weights 1, biases 0, the rest ~ N(0,
        initializer_range) from a generator seeded by (seed, name), the pad token's embedding row 0."""
        norms = {name for name, module in self.named_modules() if isinstance(module, (nn.LayerNorm, RMSNorm))}
        for name, param in self.named_parameters():
            owner = name.rpartition(".")[0]
            if owner in norms:
                param.fill_(1.0) if name.endswith(".weight") else param.zero_()
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = (self.config.vision.initializer_range if name.startswith("model.visual.")
                       else self.config.text.initializer_range)
                fill(param, name, seed=seed, std=std)
        embedding = self.model.language_model.embed_tokens
        if embedding is not None and embedding.padding_idx is not None:
            embedding.weight[embedding.padding_idx].zero_()


def build_qwen3_vl_moe(config: Qwen3VLMoeConfig, *, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int | None = 0,
                       kernels: KernelOptions = KernelOptions()) -> Qwen3VLMoeForConditionalGeneration:
    """Build on the meta device, materialise on ``device``, initialise; ``seed=None`` leaves memory uninitialised."""
    return build_on_meta(lambda: Qwen3VLMoeForConditionalGeneration(config, kernels), device=device, dtype=dtype, seed=seed)
