"""The Triton LoRA kernel against PEFT's own forward (interpreted on the CPU, compiled on the GPU), and the
forward swap: where it applies, where it falls back to PEFT, and that it is always undone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
peft = pytest.importorskip("peft")

from cb_sync.lora import fast_forward, kernels, lora_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def lora_stack(in_features, out_features, r, dtype=torch.float32, adapter_dtype=torch.float32, dropout=0.0):
    """A PEFT LoRA Linear (random A and B) inside a Sequential, base weights in `dtype`, adapter in its own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=True))
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=["0"],
                             init_lora_weights=False)
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False).to(DEVICE, dtype)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return model.eval(), model.base_model.model[0]


@pytest.fixture
def spy(monkeypatch):
    calls = []
    original = kernels.lora_add

    def counting(*args):
        calls.append(args[0].shape[0])
        return original(*args)
    monkeypatch.setattr(kernels, "lora_add", counting)
    return calls


@pytest.mark.parametrize("rows, in_features, out_features, r", [(1, 40, 24, 4), (5, 300, 70, 8), (19, 96, 130, 32)])
def test_kernel_matches_peft_fp32(rows, in_features, out_features, r, spy):
    model, layer = lora_stack(in_features, out_features, r)
    x = torch.randn(1, rows, in_features, device=DEVICE)
    with torch.no_grad():
        expected = layer(x)
        with lora_kernels(model):
            got = layer(x)
    assert spy == [rows]
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_kernel_rounds_like_peft_with_bf16_adapters():
    """bf16 adapter: A's and B's outputs rounded to bf16 as PEFT's modules do (loose on the CPU interpreter,
    whose bf16 conversion does not round to nearest)."""
    model, layer = lora_stack(64, 48, 16, dtype=torch.bfloat16, adapter_dtype=torch.bfloat16)
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        with lora_kernels(model):
            got = layer(x)
    tol = 1e-2 if DEVICE == "cuda" else 6e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_falls_back_to_peft_where_the_kernel_does_not_apply(spy, monkeypatch):
    model, layer = lora_stack(32, 16, 4, dropout=0.5)
    x = torch.randn(4, 32, device=DEVICE)
    with torch.no_grad(), lora_kernels(model):
        layer.train()                                  # active dropout: PEFT's forward
        layer(x)
        layer.eval()
        with model.disable_adapter():
            layer(x)
        monkeypatch.setattr(fast_forward, "MAX_ROWS", 3)
        layer(x)                                       # more rows than the kernel takes
        layer(x[:3])                                   # this one does
    assert spy == [3]


def test_forward_is_restored_also_on_error():
    model, layer = lora_stack(32, 16, 4)
    with pytest.raises(RuntimeError, match="boom"), lora_kernels(model):
        assert "forward" in layer.__dict__
        raise RuntimeError("boom")
    assert "forward" not in layer.__dict__
    with lora_kernels(model, enabled=False):
        assert "forward" not in layer.__dict__


def test_partials_are_summed_over_every_k_split(monkeypatch):
    """K spans several shrink programs: each split's partial must reach the sum."""
    monkeypatch.setattr(kernels, "SHRINK_SPLIT_K", 64)
    model, layer = lora_stack(200, 20, 8)
    x = torch.randn(2, 200, device=DEVICE)
    with torch.no_grad():
        expected = layer(x)
        with lora_kernels(model):
            got = layer(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4, 37, 128])
@pytest.mark.parametrize("in_features, out_features", [(2560, 4096), (2560, 1024), (9728, 2560)])
def test_kernel_matches_peft_at_4b_sizes_bf16_model_fp32_adapter(rows, in_features, out_features):
    """The PEFT default (fp32 adapter on a bf16 model): differences only from fp32 summation order, so at most
    one bf16 rounding step on a small fraction of the outputs."""
    model, layer = lora_stack(in_features, out_features, 32, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        with lora_kernels(model):
            got = layer(x)
    diff = (got.float() - expected.float()).abs()
    ulp = expected.float().abs().clamp(min=1e-3) * 2 ** -7
    assert (diff <= ulp).all()
    assert (diff > 0).float().mean() < 0.02


def test_dora_keeps_peft_forward(spy):
    """A DoRA adapter (a PEFT LoRA variant) is not what the kernel computes: PEFT's forward runs."""
    torch.manual_seed(0)
    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(32, 16)),
                                peft.LoraConfig(r=4, target_modules=["0"], use_dora=True, init_lora_weights=False))
    model = model.to(DEVICE).eval()
    layer = model.base_model.model[0]
    x = torch.randn(2, 32, device=DEVICE)
    with torch.no_grad():
        expected = layer(x)
        with lora_kernels(model):
            got = layer(x)
    assert spy == []
    torch.testing.assert_close(got, expected)
