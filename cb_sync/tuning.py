"""Kernel tuning in one place: tile sizes and size thresholds of the Triton attention and LoRA kernels, measured on
an H200 for the Qwen3-4B shape (`CBConfig(tuning=KernelTuning(...))` for others). Every field is an int, so a tuning
crosses into a custom op as a list (`ints()`)."""

from __future__ import annotations

from dataclasses import dataclass, field


class _Ints:
    def ints(self) -> list[int]:
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
    partition_size: int = 64          # smallest split-K partition of a decode step (tokens)
    max_partitions: int = 32          # a decode step splits a context into at most this many partitions
    decode_programs_per_sm: int = 3   # split-K aims at this many (partition, request, kv head) programs per SM
    decode_block_n: int = 64          # keys per decode tile (at most partition_size: a tile never spans two partitions)
    prefill_block_m: int = 64         # rows (queries x heads in group) per prefill program
    prefill_block_n: int = 64         # keys per prefill tile

    def __post_init__(self):
        self._check(("partition_size", "decode_block_n", "prefill_block_m", "prefill_block_n"), smallest=1)


@dataclass(frozen=True)
class LoraTuning(_Ints):
    block_m: int = 16                 # rows per program below large_rows
    shrink_split_k: int = 512         # input features per shrink program below mid_rows rows (few partials to sum)
    shrink_block_k: int = 128         # input features a shrink load
    mid_rows: int = 33
    mid_split_k: int = 256            # input features per shrink program from mid_rows rows on
    large_rows: int = 256             # from here on large_block_m rows per program and one split over all of K
    large_block_m: int = 64
    expand_block_n: int = 64          # output columns per expand program
    # `lora_linear_group` computes the base GEMMs itself, where that measured faster than cuBLAS: up to these rows
    # and input features (gemm_base_max_k for groups of gemm_base_min_columns outputs, whose base GEMMs run in the
    # expand launch; narrower groups split them over K in the shrink launch, in tiles of features x columns)
    fused_base_max_rows: int = 32
    fused_base_max_k: int = 9728
    gemm_base_max_k: int = 4096
    gemm_base_min_columns: int = 8192
    summed_base_split_k: int = 1024
    summed_base_block_n: int = 64
    # uncompiled steps of these row counts (min included, max not) keep PEFT's forward: bound by the host's launch
    # costs, where PEFT's forward measured faster
    host_bound_min_rows: int = 257
    host_bound_max_rows: int = 4096
    # 1: one tiling for every row count (batch-invariant mode): programs of fixed_block_m rows, shrink splits of
    # shrink_split_k features, base GEMMs always in the kernel (split over K as summed_base_* for groups narrower than
    # gemm_base_min_columns, else in the expand launch in tiles of fixed_block_n columns and fixed_block_k features);
    # no choice by the row count anywhere
    fixed_tiling: int = 0
    fixed_block_m: int = 32
    fixed_block_n: int = 64
    fixed_block_k: int = 128
    # Triton launch options of the shrink launch (LoRA shrink tiles and split-K base programs) and the expand launch
    shrink_warps: int = 4
    shrink_stages: int = 3
    expand_warps: int = 4
    expand_stages: int = 3

    def __post_init__(self):
        self._check(("block_m", "shrink_block_k", "large_block_m", "expand_block_n", "summed_base_block_n",
                     "fixed_block_m", "fixed_block_n", "fixed_block_k"), smallest=0)     # 0: a threshold never met
        for name in ("shrink_warps", "shrink_stages", "expand_warps", "expand_stages"):
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
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    lora: LoraTuning = field(default_factory=LoraTuning)
