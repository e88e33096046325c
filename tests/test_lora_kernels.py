"""The Triton LoRA kernel against PEFT's own forward (interpreted on the CPU, compiled on the GPU), and the
forward swap: where it applies, where it falls back to PEFT, and that it is always undone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
peft = pytest.importorskip("peft")

from cb_sync.lora import kernels, lora_kernels, peft_forward  # noqa: E402
from cb_sync.tuning import LoraTuning  # noqa: E402

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


def peft_and_kernel(model, layer, x, tuning=LoraTuning()):
    """The layer's output from PEFT's forward, then with the kernel swapped in."""
    with torch.no_grad():
        expected = layer(x)
        with lora_kernels(model, tuning=tuning):
            return expected, layer(x)


class Calls(list):
    """Rows of each kernel call; `modes`: where each took the base GEMMs from (kernels.READ_BASE: torch's)."""
    modes: list


@pytest.fixture
def spy(monkeypatch):
    calls = Calls()
    calls.modes = []
    original = kernels._lora_group

    def counting(*args):
        calls.append(args[0].shape[0])
        calls.modes.append(args[11])
        return original(*args)
    monkeypatch.setattr(kernels, "_lora_group", counting)
    return calls


@pytest.mark.parametrize("rows, in_features, out_features, r", [(1, 40, 24, 4), (5, 300, 70, 8), (19, 96, 130, 32),
                                                               (LoraTuning().large_rows + 37, 200, 70, 8)])
def test_kernel_matches_peft_fp32(rows, in_features, out_features, r, spy):
    model, layer = lora_stack(in_features, out_features, r)
    x = torch.randn(1, rows, in_features, device=DEVICE)
    expected, got = peft_and_kernel(model, layer, x, LoraTuning(host_bound_min_rows=0, host_bound_max_rows=0))
    assert spy == [rows]
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_kernel_rounds_like_peft_with_bf16_adapters():
    """bf16 adapter: A's and B's outputs rounded to bf16 as PEFT's modules do (loose on the CPU interpreter,
    whose bf16 conversion does not round to nearest)."""
    model, layer = lora_stack(64, 48, 16, dtype=torch.bfloat16, adapter_dtype=torch.bfloat16)
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)
    expected, got = peft_and_kernel(model, layer, x)
    tol = 1e-2 if DEVICE == "cuda" else 6e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_falls_back_to_peft_where_the_kernel_does_not_apply(spy, monkeypatch):
    monkeypatch.setattr(peft_forward, "KERNEL_MAX_ELEMENTS", 7 * 32)
    model, layer = lora_stack(32, 16, 4, dropout=0.5)
    x = torch.randn(6, 32, device=DEVICE)
    with torch.no_grad(), lora_kernels(model, tuning=LoraTuning(host_bound_min_rows=4, host_bound_max_rows=6)):
        layer.train()                                  # active dropout: PEFT's forward
        layer(x)
        layer.eval()
        with model.disable_adapter():
            layer(x)
        layer(x[:4])                                   # a host-bound size: PEFT's forward
        layer(torch.randn(8, 32, device=DEVICE))        # beyond the kernel's offsets: PEFT's forward
        layer(x[:3])                                   # these two take the kernel
        layer(x)
    assert spy == [3, 6]


def test_forward_is_restored_also_on_error():
    model, layer = lora_stack(32, 16, 4)
    with pytest.raises(RuntimeError, match="boom"), lora_kernels(model):
        assert "forward" in layer.__dict__
        raise RuntimeError("boom")
    assert "forward" not in layer.__dict__
    with lora_kernels(model, enabled=False):
        assert "forward" not in layer.__dict__


