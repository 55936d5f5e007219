"""DeepSeek-V3 multi-token prediction against an FP64 reference written here from its definition (DeepSeek-V3 report
§2.2, Megatron-LM's multi_token_prediction.py), position by position: loss and every gradient; the main logits
unchanged by the MTP layer; and the reference's choices (the concatenation order, the normed main hidden state, the
document rule) each matter, so the comparison can fail."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from openrecipes.models.common.attention import Documents
from openrecipes.models.common.rope import rope_angles
from openrecipes.models.deepseek_v3.model import DeepseekV3DecoderLayer, build_deepseek_v3
from openrecipes.models.registry import get_config
from openrecipes.train import engine
from openrecipes.train.mtp_loss import MtpObjective, mtp_targets

WEIGHT = 0.3
# two rows of packed documents (lengths), so targets cross document starts and the row's end
LENGTHS = [[5, 9], [3, 4, 7]]


def _model(seed: int = 3):
    config = dataclasses.replace(get_config("deepseek-v3-tiny"), num_nextn_predict_layers=1, keep_mtp=True)
    model = build_deepseek_v3(config, dtype=torch.float64, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from 1 (so each one matters), a correction bias that changes the choice
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
            elif name.endswith("e_score_correction_bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
            elif "embed_tokens" in name or "lm_head" in name or "eh_proj" in name:
                param.mul_(10)  # logits far from uniform
    return model


def _batch(vocab: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(LENGTHS[0])
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS])
    position_ids = torch.tensor([[p for n in row for p in range(n)] for row in LENGTHS])
    documents = Documents.from_document_ids(document_ids)
    return {"input_ids": torch.randint(0, vocab, (len(LENGTHS), tokens), generator=generator),
            "position_ids": position_ids, "document_ids": document_ids,
            "loss_mask": (torch.rand(len(LENGTHS), tokens, generator=generator) < 0.75).long(),
            "cu_seqlens": documents.cu_seqlens, "max_seqlen": documents.max_seqlen}


def _rms(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _reference(model, batch, *, swap=False, prenorm=False, across_documents=False):
    """main loss / N + WEIGHT · MTP loss / N_1, from the definition, in plain loops over positions."""
    config, backbone = model.config, model.model
    ids, pos, mask = batch["input_ids"], batch["position_ids"], batch["loss_mask"]
    rows, tokens = ids.shape
    documents = Documents.from_document_ids(batch["document_ids"])
    angles = rope_angles(pos, config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
    h = backbone.embed_tokens(ids)
    for layer in backbone.layers.values():
        h = layer(h, angles, documents)
    normed = _rms(h, backbone.norm.weight, config.rms_norm_eps)
    head = model.lm_head.weight

    def ce(hidden, b, i, target):
        return -torch.log_softmax(hidden[b, i] @ head.T, dim=-1)[target]

    main, n_main = 0.0, 0
    for b in range(rows):
        for i in range(tokens - 1):
            if pos[b, i + 1] != 0 and mask[b, i + 1]:
                main, n_main = main + ce(normed, b, i, ids[b, i + 1]), n_main + 1
    mtp = model.model.mtp_layers[str(config.num_hidden_layers)]
    depth0 = h if prenorm else normed
    x = torch.zeros_like(h)
    for b in range(rows):
        for i in range(tokens):
            ahead = backbone.embed_tokens.weight[ids[b, i + 1] if i + 1 < tokens else 0]  # the last: no target
            parts = [_rms(ahead, mtp.enorm.weight, config.rms_norm_eps),
                     _rms(depth0[b, i], mtp.hnorm.weight, config.rms_norm_eps)]
            x[b, i] = mtp.eh_proj.weight @ torch.cat(parts[::-1] if swap else parts)
    block = DeepseekV3DecoderLayer.forward(mtp, x, angles, documents)  # the decoder layer the MTP layer holds
    h1 = _rms(block, mtp.shared_head.norm.weight, config.rms_norm_eps)
    loss, n_mtp = 0.0, 0
    for b in range(rows):
        for i in range(tokens - 2):
            same_document = across_documents or (pos[b, i + 1] != 0 and pos[b, i + 2] != 0)
            if same_document and mask[b, i + 2]:
                loss, n_mtp = loss + ce(h1, b, i, ids[b, i + 2]), n_mtp + 1
    return main / n_main + WEIGHT * loss / n_mtp


def _fp64_loss_sum(logits, targets, weights):
    """``engine.token_loss_sum`` without its cast to fp32 (training's loss dtype), so fp64 stays fp64 here."""
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (per_token * weights.flatten().to(per_token.dtype)).sum()


def _implementation(model, batch):
    mtp = MtpObjective(WEIGHT, 1, [batch], torch.device("cpu"))
    main = engine.microbatch_loss_sum(model, batch, mtp=mtp, loss_fn=_fp64_loss_sum)
    return main / engine.loss_weights(batch).sum() + mtp.take()


def _grads(model, objective):
    model.zero_grad()
    objective.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_loss_and_gradients_match_the_fp64_reference():
    model = _model()
    batch = _batch(model.config.vocab_size)
    expected, got = _reference(model, batch), _implementation(model, batch)
    assert got.dtype == torch.float64 and abs(got.item() - expected.item()) <= 1e-10 * abs(expected.item())
    ref_grads, grads = _grads(model, expected), _grads(model, got)
    assert ref_grads.keys() == grads.keys()
    mtp_params = [n for n in grads if n.startswith("model.mtp_layers.")]
    assert {n.rsplit(".", 2)[-2] for n in mtp_params} >= {"enorm", "hnorm", "eh_proj", "norm", "o_proj"}
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max()
        assert (grad - ref_grads[name]).abs().max() <= 1e-10 * max(scale, 1e-30), name
    assert all(grads[n].abs().max() > 0 for n in mtp_params if "experts" not in n), "an MTP parameter got no gradient"


@pytest.mark.parametrize("variant", ["swap", "prenorm", "across_documents"])
def test_each_choice_of_the_reference_changes_the_loss(variant):
    """The comparison above can fail: the concatenation in the other order, the main hidden state before its final
    norm, or targets taken across a document start each give another loss."""
    model = _model()
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        assert abs((_reference(model, batch, **{variant: True}) - _implementation(model, batch)).item()) > 1e-4


def test_the_main_logits_do_not_change():
    """The MTP layer runs only when asked, and leaves the main output as it is (transformers' parity holds)."""
    model = _model()
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        plain = model(batch["input_ids"], batch["position_ids"])
        logits, hidden = model(batch["input_ids"], batch["position_ids"], mtp=True)
        without = build_deepseek_v3(dataclasses.replace(model.config, keep_mtp=False), dtype=torch.float64, seed=3)
        without.load_state_dict(model.state_dict(), strict=False)
    assert torch.equal(plain, logits) and len(hidden) == 1
    assert torch.equal(without(batch["input_ids"], batch["position_ids"]), plain)


def test_depth_zero_targets_are_the_main_loss_targets():
    """The MTP target rule is the main loss's rule shifted: at depth 0 it gives the main loss's weights exactly."""
    batch = _batch(1024, seed=1)
    targets, weights = mtp_targets(batch, 0)
    assert torch.equal(weights, F.pad(engine.loss_weights(batch), (0, 1)))
    assert torch.equal(targets[:, :-1], batch["input_ids"][:, 1:])
    _, depth1 = mtp_targets(batch, 1)
    assert depth1[0, :4].tolist() == [batch["loss_mask"][0, i + 2].item() for i in range(3)] + [0]  # 4 -> doc 2
    assert depth1[:, -2:].sum() == 0  # past the row's end


def test_a_model_without_mtp_layers_refuses_the_mtp_forward():
    model = build_deepseek_v3(get_config("deepseek-v3-tiny"), device="meta", seed=None)
    with pytest.raises(ValueError, match="holds no multi-token-prediction layer"):
        model(torch.zeros(1, 4, dtype=torch.long, device="meta"), mtp=True)
