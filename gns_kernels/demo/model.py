"""A small byte-level Llama-style transformer for the demo and the overhead benchmark.

Architecture (Llama 3 style, pre-norm, no biases anywhere):

    tokens (batch, T) int64 in [0, vocab)
      -> embedding  W_emb (vocab, dim)
      -> n_layers x [ x += Attn(RMSNorm(x)) ; x += SwiGLU(RMSNorm(x)) ]
      -> RMSNorm -> lm_head W_out (vocab, dim)     (UNTIED from W_emb)
      -> logits (batch, T, vocab) float32

- RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight            (weight: (dim,), init 1)
- Attention: causal multi-head self-attention through F.scaled_dot_product_attention
  (is_causal=True), head_dim = dim / n_heads, rotary position embeddings (RoPE, base
  10000) applied to queries and keys; fused qkv projection (3*dim, dim) and output
  projection (dim, dim).
- SwiGLU MLP: W_down( silu(W_gate x) * W_up x ), W_gate/W_up (mlp_hidden, dim),
  W_down (dim, mlp_hidden).

Embeddings are untied on purpose: in the usual Muon composite the 2-D hidden weights
(attention and MLP matrices) go to Muon and everything else (embedding, lm_head, norm
gains) to AdamW; an untied head keeps that split clean. `hidden_matrices()` returns the
2-D hidden weights, `other_parameters()` the rest.

Positions are relative (RoPE), so there is no learned position table; sequences may be
at most `context` tokens long (the RoPE tables are precomputed to that length).

Initialisation: every linear/embedding weight N(0, 0.02^2); the two residual output
projections (attention out, MLP down) N(0, (0.02 / sqrt(2 n_layers))^2), as in GPT-2.

The overhead benchmark (`gns-kernels bench overhead`) uses ``ByteTransformer(vocab=256, dim=256,
n_layers=4, n_heads=4, mlp_hidden=1024, context=128)`` (4.33M parameters);
`bench_config()` returns those keyword arguments.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ByteTransformer", "RMSNorm", "bench_config"]


def bench_config() -> dict:
    """Keyword arguments of the overhead-benchmark model."""
    return dict(vocab=256, dim=256, n_layers=4, n_heads=4, mlp_hidden=1024, context=128)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2, last dim) + eps) * weight; computed in float32, cast back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def _rope_tables(context: int, head_dim: int, base: float = 10000.0):
    """cos, sin tables of shape (context, head_dim/2) for rotary embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(context, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos().float(), freqs.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x (batch, heads, T, head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q = _apply_rope(q, cos[:t], sin[:t])
        k = _apply_rope(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, mlp_hidden: int):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ByteTransformer(nn.Module):
    """Byte-level Llama-style causal language model (see the module docstring).

    Args:
        vocab: vocabulary size (256 for raw bytes).
        dim: model width; must be divisible by n_heads, and dim/n_heads even (RoPE).
        n_layers: number of transformer blocks (>= 1).
        n_heads: attention heads.
        mlp_hidden: SwiGLU hidden width.
        context: maximum sequence length T.

    forward(idx) -> logits (batch, T, vocab); forward(idx, targets) -> scalar mean
    cross-entropy (nats per byte) over all batch*T positions.
    """

    def __init__(self, vocab: int = 256, dim: int = 256, n_layers: int = 4, n_heads: int = 4,
                 mlp_hidden: int = 1024, context: int = 128):
        super().__init__()
        for name, value in dict(vocab=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
                                mlp_hidden=mlp_hidden, context=context).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ByteTransformer: {name} must be a positive int, got {value!r}")
        if dim % n_heads != 0 or (dim // n_heads) % 2 != 0:
            raise ValueError(
                f"ByteTransformer: dim ({dim}) must be divisible by n_heads ({n_heads}) "
                f"with an even head dimension (rotary embeddings)")
        self.config = dict(vocab=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
                           mlp_hidden=mlp_hidden, context=context)
        self.context = context
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, mlp_hidden) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        cos, sin = _rope_tables(context, dim // n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                s = std / math.sqrt(2 * n_layers) if name.endswith(("attn.out.weight", "mlp.down.weight")) else std
                nn.init.normal_(p, mean=0.0, std=s)

    def hidden_matrices(self) -> list[nn.Parameter]:
        """The 2-D weights inside the blocks (attention + MLP): Muon's/SpecSGD's share."""
        return [p for p in self.blocks.parameters() if p.dim() == 2]

    def other_parameters(self) -> list[nn.Parameter]:
        """Everything not in hidden_matrices(): embedding, lm_head, norm gains (AdamW)."""
        hidden = {id(p) for p in self.hidden_matrices()}
        return [p for p in self.parameters() if id(p) not in hidden]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"ByteTransformer: idx must be (batch, T), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"ByteTransformer: sequence length {t} exceeds context {self.context}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(x)).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
