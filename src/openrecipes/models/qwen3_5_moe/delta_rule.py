"""The gated delta rule (Gated DeltaNet's recurrence) in pure PyTorch: a token-by-token reference and the chunked
form that trains, plus the causal depthwise convolution before it and the regrouping of packed documents.

Legend: B rows (or documents), H value heads, T tokens, K key width, V value width, C chunk length.

Per head, with a state S (K, V) that starts at zero, each token t decays the state by exp(g_t) (g_t <= 0), writes the
part of its value v_t that the decayed state does not already predict from its key k_t, with strength beta_t, and
reads the state with its query q_t:

    S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t

The chunked form gives the same outputs with matmuls. Within a chunk, let G_i be the cumulative sum of g up to
position i and S0 the state at the chunk's start. Unrolling the recurrence,

    u_i = beta_i v_i - beta_i exp(G_i) S0^T k_i - sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j

a unit lower-triangular system (I + A) U = beta V - diag(beta exp(G)) K S0, solved for the chunk's u at once. Then
o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j, and the state passed to the next chunk is
exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T. Both forms compute in fp32 at least (fp64 stays fp64): transformers'
torch fallback runs its delta rule in fp32 whatever the activation dtype.

Packed rows: a document must start from a zero state and a zero convolution history. ``DocumentBatch`` regroups a
batch's packed documents as rows of their own (padded at the end, which a causal computation never reads back), so
each document is computed exactly as it would be alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openrecipes.models.common.attention import Documents

DEFAULT_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule default


def chunked_flops_per_token(key_dim: int, value_dim: int, value_heads: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Forward FLOPs of ``gated_delta_rule_chunked`` per token, over every value head: within its chunk the key
    products (2CK), the triangular solve for both right-hand sides (C(K+V)), the query products and their weighting
    of u (2CK + 2CV); against the chunk's starting state the read by keys and by queries and the state's update
    (3 x 2KV). Constant in the row length, unlike softmax attention's."""
    per_head = chunk * (5 * key_dim + 3 * value_dim) + 6 * key_dim * value_dim
    return value_heads * per_head


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (the eps inside the root, as the FLA kernels place it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _wide(*tensors: torch.Tensor) -> list[torch.Tensor]:
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return [t.to(dtype) for t in tensors]


def gated_delta_rule_recurrent(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor,
                               g_BHT: torch.Tensor, beta_BHT: torch.Tensor) -> torch.Tensor:
    """The recurrence token by token (the reference: slow, obviously right). Returns (B, H, T, V) in fp32 or wider."""
    q, k, v, g, beta = _wide(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT)
    state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        written = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * written[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outputs, dim=2)


def gated_delta_rule_chunked(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor,
                             g_BHT: torch.Tensor, beta_BHT: torch.Tensor, *, chunk: int = DEFAULT_CHUNK
                             ) -> torch.Tensor:
    """The same outputs as ``gated_delta_rule_recurrent``, a chunk of ``chunk`` tokens at a time (module docstring).
    Tokens are padded at the end to a whole chunk with g = 0, beta = 0 and zero keys: they write nothing."""
    q, k, v, g, beta = _wide(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT)
    rows, heads, tokens, _ = q.shape
    pad = -tokens % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    split = lambda x: x.reshape(rows, heads, -1, chunk, *x.shape[3:])  # noqa: E731  (B, H, N, C, ...)
    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    cum_BHNC = g.cumsum(dim=-1)
    # exp(G_i - G_j) for j <= i; above the diagonal masked before exp, where the difference may overflow
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay_BHNCC = (cum_BHNC[..., :, None] - cum_BHNC[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strictly_lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    system = torch.eye(chunk, dtype=q.dtype, device=q.device) + (
        (k_beta @ k.transpose(-1, -2)) * decay_BHNCC).masked_fill(~strictly_lower, 0.0)
    # U = W_v - W_k S0, with both right-hand sides solved once for every chunk
    values_written = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, k_beta * cum_BHNC.exp()[..., None], upper=False,
                                              unitriangular=True)
    scores_BHNCC = (q @ k.transpose(-1, -2)) * decay_BHNCC
    q_decayed = q * cum_BHNC.exp()[..., None]
    k_to_end = k * (cum_BHNC[..., -1:] - cum_BHNC).exp()[..., None]
    state = q.new_zeros(rows, heads, k.shape[-1], v.shape[-1])
    outputs = []
    for n in range(q.shape[2]):
        u = values_written[:, :, n] - keys_read[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + scores_BHNCC[:, :, n] @ u)
        state = state * cum_BHNC[:, :, n, -1, None, None].exp() + k_to_end[:, :, n].transpose(-1, -2) @ u
    return torch.cat(outputs, dim=2)[:, :, :tokens]


def causal_depthwise_conv(x_BTC: torch.Tensor, weight_C1W: torch.Tensor) -> torch.Tensor:
    """y_t = sum_j w[W-1-j] x_{t-j} per channel, zeros before the row's start (transformers' causal_conv1d_fn
    without its activation). ``weight_C1W``: an nn.Conv1d's (channels, 1, kernel) weight."""
    width = weight_C1W.shape[-1]
    out = F.conv1d(x_BTC.transpose(1, 2), weight_C1W.to(x_BTC.dtype), padding=width - 1, groups=x_BTC.shape[-1])
    return out[..., :x_BTC.shape[1]].transpose(1, 2)


@dataclass(frozen=True)
class DocumentBatch:
    """The packed documents of a (B, T) batch as rows of their own, (N, L) with L the longest document: ``index``
    (N, L) the flat position (in B*T) of each document's tokens, ``valid`` (N, L) where a document has a token.

    The regrouped batch holds N x L tokens: about B x T when documents are of like length, more when one long
    document is packed beside many short ones (the price of exactness here; a kernel with cu_seqlens avoids it)."""

    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def build(cls, documents: Documents) -> "DocumentBatch":
        cu = documents.cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        offsets = torch.arange(documents.max_seqlen, device=cu.device)
        valid = offsets[None, :] < lengths[:, None]
        index = torch.where(valid, cu[:-1, None] + offsets[None, :], torch.zeros_like(offsets)[None, :])
        return cls(index=index, valid=valid)

    def gather(self, x_BT_: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, L, ...), zeros past each document's end."""
        flat = x_BT_.reshape(-1, *x_BT_.shape[2:])
        mask = self.valid.reshape(*self.valid.shape, *([1] * (flat.dim() - 1))).to(flat.dtype)
        return flat[self.index] * mask

    def scatter(self, x_NL_: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
        """(N, L, ...) -> (B, T, ...): documents are contiguous and in order, so their valid tokens are the flat
        batch in order."""
        return x_NL_[self.valid].reshape(rows, tokens, *x_NL_.shape[2:])
