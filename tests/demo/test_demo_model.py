"""ByteTransformer: shapes, causality, the loss it returns, the Muon/AdamW parameter split."""
import pytest
import torch
import torch.nn.functional as F

from gns_kernels.demo.model import ByteTransformer, bench_config


def _tiny(**kw):
    cfg = dict(vocab=256, dim=32, n_layers=2, n_heads=4, mlp_hidden=64, context=16)
    cfg.update(kw)
    return ByteTransformer(**cfg)


def test_shapes_and_bench_config():
    torch.manual_seed(0)
    m = _tiny()
    idx = torch.randint(0, 256, (3, 11))
    assert m(idx).shape == (3, 11, 256)
    assert m(idx).dtype == torch.float32
    cfg = bench_config()
    assert cfg == dict(vocab=256, dim=256, n_layers=4, n_heads=4, mlp_hidden=1024, context=128)
    big = ByteTransformer(**cfg)
    # embed + head: 2*256*256; per layer qkv 3*256^2 + out 256^2 + 3*256*1024 + 2 norms of 256
    expected = 2 * 256 * 256 + 4 * (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) + 256
    assert sum(p.numel() for p in big.parameters()) == expected


def test_causal_masking():
    torch.manual_seed(1)
    m = _tiny().eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 17) % 256     # change every token from position 9 on
    with torch.no_grad():
        a, b = m(idx), m(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    # and the future positions DO change (the test can fail if attention ignored context)
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3


def test_positions_matter():
    # RoPE: the same token sequence shifted by one position gives different logits at the
    # shared positions only through relative offsets; a permutation of earlier tokens
    # changes the last logit (the model is not a bag of bytes).
    torch.manual_seed(2)
    m = _tiny().eval()
    idx = torch.randint(0, 256, (1, 8))
    perm = idx[:, [1, 0, 2, 3, 4, 5, 6, 7]]
    with torch.no_grad():
        assert (m(idx)[0, -1] - m(perm)[0, -1]).abs().max() > 1e-4


def test_loss_is_cross_entropy_and_grads_flow():
    torch.manual_seed(3)
    m = _tiny()
    idx = torch.randint(0, 256, (4, 12))
    tgt = torch.randint(0, 256, (4, 12))
    logits = m(idx)
    expected = F.cross_entropy(logits.double().reshape(-1, 256), tgt.reshape(-1))
    loss = m(idx, tgt)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_parameter_split():
    m = _tiny()
    hidden, other = m.hidden_matrices(), m.other_parameters()
    assert len(hidden) == 2 * 5          # qkv, out, gate, up, down per layer
    assert all(p.dim() == 2 for p in hidden)
    ids = {id(p) for p in hidden} | {id(p) for p in other}
    assert len(ids) == len(list(m.parameters())) == len(hidden) + len(other)
    assert any(p is m.embed.weight for p in other) and any(p is m.lm_head.weight for p in other)
    assert m.embed.weight is not m.lm_head.weight  # untied


@pytest.mark.parametrize("kw", [dict(dim=30, n_heads=4), dict(n_layers=0), dict(context=-1),
                                dict(dim=12, n_heads=4)])
def test_bad_config(kw):
    with pytest.raises(ValueError, match="ByteTransformer"):
        _tiny(**kw)


def test_too_long_sequence():
    m = _tiny(context=8)
    with pytest.raises(ValueError, match="context"):
        m(torch.zeros(1, 9, dtype=torch.long))
