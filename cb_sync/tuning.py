"""Kernel tuning in one place: tile sizes and size thresholds of the Triton attention and LoRA kernels. The defaults
suit a model of Qwen3-4B's shape on a Hopper GPU; other shapes and cards may want others
(`CBConfig(tuning=KernelTuning(...))`). Every field is an int, so a tuning crosses into a custom op as a list
(`ints()`), and each is checked when the tuning is built rather than at a kernel's launch."""

from __future__ import annotations

from dataclasses import dataclass, field


class _Ints:
    def ints(self) -> list[int]:
        """The fields in order: how a custom op takes the tuning."""
        return [getattr(self, name) for name in self.__dataclass_fields__]

    def _check(self, tiles: tuple[str, ...], smallest: int) -> None:
        """ValueError for a field that is not an int >= smallest, or a tile size (`tiles`) that is not a power of two
        >= 16 (Triton's tl.arange and tl.dot sizes), when the tuning is built rather than at a kernel's launch."""
        kind = type(self).__name__
        for name, value in zip(self.__dataclass_fields__, self.ints()):
            if not isinstance(value, int) or isinstance(value, bool) or value < smallest:
                what = "a positive int" if smallest == 1 else f"an int >= {smallest}"
                raise ValueError(f"{kind}.{name} must be {what}, got {value!r}")
        for name in tiles:
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{kind}.{name} must be a power of two >= 16, got {value!r}")


@dataclass(frozen=True)
class AttentionTuning(_Ints):
    """Tile sizes and split-K bounds of the Triton attention kernels (`attention.triton_kernels`).

    Args:
        partition_size: smallest split-K partition of a decode step, in tokens.
        max_partitions: a decode step splits a context into at most this many partitions.
        decode_programs_per_sm: split-K aims at this many (partition, request, KV head) programs per SM.
        decode_block_n: keys per decode tile (at most partition_size: a tile never spans two partitions).
        prefill_block_m: rows (queries x heads in a group) per prefill program.
        prefill_block_n: keys per prefill tile.

    Raises:
        ValueError: a field that is not a positive int, or a tile size that is not a power of two >= 16.
    """

    partition_size: int = 64
    max_partitions: int = 32
    decode_programs_per_sm: int = 3
    decode_block_n: int = 64
    prefill_block_m: int = 64
    prefill_block_n: int = 64

    def __post_init__(self):
        self._check(("partition_size", "decode_block_n", "prefill_block_m", "prefill_block_n"), smallest=1)


@dataclass(frozen=True)
class LoraTuning(_Ints):
    """Tiles, row-count thresholds and launch options of the Triton LoRA kernels (`lora.kernels`), for a step of M
    rows. A row-count threshold of 0 is never met.

    Args:
        block_m: rows per program below large_rows.
        shrink_split_k: input features per shrink program below mid_rows rows (few partials to sum).
        shrink_block_k: input features a shrink load.
        mid_rows: from this row count on, shrink programs take mid_split_k features.
        mid_split_k: input features per shrink program from mid_rows rows on.
        large_rows: from this row count on, large_block_m rows per program and one split over all of K.
        large_block_m: rows per program from large_rows rows on.
        expand_block_n: output columns per expand program.
        fused_base_max_rows, fused_base_max_k: `lora_linear_group` computes the base GEMMs itself, where that is
            faster than cuBLAS (few rows): up to these rows and input features.
        gemm_base_max_k, gemm_base_min_columns: groups of at least gemm_base_min_columns outputs run their base
            GEMMs in the expand launch, up to gemm_base_max_k input features.
        summed_base_split_k, summed_base_block_n: narrower groups split their base GEMMs over K in the shrink
            launch, in tiles of these features x columns.
        host_bound_min_rows, host_bound_max_rows: uncompiled steps of these row counts (min included, max not) keep
            PEFT's forward, the faster one where the host's launch costs bound the step.
        fixed_tiling: 1 for one tiling for every row count (batch-invariant mode): programs of fixed_block_m rows,
            shrink splits of shrink_split_k features, base GEMMs always in the kernel (split over K as
            summed_base_* for groups narrower than gemm_base_min_columns, else in the expand launch in tiles of
            fixed_block_n columns and fixed_block_k features); no choice by the row count anywhere.
        fixed_block_m, fixed_block_n, fixed_block_k: the fixed tiling's tiles.
        fixed_large_rows: from this row count on, the fixed tiling's expand launch runs tiles of fixed_large_block_m
            x fixed_large_block_n with fixed_large_warps warps for bf16 inputs and weights, and sums the split-K
            base's splits itself where that makes enough programs: the same sums in the same order as for fewer rows,
            on larger tensor-core tiles; used only where the device gives them the same bits
            (`batch_invariant.lora.large_tiles_agree`). 0: never.
        shrink_warps, shrink_stages: Triton launch options of the shrink launch (LoRA shrink tiles and split-K base
            programs).
        expand_warps, expand_stages: Triton launch options of the expand launch.

    Raises:
        ValueError: a field that is not an int >= 0 (warps and stages: >= 1), a tile that is not a power of two
            >= 16, a split that is not a multiple of shrink_block_k, fixed_tiling not 0 or 1.
    """

    block_m: int = 16
    shrink_split_k: int = 512
    shrink_block_k: int = 128
    mid_rows: int = 33
    mid_split_k: int = 256
    large_rows: int = 256
    large_block_m: int = 64
    expand_block_n: int = 64
    fused_base_max_rows: int = 32
    fused_base_max_k: int = 9728
    gemm_base_max_k: int = 4096
    gemm_base_min_columns: int = 8192
    summed_base_split_k: int = 1024
    summed_base_block_n: int = 64
    host_bound_min_rows: int = 257
    host_bound_max_rows: int = 4096
    fixed_tiling: int = 0
    fixed_block_m: int = 32
    fixed_block_n: int = 64
    fixed_block_k: int = 128
    shrink_warps: int = 4
    shrink_stages: int = 3
    expand_warps: int = 4
    expand_stages: int = 3
    fixed_large_rows: int = 256
    fixed_large_block_m: int = 64
    fixed_large_block_n: int = 128
    fixed_large_warps: int = 4

    def __post_init__(self):
        self._check(("block_m", "shrink_block_k", "large_block_m", "expand_block_n", "summed_base_block_n",
                     "fixed_block_m", "fixed_block_n", "fixed_block_k", "fixed_large_block_m", "fixed_large_block_n"),
                    smallest=0)     # 0: a threshold never met
        for name in ("shrink_warps", "shrink_stages", "expand_warps", "expand_stages", "fixed_large_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoraTuning.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.fixed_tiling not in (0, 1):
            raise ValueError(f"LoraTuning.fixed_tiling must be 0 or 1, got {self.fixed_tiling!r}")
        for name in ("shrink_split_k", "mid_split_k", "summed_base_split_k"):
            if getattr(self, name) % self.shrink_block_k:
                raise ValueError(f"LoraTuning.{name} must be a multiple of shrink_block_k ({self.shrink_block_k}), "
                                 f"got {getattr(self, name)!r}")


@dataclass(frozen=True)
class KernelTuning:
    """The tuning of every Triton kernel, for `CBConfig(tuning=...)`.

    Args:
        attention: the attention kernels' (`AttentionTuning()` by default).
        lora: the LoRA kernels' (`LoraTuning()` by default).
    """

    attention: AttentionTuning = field(default_factory=AttentionTuning)
    lora: LoraTuning = field(default_factory=LoraTuning)