@pytest.mark.parametrize("split_k, block_k", [(16, 16), (64, 32), (128, 128)])
def test_partials_are_summed_over_every_k_split(split_k, block_k):
    """K spans several shrink programs (38 at split 16, the last one partial), each loading its split in one or
    several blocks: every split's partial must reach the sum."""
    torch.manual_seed(split_k)
    x, base = torch.randn(3, 600, device=DEVICE), torch.randn(3, 20, device=DEVICE)
    lora_a, lora_b = torch.randn(8, 600, device=DEVICE), torch.randn(20, 8, device=DEVICE)
    got = kernels.lora_add(x, base, lora_a, lora_b, 0.5, split_k=split_k, block_k=block_k)
    torch.testing.assert_close(got, base + 0.5 * (x @ lora_a.T) @ lora_b.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("split_k, block_k", [(96, 64), (48, 48), (64, 8), (None, 2 * LoraTuning().shrink_split_k)])
def test_tiles_that_would_miscount_features_are_refused(split_k, block_k):
    """Explicit splits, and the split chosen for 2 rows (the tuning's shrink_split_k), that block_k does not
    divide."""
    x = torch.randn(2, 200, device=DEVICE)
    with pytest.raises(ValueError, match="block_k"):
        kernels.lora_add(x, torch.zeros(2, 4, device=DEVICE), torch.randn(4, 200, device=DEVICE),
                         torch.randn(4, 4, device=DEVICE), 1.0, split_k=split_k, block_k=block_k)


def test_sizes_beyond_int32_offsets_are_refused():
    x = torch.zeros(1, 4096, device=DEVICE).expand(2**20, 4096)       # 2^32 elements, none allocated
    with pytest.raises(ValueError, match="int32 offsets"):
        kernels.lora_add(x, torch.zeros(1, 8, device=DEVICE).expand(2**20, 8), torch.randn(4, 4096, device=DEVICE),
                         torch.randn(8, 4, device=DEVICE), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4, 37, 128, 4096])
@pytest.mark.parametrize("in_features, out_features", [(2560, 4096), (2560, 1024), (9728, 2560)])
def test_kernel_matches_peft_at_4b_sizes_bf16_model_fp32_adapter(rows, in_features, out_features):
    """The PEFT default (fp32 adapter on a bf16 model): differences only from fp32 summation order, so at most
    one bf16 rounding step on a small fraction of the outputs."""
    model, layer = lora_stack(in_features, out_features, 32, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features, device=DEVICE, dtype=torch.bfloat16)
    expected, got = peft_and_kernel(model, layer, x)
    diff = (got.float() - expected.float()).abs()
    # the kernel's base GEMM (rows <= fused_base_max_rows) sums in another order than cuBLAS: PEFT's bf16-rounded
    # base may differ by one step of the base's magnitude, which survives a small delta's add
    with torch.no_grad():
        base = layer.base_layer(x).float().abs()
    ulp = torch.maximum(expected.float().abs(), base).clamp(min=1e-3) * 2 ** -7
    assert (diff <= ulp).all()
    assert (diff > 0).float().mean() < 0.02


def test_autocast_products_run_in_the_autocast_dtype(spy):
    """Under autocast PEFT's A and B products run in the autocast dtype: the kernel rounds as they do."""
    model, layer = lora_stack(96, 40, 8)
    x = torch.randn(3, 96, device=DEVICE)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.float16):
        expected, got = peft_and_kernel(model, layer, x)
    assert spy == [3] and got.dtype == expected.dtype == torch.float16
    diff = (got.float() - expected.float()).abs()
    assert (diff <= expected.float().abs() * 2 ** -10 + 1e-6).all()     # at most one fp16 rounding step
    assert (diff > 0).float().mean() < 0.05


