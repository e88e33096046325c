"""Batch-invariant mode's kernels (interpreted on the CPU, compiled on the GPU): the LoRA kernel in its fixed tiling
and the row mean give a row the same bits in any batch, compute what they should, and carry PEFT's / torch's
gradients for the trainer's forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
peft = pytest.importorskip("peft")

from cb_sync.batch_invariant.ops import invariant_ops  # noqa: E402
from cb_sync.batch_invariant import lora as invariant_lora
from cb_sync.batch_invariant.lora import invariant_tuning
from cb_sync.lora import kernels, lora_kernels  # noqa: E402
from cb_sync.batch_invariant.row_mean import row_mean  # noqa: E402
from cb_sync.tuning import LoraTuning  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIXED = LoraTuning(fixed_tiling=1)


def _group(rows, in_features, shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(DEVICE)
    weights = [torch.randn(n, in_features, generator=gen).to(DEVICE) for n, _ in shapes]
    biases = [torch.randn(n, generator=gen).to(DEVICE) for n, _ in shapes]
    lora_as = [torch.randn(r, in_features, generator=gen).to(DEVICE) for _, r in shapes]
    lora_bs = [torch.randn(n, r, generator=gen).to(DEVICE) for n, r in shapes]
    return x, weights, biases, lora_as, lora_bs, [0.5, 2.0, 1.5][:len(shapes)]


@pytest.mark.slow
@pytest.mark.parametrize("base, large_rows, split_programs", [
    ("split_k", 0, 0), ("in_the_expand", 0, 0), ("read", 0, 0), ("split_k", 20, 0), ("split_k", 20, 10**9),
    ("in_the_expand", 20, 0)])
def test_fixed_tiling_gives_a_row_the_same_bits_in_any_batch(base, large_rows, split_programs, monkeypatch):
    """Rows 0..40 (three 16-row tiles) against any slice of them and each member alone against the group; rows in
    several chunks too. The base split over K in the shrink launch (narrow groups), computed in the expand launch
    (wide groups), or read from torch; from large_rows rows on in the expand launch's larger tiles, the split-K
    base's splits summed there or still in the shrink launch (too few programs). Close to nn.Linear + PEFT's
    formula."""
    tuning = dataclasses.replace(FIXED, gemm_base_min_columns=1 if base == "in_the_expand" else 10**9,
                                 fixed_large_rows=large_rows, fixed_large_block_m=16, fixed_large_block_n=32,
                                 fixed_large_warps=4)
    monkeypatch.setattr(kernels, "SPLIT_BASE_MIN_PROGRAMS", split_programs)
    modes = []
    group = kernels._lora_group
    monkeypatch.setattr(kernels, "_lora_group", lambda *args: modes.append(args[11]) or group(*args))
    x, weights, biases, lora_as, lora_bs, scalings = _group(41, 160, [(70, 8), (24, 4), (40, 16)], seed=0)
    if large_rows:                                                  # the large tiles serve bf16 inputs and weights
        x, weights, biases = x.bfloat16(), [w.bfloat16() for w in weights], [b.bfloat16() for b in biases]
    bases = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]

    def run(rows, members=(0, 1, 2)):
        pick = [lora_as[i] for i in members], [lora_bs[i] for i in members], [scalings[i] for i in members]
        if base == "read":
            return kernels.lora_add_group(x[rows], [bases[i][rows] for i in members], *pick, tuning=tuning)
        return kernels.lora_linear_group(x[rows], [weights[i] for i in members], [biases[i] for i in members], *pick,
                                         tuning=tuning)
    full = run(slice(0, 41))
    assert set(modes) == {{"split_k": kernels.SUMMED_BASE, "in_the_expand": kernels.GEMM_BASE,
                           "read": kernels.READ_BASE}[base]}
    for i, out in enumerate(full):
        expected = bases[i].float() + scalings[i] * (x.float() @ lora_as[i].T) @ lora_bs[i].T
        tolerance = dict(atol=1.0, rtol=0.02) if large_rows else dict(atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out.float(), expected, **tolerance)
    for rows in (slice(0, 1), slice(3, 7), slice(5, 41), slice(17, 33), slice(40, 41)):
        assert all(torch.equal(part, whole[rows]) for part, whole in zip(run(rows), full)), rows
    for i in range(3):
        assert torch.equal(run(slice(0, 41), (i,))[0], full[i])
    monkeypatch.setattr(kernels, "FIXED_CHUNK_ROWS", 70)
    x = torch.cat([x, x.flip(0)])                                   # 82 rows: rows 70.. in a second chunk
    bases = [torch.cat([b, b.flip(0)]) for b in bases]
    chunked = run(slice(0, 82))
    assert all(torch.equal(c[:41], f) and torch.equal(c[41:], f.flip(0)) for c, f in zip(chunked, full))


def test_row_mean_matches_torch_and_is_row_invariant():
    gen = torch.Generator().manual_seed(3)
    for width in (1, 48, 1500):
        x = torch.randn(37, width, generator=gen).to(DEVICE)
        full = row_mean(x)
        torch.testing.assert_close(full, x.mean(-1), rtol=1e-5, atol=1e-6)
        for rows in (slice(0, 1), slice(5, 9), slice(11, 37)):
            assert torch.equal(row_mean(x[rows]), full[rows])
    half = torch.randn(5, 64, generator=gen).to(DEVICE, torch.bfloat16)
    assert row_mean(half).dtype == torch.bfloat16
    leaf = torch.randn(6, 10, generator=gen).to(DEVICE).requires_grad_()
    weights = torch.randn(6, generator=gen).to(DEVICE)
    (row_mean(leaf) * weights).sum().backward()
    torch.testing.assert_close(leaf.grad, weights[:, None].expand(6, 10) / 10)


def test_invariant_ops_take_the_row_mean_kernel_where_it_serves(monkeypatch):
    """Means over the last dimension go to the kernel (dim and keepdim in every form), others keep row blocks."""
    from cb_sync.batch_invariant import ops as batch_invariant, row_mean as module
    calls = []
    original = module.row_mean
    monkeypatch.setattr(module, "row_mean", lambda rows: calls.append(rows.shape) or original(rows))
    monkeypatch.setattr(batch_invariant, "_mean_kernel_serves", lambda x: True)
    x = torch.randn(3, 5, 32).to(DEVICE)
    with invariant_ops():
        outs = [x.mean(-1, keepdim=True), torch.mean(x, dim=2), x.mean(dim=-1, keepdim=False), x.mean(1),
                x.mean(-1, dtype=torch.float64)]
    assert calls == [(15, 32)] * 3
    for out, expected in zip(outs, [x.mean(-1, keepdim=True), x.mean(2), x.mean(-1), x.mean(1), x.double().mean(-1)]):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _lora_layer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=True))
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["0"], init_lora_weights=False)
    model = peft.get_peft_model(model, config).to(DEVICE)
    return model, model.base_model.model[0]


@pytest.mark.parametrize("base", ["in_the_kernel", "autocast", "hooked"])
def test_trainer_lora_op_gives_the_generators_bits_and_peft_gradients(base, monkeypatch):
    """With gradients the fixed tiling runs the differentiable op it is given: its outputs equal the no-grad kernel
    path's bit for
    bit (the generator's), its gradients for x, A, B and (trained too here) the base weight and bias match PEFT's
    autograd. A base layer the kernel does not compute (under autocast to another dtype, or with a forward hook) runs
    its own forward on both sides."""
    monkeypatch.setattr(invariant_lora, "_invariant_kernel_serves", lambda device: True)
    monkeypatch.setattr(invariant_lora, "large_tiles_agree", lambda tuning, device: True)
    tuning = invariant_tuning(True, LoraTuning(), torch.device(DEVICE))
    model, layer = _lora_layer()
    layer.base_layer.requires_grad_(True)
    autocast = base == "autocast"
    if base == "hooked":
        layer.base_layer.register_forward_hook(lambda module, inputs, out: out * 2 - 1)
    params = [*layer.lora_A.parameters(), *layer.lora_B.parameters(), *layer.base_layer.parameters()]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 19, 96, generator=gen).to(DEVICE)
    grad = torch.randn(2, 19, 40, generator=gen).to(DEVICE)
    # fp16: the interpreter truncates to bf16 where a GPU rounds
    context = (lambda: torch.autocast(DEVICE, dtype=torch.float16)) if autocast else torch.enable_grad
    with context():
        expected = layer(x.requires_grad_())             # PEFT's own forward and autograd
        expected_grads = torch.autograd.grad(expected, [x, *params], grad)
        with lora_kernels(model, tuning=tuning, differentiable=invariant_lora.lora_linear), invariant_ops():
            with torch.no_grad():
                generator = layer(x)
            out = layer(x)
            grads = torch.autograd.grad(out, [x, *params], grad)
    assert out.grad_fn is not None and torch.equal(out.detach(), generator)
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.detach(), expected.detach(), **tolerance)
    assert len(grads) == 5                          # x, A, B, W, bias
    for got, want in zip(grads, expected_grads):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)


def test_invariant_tuning_serves_cuda_only_and_only_with_lora_kernels(monkeypatch):
    monkeypatch.setattr(invariant_lora, "large_tiles_agree", lambda tuning, device: True)
    assert invariant_tuning(True, LoraTuning(), torch.device("cpu")) is None
    assert invariant_tuning(False, LoraTuning(), torch.device("cuda")) is None
    assert invariant_tuning(True, LoraTuning(block_m=32), torch.device("cuda")) == dataclasses.replace(
        LoraTuning(block_m=32), fixed_tiling=1)


def test_a_device_that_rounds_large_tiles_otherwise_keeps_the_small_ones(monkeypatch):
    """The check through the kernel (interpreted on the CPU): the same bits in both tilings; with one element of the
    large tiles' output changed, not; invariant_tuning then turns the large tiles off."""
    tuning = LoraTuning(fixed_tiling=1, fixed_large_rows=20, fixed_large_block_m=16, fixed_large_block_n=32,
                        fixed_large_warps=4, summed_base_split_k=128, gemm_base_min_columns=64)
    monkeypatch.setattr(kernels, "SPLIT_BASE_MIN_PROGRAMS", 4)       # 64 rows sum their K splits in the large tiles
    calls = []
    group = kernels._lora_group
    monkeypatch.setattr(kernels, "_lora_group", lambda *args: calls.append((args[0].shape[0], args[11])) or
                        group(*args))
    assert invariant_lora.large_tiles_agree(tuning, torch.device(DEVICE))
    assert {rows for rows, _ in calls} == {64, 20, 19, 7}
    assert {mode for _, mode in calls} == {kernels.SUMMED_BASE, kernels.GEMM_BASE, kernels.READ_BASE}

    def perturbed(*args):
        outs = group(*args)
        if args[0].shape[0] >= 20:
            outs[0][-1, -1] = outs[0][-1, -1] * 2 + 1
        return outs
    monkeypatch.setattr(kernels, "_lora_group", perturbed)
    other = dataclasses.replace(tuning, fixed_large_block_n=16)     # not the cached verdict's key
    assert not invariant_lora.large_tiles_agree(other, torch.device(DEVICE))
    monkeypatch.setattr(invariant_lora, "_invariant_kernel_serves", lambda device: True)
    monkeypatch.setattr(invariant_lora, "large_tiles_agree", lambda tuning, device: False)
    assert invariant_tuning(True, tuning, torch.device("cuda")).fixed_large_rows == 0
    monkeypatch.setattr(invariant_lora, "large_tiles_agree", lambda tuning, device: True)
    assert invariant_tuning(True, tuning, torch.device("cuda")) == tuning


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["q_k_v", "gate_up", "down"])
def test_fixed_tiling_is_row_invariant_at_4b_sizes_on_the_gpu(group):
    """bf16 weights, fp32 adapters (PEFT's upcast), as the 4B rollout runs them, in the tuning the mode runs on this
    GPU (the large tiles where its check passed): rows 0..1199 against slices that move a row to another place in its
    tile or to the other tiling, the base in the kernel (split over K, summed in the large tiles or not, or in the
    expand launch for gate/up) and read from torch, under bf16 autocast too."""
    tuning = invariant_tuning(True, LoraTuning(), torch.device("cuda"))
    shapes = {"q_k_v": (2560, [(4096, 32), (1024, 32), (1024, 32)]), "gate_up": (2560, [(9728, 32), (9728, 32)]),
              "down": (9728, [(2560, 32)])}[group]
    x, weights, _, lora_as, lora_bs, scalings = _group(1200, shapes[0], shapes[1], seed=2)
    x, weights = x.bfloat16(), [w.bfloat16() / shapes[0] ** 0.5 for w in weights]
    lora_bs = [b * 1e-2 for b in lora_bs]
    for compute in (None, torch.bfloat16):
        full = kernels.lora_linear_group(x, weights, [], lora_as, lora_bs, scalings, compute, tuning)
        for rows in (slice(0, 4), slice(3, 7), slice(5, 37), slice(100, 300), slice(299, 300), slice(0, 255)):
            part = kernels.lora_linear_group(x[rows], weights, [], lora_as, lora_bs, scalings, compute, tuning)
            assert all(torch.equal(p, f[rows]) for p, f in zip(part, full)), (compute, rows)
        bases = [torch.nn.functional.linear(x, w) for w in weights]
        read = kernels.lora_add_group(x, bases, lora_as, lora_bs, scalings, compute, tuning=tuning)
        for rows in (slice(3, 7), slice(100, 300), slice(0, 255)):
            part = kernels.lora_add_group(x[rows], [b[rows] for b in bases], lora_as, lora_bs, scalings, compute,
                                          tuning=tuning)
            assert all(torch.equal(p, f[rows]) for p, f in zip(part, read))
        for got, base, a, b, scaling in zip(full, bases, lora_as, lora_bs, scalings):
            expected = base.float() + scaling * (x.float() @ a.T) @ b.T
            torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.03)
    means = torch.randn(3000, 2560, device="cuda")
    assert torch.equal(row_mean(means[7:19]), row_mean(means)[7:19])
