"""The exact mode's fused kernels (interpreted on the CPU, compiled on the GPU): each computes the transformers
formula it replaces, gives a row the same bits in any batch, carries that formula's gradients, and goes into the
forwards of the model families it serves, which come back as they were."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cb_sync.batch_invariant import fused_forwards as fused  # noqa: E402
from cb_sync.batch_invariant import fused_kernels  # noqa: E402
from cb_sync.batch_invariant.fused_forwards import with_reference_grad  # noqa: E402
from cb_sync.batch_invariant.fused_kernels import rms_norm, rotary, silu_mul  # noqa: E402
from cb_sync.batch_invariant.ops import suspended  # noqa: E402
from cb_sync.model_patching.swaps import module_list  # noqa: E402
from conftest import ARCHS, make_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _llama_norm(x, weight, eps):
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_computes_llamas_norm_and_gives_a_row_its_bits_in_any_batch(dtype):
    """Heads of a strided [T, H, D] view (a q projection's slice) and plain [T, D] rows of a width that is not a power
    of two."""
    fused_qkv = _randn(9, 3 * 4 * 24, dtype=dtype)
    heads = fused_qkv[:, :4 * 24].view(9, 4, 24)
    weight = _randn(24, dtype=dtype, seed=1)
    out = rms_norm(heads, weight, 1e-6, 0.0, dtype)
    assert out.shape == heads.shape and out.dtype == dtype
    torch.testing.assert_close(out, _llama_norm(heads, weight, 1e-6), rtol=2e-2, atol=2e-2)   # eager rounds twice
    for lo, hi in ((0, 1), (3, 4), (2, 9)):
        assert torch.equal(rms_norm(heads[lo:hi], weight, 1e-6, 0.0, dtype), out[lo:hi])
    rows = _randn(7, 100, dtype=dtype, seed=2)
    gemma = rms_norm(rows, weight.new_zeros(100), 1e-6, 1.0, dtype)
    torch.testing.assert_close(gemma, _llama_norm(rows.float(), torch.ones(100, device=DEVICE), 1e-6).to(dtype),
                               rtol=1e-2, atol=1e-2)
    assert torch.equal(rms_norm(rows[4:5], weight.new_zeros(100), 1e-6, 1.0, dtype), gemma[4:5])


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_computes_eagers_formula_for_transposed_heads_and_a_shared_table(dtype):
    """q [B, H, L, D] as the attention hands it (a transposed view), k of fewer heads, cos / sin of batch 1 or B:
    eager's formula up to its roundings (the kernel computes in fp32 and rounds once), in eager's layout."""
    q = _randn(2, 5, 4, 16, dtype=dtype).transpose(1, 2)
    k = _randn(2, 5, 2, 16, dtype=dtype, seed=1).transpose(1, 2)
    for batch in (1, 2):
        cos, sin = _randn(batch, 5, 16, dtype=dtype, seed=2), _randn(batch, 5, 16, dtype=dtype, seed=3)
        q_out, k_out = rotary(q, k, cos, sin)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        for out, x in ((q_out, q), (k_out, k)):
            eager = x * c + _rotate_half(x) * s
            assert out.stride() == eager.stride()
            if dtype == torch.float32:
                torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
            else:
                torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)


def test_silu_mul_computes_silu_times_up_and_gives_a_row_its_bits_in_any_batch():
    gate, up = _randn(6, 1500, dtype=torch.bfloat16), _randn(6, 1500, dtype=torch.bfloat16, seed=1)
    out = silu_mul(gate, up)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)   # eager rounds twice
    assert torch.equal(silu_mul(gate[2:3], up[2:3]), out[2:3])


def test_with_reference_grad_carries_the_references_gradients():
    x = _randn(5, 32).requires_grad_()
    weight = _randn(32, seed=1).requires_grad_()
    out = with_reference_grad(lambda a, w: rms_norm(a, w, 1e-6, 0.0, a.dtype),
                              lambda a, w: _llama_norm(a, w, 1e-6), x, weight)
    grad = _randn(5, 32, seed=2)
    out.backward(grad)
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    _llama_norm(x2, w2, 1e-6).backward(grad)
    assert torch.equal(x.grad, x2.grad) and torch.equal(weight.grad, w2.grad)


def _serve(monkeypatch):
    monkeypatch.setattr(fused, "_kernel_serves", lambda x: True)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_family_runs_its_kernels_and_gets_its_own_forwards_back(arch, monkeypatch):
    """The norms, the SiLU MLPs and the rotary function are swapped within the block (the model's logits stay
    close to its own), left alone inside `suspended()` (exactly its own), and put back after."""
    _serve(monkeypatch)
    model = make_model(arch).to(DEVICE)
    modules = module_list(model)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        own = model(input_ids=ids).logits
        calls = []
        for name in ("rms_norm", "silu_mul", "rotary"):
            original = getattr(fused_kernels, name)
            monkeypatch.setattr(fused_kernels, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))
        with fused.fused_forwards(modules):
            through_kernels = model(input_ids=ids).logits
            with suspended():
                assert torch.equal(model(input_ids=ids).logits, own)
        after = model(input_ids=ids).logits
    expected = {"rms_norm", "rotary"} | ({"silu_mul"} if arch != "gemma2" else set())
    assert set(calls) == expected
    torch.testing.assert_close(through_kernels, own, rtol=1e-4, atol=1e-4)   # fp32: the order of the sums
    assert torch.equal(after, own)
    assert not any(getattr(m.__dict__.get("forward"), "fused_kernels", False) for m in modules)


def test_nested_blocks_swap_once_the_outer_one_puts_everything_back_and_hooked_modules_stay(monkeypatch):
    _serve(monkeypatch)
    model = make_model("qwen3")
    modules = module_list(model)
    norm = model.model.norm
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    original = modeling.apply_rotary_pos_emb
    with fused.fused_forwards(modules):
        outer = norm.forward, modeling.apply_rotary_pos_emb
        with fused.fused_forwards(modules):
            assert (norm.forward, modeling.apply_rotary_pos_emb) == outer
        assert (norm.forward, modeling.apply_rotary_pos_emb) == outer
    assert "forward" not in norm.__dict__ and modeling.apply_rotary_pos_emb is original
    norm._hf_hook = object()                       # accelerate's offload hook: its forward brings the weights
    with fused.fused_forwards(modules):
        assert "forward" not in norm.__dict__