@pytest.mark.parametrize("autocast_dtype, fused", [(torch.float16, True), (torch.bfloat16, False)])
def test_autocast_to_the_weights_dtype_keeps_the_base_in_the_kernel(autocast_dtype, fused, spy):
    """accelerate's mixed-precision forward of a 16-bit model with fp32 adapters (TRL's trainer): autocast to the
    weights' dtype computes the same base GEMM, so the kernel still computes it; autocast to another dtype leaves it
    to torch. (fp16 weights: the CPU interpreter rounds to fp16 but truncates to bf16.)"""
    model, layer = lora_stack(96, 40, 8, dtype=torch.float16)
    x = torch.randn(3, 96, device=DEVICE, dtype=torch.float16)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=autocast_dtype):
        expected, got = peft_and_kernel(model, layer, x)
        with torch.no_grad():
            base = layer.base_layer(x).float().abs()
    assert len(spy) == 1 and (spy.modes[0] != kernels.READ_BASE) == fused and got.dtype == expected.dtype
    if fused:       # at most one fp16 rounding step of the output (the other case: the test above)
        assert ((got.float() - expected.float()).abs() <= torch.maximum(expected.float().abs(), base) * 2 ** -10
                + 1e-3).all()


def _dora():
    torch.manual_seed(0)
    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(32, 16)),
                                peft.LoraConfig(r=4, target_modules=["0"], use_dora=True, init_lora_weights=False))
    model = model.to(DEVICE).eval()
    return model, model.base_model.model[0]


def _two_active_adapters():
    model, layer = lora_stack(32, 16, 4)
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["0"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    return model, layer


@pytest.mark.parametrize("build", [_dora, _two_active_adapters], ids=["dora", "two_active_adapters"])
def test_adapters_the_kernel_does_not_compute_keep_peft_forward(build, spy):
    """DoRA (a LoRA variant) and several active adapters (PEFT sums them in fp32 before one rounding)."""
    model, layer = build()
    expected, got = peft_and_kernel(model, layer, torch.randn(2, 32, device=DEVICE))
    assert spy == []
    torch.testing.assert_close(got, expected)


def test_hooks_gradients_and_large_ranks_keep_peft_forward(spy):
    model, layer = lora_stack(32, 16, 4)
    x = torch.randn(2, 32, device=DEVICE)
    calls = []
    handle = layer.lora_A["default"].register_forward_pre_hook(lambda module, args: calls.append(1))
    with torch.no_grad(), lora_kernels(model):
        layer(x)                                       # a hook on lora_A must run: PEFT's forward
    handle.remove()
    assert calls == [1] and spy == []
    with lora_kernels(model):
        layer(x).sum().backward()                      # gradients wanted: PEFT's forward (the op has no backward)
    assert spy == [] and layer.lora_B["default"].weight.grad is not None
    big, big_layer = lora_stack(32, 16, peft_forward.MAX_RANK + 1)
    with torch.no_grad(), lora_kernels(big):
        big_layer(x)
    assert spy == []


def _decoder_with_lora(arch="qwen3"):
    from conftest import make_model
    return make_model(arch, lora=True).to(DEVICE)


BASE_MODES = {"gemm_in_expand": kernels.GEMM_BASE, "split_k_in_shrink": kernels.SUMMED_BASE, "torch": None}


@pytest.mark.slow
@pytest.mark.parametrize("base", list(BASE_MODES))
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_projections_that_share_an_input_take_one_launch_pair(arch, base, spy):
    """q/k/v and gate/up: the first member called computes all of them (one kernel call), the others take their
    outputs; the whole model's logits match PEFT's forward, with the base GEMMs (Qwen2: with q/k/v biases) in the
    kernel's expand launch, split over K in its shrink launch (2 splits of 64 input features, 4 of 128), or by
    torch."""
    mode = BASE_MODES[base]
    tuning = LoraTuning(fused_base_max_rows=0 if mode is None else LoraTuning().fused_base_max_rows,
                        gemm_base_min_columns=1 if mode == kernels.GEMM_BASE else 10**9, shrink_block_k=32,
                        summed_base_split_k=32, summed_base_block_n=32)
    model = _decoder_with_lora(arch)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]], device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        with lora_kernels(model, tuning=tuning):
            got = model(ids).logits
    layers = model.config.num_hidden_layers
    assert sorted(spy) == [7] * (4 * layers)          # per layer: q/k/v, o, gate/up, down
    assert spy.modes == [kernels.READ_BASE if mode is None else mode] * (4 * layers)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_sibling_called_on_another_tensor_computes_its_own_output(spy):
    model = _decoder_with_lora()
    attention = model.base_model.model.model.layers[0].self_attn
    x, other = torch.randn(1, 3, 64, device=DEVICE), torch.randn(1, 3, 64, device=DEVICE)
    with torch.no_grad():
        expected = [attention.q_proj(x), attention.k_proj(other), attention.v_proj(x), attention.k_proj(x)]
        with lora_kernels(model):
            got = [attention.q_proj(x), attention.k_proj(other), attention.v_proj(x), attention.k_proj(x)]
    assert len(spy) == 3        # q (with k and v for x), k on `other`, v takes its kept output, k on x again
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_group_kernel_matches_each_member_alone():
    """Members of different widths and ranks in one launch pair equal each computed alone."""
    torch.manual_seed(0)
    x = torch.randn(5, 300, device=DEVICE)
    shapes = [(70, 8), (24, 4), (130, 16)]
    bases = [torch.randn(5, n, device=DEVICE) for n, _ in shapes]
    lora_as = [torch.randn(r, 300, device=DEVICE) for _, r in shapes]
    lora_bs = [torch.randn(n, r, device=DEVICE) for n, r in shapes]
    scalings = [0.5, 2.0, 1.5]
    together = kernels.lora_add_group(x, bases, lora_as, lora_bs, scalings)
    for i in range(3):
        alone = kernels.lora_add(x, bases[i], lora_as[i], lora_bs[i], scalings[i])
        assert torch.equal(together[i], alone)
        torch.testing.assert_close(alone, bases[i] + scalings[i] * (x @ lora_as[i].T) @ lora_bs[i].T,
                                   atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="1 to 3 members"):
        kernels.lora_add_group(x, bases + bases[:1], lora_as + lora_as[:1], lora_bs + lora_bs[:1], scalings + [1.0])


