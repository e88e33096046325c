"""attn_backend="flash" (flash-attn 4's paged kernels) and "flash_prefill" (flash for steps with prompt tokens, Triton
for pure decode): a clear error where flash cannot run, each step kind sent to its backend; on a GPU with flash-attn 4
installed, the op against the sdpa_paged reference on fresh random batches, graph replay bit-exact, the driver."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.attention import flash_ops, sdpa_paged, triton_kernels, triton_ops
from cb_sync.graphs import is_pure_decode

from conftest import hf_greedy, make_model, random_prompts


def test_flash_backend_on_the_cpu_is_a_value_error_before_any_work():
    model = make_model("qwen3", lora=False)
    with pytest.raises(ValueError, match=r"attn_backend='flash' needs a CUDA model in float16 or bfloat16 .* got one "
                                         r"on cpu in torch.float32"):
        SyncCBDriver(model, CBConfig(attn_backend="flash"))


def test_flash_prefill_backend_on_the_cpu_is_a_value_error_naming_what_is_missing(monkeypatch):
    model = make_model("qwen3", lora=False)
    with pytest.raises(ValueError, match=r"attn_backend='flash_prefill' runs flash-attn 4 and Triton's kernels: "
                                         r"attn_backend='flash' needs a CUDA model in float16 or bfloat16"):
        SyncCBDriver(model, CBConfig(attn_backend="flash_prefill"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"attn_backend='flash_prefill' runs .*: attn_backend='triton' needs a CUDA"):
        SyncCBDriver(model, CBConfig(attn_backend="flash_prefill"))


def _reference_flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=None, page_table=None, seqused_k=None,
                                      softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                                      num_splits=0):
    """flash-attn 4's paged forward as the sdpa_paged reference computes it: q [T, H, D] with cu_seqlens_q, or a
    batch of single queries [R, 1, H, D]; causal and bottom-right aligned; a window of window_size[0] + 1 keys."""
    assert causal and page_table is not None and seqused_k is not None
    single = cu_seqlens_q is None
    query = q.flatten(0, 1) if single else q
    starts = torch.arange(len(query) + 1, dtype=torch.int32) if single else cu_seqlens_q
    window = None if window_size[0] is None else window_size[0] + 1
    out = sdpa_paged.paged_attention(query, k_cache, v_cache, page_table, seqused_k, starts,
                                     int(starts.diff().max()), int(seqused_k.max()), softmax_scale, window,
                                     softcap or None)
    return out.view(q.shape) if single else out


@pytest.mark.slow
@pytest.mark.parametrize("replayed,compiled", [(True, False), (False, False), (True, True)])
def test_flash_prefill_sends_steps_with_prompt_tokens_to_flash_and_pure_decode_to_triton(monkeypatch, replayed,
                                                                                        compiled):
    """flash_prefill on the CPU, with flash_attn.cute's paged forward computed by the sdpa_paged reference: every
    layer of a step with prompt tokens runs flash's op and every layer of a pure-decode step (replayed, with its
    graphs' first runs, or not) Triton's, eager or compiled; greedy tokens follow HF."""
    calls, steps = [], []

    def recording(name, attend):
        def run(*args, **kwargs):
            calls.append(name)
            return attend(*args, **kwargs)
        return run

    def observe(output):        # at launch, before the step's tokens update its requests
        steps.append((output.path, is_pure_decode(output.plan), calls[:]))
        calls.clear()

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = recording("flash", _reference_flash_attn_varlen_func)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(flash_ops, "unavailable_reason", lambda device, dtype: None)
    monkeypatch.setattr(triton_kernels, "paged_attention", recording("triton", triton_kernels.paged_attention))
    model = make_model("qwen3", lora=True)
    driver = SyncCBDriver(model, CBConfig(attn_backend="flash_prefill", block_size=8, max_batch_size=2,
                                          max_batch_tokens=16, compile=compiled),
                          static_decode=replayed, observer=observe)
    prompts = random_prompts([3, 20, 9])          # 20 tokens: two prefill chunks; the third request joins later
    results = driver.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 5) for p in prompts]
    layers = model.config.num_hidden_layers
    for path, decode, names in steps:
        if decode:
            assert names and set(names) == {"triton"} and len(names) % layers == 0, (path, names)
        else:       # the first compiled step also runs the decode graphs' first runs and an eager check first
            assert names[-layers:] == ["flash"] * layers and (compiled or len(names) == layers), (path, names)
    uncaptured = "compiled" if compiled else "eager"
    assert {(path, decode) for path, decode, _ in steps} == {
        (uncaptured, False), ("replay" if replayed else uncaptured, True)}
    assert not compiled or driver.runner.compiled.active


def test_a_float32_model_is_refused_by_the_flash_backend():
    assert "float16 or bfloat16" in flash_ops.unavailable_reason(torch.device("cuda"), torch.float32)


def test_missing_flash_attn_is_named_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)       # import fails as if not installed
    reason = flash_ops.unavailable_reason(torch.device("cuda"), torch.bfloat16)
    assert "flash-attn 4" in reason and "could not be imported" in reason and "pip install 'flash-attn-4" in reason


def _flash_ready() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return flash_ops.unavailable_reason(torch.device("cuda"), torch.bfloat16)


needs_flash = pytest.mark.skipif(_flash_ready() is not None, reason=f"flash backend: {_flash_ready()}")


def _batch(q_lens, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, seed=0):
    """Random bf16 pools, shuffled block tables zero-padded as the driver pads them, a query and this step's K/V
    at the last q_len positions of each context (slots -1 for padded rows, seq_len 0)."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-max(s, 1) // block_size) for s in seq_lens]
    num_blocks = sum(used) + 4
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(used) + 3, dtype=torch.int32)
    slots = []
    for r, (n, q, s) in enumerate(zip(used, q_lens, seq_lens)):
        tables[r, :n] = torch.tensor(order[:n], dtype=torch.int32)
        del order[:n]
        slots += [int(tables[r, p // block_size]) * block_size + p % block_size if s else -1
                  for p in range(max(s - q, 0), max(s - q, 0) + q)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    total = sum(q_lens)
    rand = lambda *s: torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)   # noqa: E731
    return dict(query=rand(total, num_heads, head_dim), key=rand(total, num_kv_heads, head_dim),
                value=rand(total, num_kv_heads, head_dim), k_cache=rand(*shape), v_cache=rand(*shape),
                slot_mapping=torch.tensor(slots, device="cuda"), block_tables=tables.cuda(),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                             device="cuda"), scale=head_dim ** -0.5)


def _check_against_reference(batch, **kwargs):
    ref_pools = batch["k_cache"].clone(), batch["v_cache"].clone()
    sdpa_paged.store_kv(batch["key"], batch["value"], *ref_pools, batch["slot_mapping"])
    out = flash_ops.flash_store_and_attend_op(**batch, **kwargs)
    assert torch.equal(batch["k_cache"], ref_pools[0]) and torch.equal(batch["v_cache"], ref_pools[1])
    q_lens = batch["query_start_loc"].diff()
    ref = sdpa_paged.paged_attention(batch["query"], *ref_pools, batch["block_tables"], batch["seq_lens"],
                                     batch["query_start_loc"], int(q_lens.max()), int(batch["seq_lens"].max()),
                                     batch["scale"], kwargs.get("sliding_window"), kwargs.get("softcap"))
    assert out.shape == ref.shape and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("seq_lens", [[1, 16, 17, 300, 0, 5000], [9000] * 3 + [2]])
@pytest.mark.gpu
@needs_flash
def test_flash_decode_matches_sdpa_paged(seq_lens, seed):
    _check_against_reference(_batch([1] * len(seq_lens), seq_lens, seed=seed))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("q_lens,seq_lens", [([5, 1, 40, 1], [5, 100, 200, 0]), ([300, 2], [300, 2051])])
@pytest.mark.gpu
@needs_flash
def test_flash_prefill_and_mixed_steps_match_sdpa_paged(q_lens, seq_lens, seed):
    _check_against_reference(_batch(q_lens, seq_lens, seed=seed))


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.gpu
@needs_flash
def test_flash_sliding_window_and_softcap_match_sdpa_paged(window):
    _check_against_reference(_batch([1, 1, 30], [700, 40, 90], seed=5), sliding_window=window, softcap=30.0)


@pytest.mark.parametrize("backend", ["flash", "flash_prefill"])
@pytest.mark.gpu
@needs_flash
def test_flash_driver_replays_bit_identical_steps_and_greedy_follows_the_model(backend):
    """A replayed decode step (flash's, or Triton's under flash_prefill) equals the same step run uncaptured; greedy
    tokens are (near-)argmax of a teacher-forced HF forward of the same bf16 model."""
    from cb_sync.lora import lora_kernels
    from cb_sync.model_patching.generation_mode import generation_mode
    from cb_sync.sampling.sampler import SamplerKind
    model = make_model("qwen3", lora=True).to("cuda", torch.bfloat16)
    driver = SyncCBDriver(model, CBConfig(max_batch_size=8, attn_backend=backend))
    assert driver.backends.prefill is flash_ops
    assert driver.backends.decode is (flash_ops if backend == "flash" else triton_ops)
    prompts = random_prompts([20, 3, 40, 64, 9, 17, 5, 33])
    results = driver.generate(prompts, SamplingParams(max_new_tokens=12))
    replay = driver.runner.replay
    assert (8, SamplerKind.GREEDY) in replay.graphs
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt + result.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(result.token_ids, device="cuda")[:, None])[:, 0]
        assert (chosen >= logits.max(dim=1).values - 0.15).all(), (prompt, result.token_ids)
    inputs = replay.buffers.views
    with generation_mode(model), lora_kernels(model):
        inputs["positions"][:8] = torch.arange(8, device="cuda") + 10
        inputs["seq_lens"][:8] = inputs["positions"][:8].int() + 1
        inputs["tables"][:8] = (torch.arange(8 * replay.width, device="cuda").view(8, -1).int()
                                % driver.cache.num_blocks)
        inputs["slots"][:8] = -1
        replay.decode_step(8, SamplerKind.GREEDY)
        eager = replay.out_tokens[:8].clone(), replay.out_logprobs[:8].clone()
        replay.out_tokens.zero_()
        replay.graphs.replay((8, SamplerKind.GREEDY))
        torch.cuda.synchronize()
    assert torch.equal(replay.out_tokens[:8], eager[0]) and torch.equal(replay.out_logprobs[:8], eager[1])