@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("base", ["gemm_in_expand", "split_k_in_shrink", "torch_for_long_inputs",
                                  "torch_for_long_inputs_of_wide_groups"])
def test_base_in_the_kernel_matches_linear_then_lora(bias, base, spy):
    """lora_linear_group = nn.Linear's x W^T + b, then lora_add_group, for three members of different widths and
    ranks over two row tiles; the base GEMMs in the expand launch, over five K splits and several column tiles in
    the shrink launch, or (inputs wider than fused_base_max_k, or gemm_base_max_k for wide groups) by torch."""
    wide = base in ("gemm_in_expand", "torch_for_long_inputs_of_wide_groups")
    tuning = LoraTuning(gemm_base_min_columns=1 if wide else 10**9, summed_base_split_k=LoraTuning().shrink_block_k,
                        summed_base_block_n=32, fused_base_max_k=599 if base == "torch_for_long_inputs" else 4096,
                        gemm_base_max_k=599 if base == "torch_for_long_inputs_of_wide_groups" else 4096)
    torch.manual_seed(1)
    x = torch.randn(19, 600, device=DEVICE)
    shapes = [(70, 8), (24, 4), (130, 16)]
    weights = [torch.randn(n, 600, device=DEVICE) for n, _ in shapes]
    biases = [torch.randn(n, device=DEVICE) for n, _ in shapes] if bias else []
    lora_as = [torch.randn(r, 600, device=DEVICE) for _, r in shapes]
    lora_bs = [torch.randn(n, r, device=DEVICE) for n, r in shapes]
    scalings = [0.5, 2.0, 1.5]
    got = kernels.lora_linear_group(x, weights, biases, lora_as, lora_bs, scalings, tuning=tuning)
    bases = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases or [None] * 3)]
    expected = kernels.lora_add_group(x, bases, lora_as, lora_bs, scalings)
    modes = {"gemm_in_expand": kernels.GEMM_BASE, "split_k_in_shrink": kernels.SUMMED_BASE,
             "torch_for_long_inputs": kernels.READ_BASE, "torch_for_long_inputs_of_wide_groups": kernels.READ_BASE}
    assert spy.modes[0] == modes[base]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="biases for all 3 members or none"):
        kernels.lora_linear_group(x, weights, biases[:1] or weights[:1], lora_as, lora_bs, scalings)


@pytest.mark.slow
def test_shared_input_hand_off_compiles_to_one_graph():
    """Under torch.compile (dynamic sizes, fullgraph) the hand-off between siblings traces without a graph break
    or a recompile, and the compiled forward equals the uncompiled one (q/k/v and gate/up with the base GEMMs in
    the expand launch, o and down split over K in the shrink launch)."""
    import torch._dynamo.testing
    tuning = LoraTuning(gemm_base_min_columns=100)     # tiny model: q/k/v 128 columns, o 64
    model = _decoder_with_lora()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lambda ids: model(ids).logits, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad(), lora_kernels(model, tuning=tuning):
        for length in (3, 5, tuning.fused_base_max_rows + 3):     # both sides of the kernel's own row limit
            ids = torch.randint(0, 100, (1, length), device=DEVICE)
            torch.testing.assert_close(compiled(ids), model(ids).logits, atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1


class _Projections(torch.nn.Module):
    """q/k/v siblings of configurable input widths and Linear classes."""

    def __init__(self, q_in=64, kv_in=64, linear=torch.nn.Linear):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = linear(q_in, 32), linear(kv_in, 32), linear(kv_in, 32)


def _peft_projections(**kwargs):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(_Projections(**kwargs), config).to(DEVICE).eval()


def _q_k_v(model, x, context):
    inner = model.base_model.model
    return [inner.q_proj(x), inner.k_proj(context), inner.v_proj(context)]


def test_siblings_of_other_input_widths_are_not_grouped(spy):
    """Cross-attention: k/v read another tensor of another width; each projection is computed alone."""
    model = _peft_projections(kv_in=48)
    x, context = torch.randn(3, 64, device=DEVICE), torch.randn(5, 48, device=DEVICE)
    with torch.no_grad():
        expected = _q_k_v(model, x, context)
        with lora_kernels(model):
            got = _q_k_v(model, x, context)
    assert spy == [3, 5, 5]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


class _ClampedLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x).clamp(-0.1, 0.1)


def test_linear_subclasses_keep_their_own_forward(spy):
    """The kernel computes base GEMMs only for plain nn.Linear layers: a subclass's forward is called."""
    model = _peft_projections(linear=_ClampedLinear)
    x = torch.randn(3, 64, device=DEVICE)
    with torch.no_grad():
        expected = _q_k_v(model, x, x)
        with lora_kernels(model):
            got = _q_k_v(model, x, x)
    assert spy == [3] and spy.modes == [kernels.READ_BASE]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_a_kept_output_is_not_taken_after_its_input_or_adapter_changed(spy):
    """An input changed in place, or the adapter disabled, between the siblings' calls: no kept output is used."""
    model = _peft_projections()
    inner = model.base_model.model
    x = torch.randn(3, 64, device=DEVICE)
    with torch.no_grad():
        with lora_kernels(model):
            inner.q_proj(x)
            x.mul_(2.0)
            got_k = inner.k_proj(x)
            with model.disable_adapter():
                got_v = inner.v_proj(x)
        expected_k = inner.k_proj(x)
        with model.disable_adapter():
            expected_v = inner.v_proj(x)
    assert spy == [3, 3]            # q's group call, then k's own (v: PEFT's path, adapter disabled)
    torch.testing.assert_close(got_k, expected_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v, expected_v, atol=1e-5, rtol=1e-5)


def test_inputs_that_want_gradients_and_fp64_keep_peft_forward(spy):
    model = _peft_projections()
    inner = model.base_model.model
    with lora_kernels(model):
        inner.q_proj(torch.randn(3, 64, device=DEVICE, requires_grad=True)).sum().backward()
        with torch.no_grad():
            model.double()
            inner.q_proj(torch.randn(3, 64, device=DEVICE, dtype=torch.float64))
    assert spy == []
