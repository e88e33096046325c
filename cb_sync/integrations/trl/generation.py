"""Rollouts for CBSyncGRPOTrainer: a generation object the trainer calls, in the shape of TRL's generation backends.

`CBSyncGeneration` owns one persistent `SyncCBDriver` on the trained model, generates a rollout (prompt ids in,
completion ids and the generator's logprobs out) and applies the release policy after it. It has nothing like
`sync_weights`: the driver runs the very modules being trained, so every rollout sees the weights of the last
optimizer step."""

from __future__ import annotations

import contextlib

import torch

from ...config import CBConfig, SamplingParams
from ...engine.driver import SyncCBDriver

KEPT_CACHE_MAX_BYTES = 1 << 30      # release_after_rollout=None keeps KV caches up to this size through training


class CBSyncGeneration:
    """The driver's life cycle, the rollout and the release policy of a CBSyncGRPOTrainer.

    Args:
        config: the driver's engine settings.
        sampling_params: the sampling of every completion (with logprobs; each request draws its own seed).
        release_after_rollout: free the KV cache after every rollout (True), keep it (False), or free it where it
            is larger than KEPT_CACHE_MAX_BYTES (None).
    """

    def __init__(self, config: CBConfig, sampling_params: SamplingParams, release_after_rollout: bool | None):
        self.config = config
        self.sampling_params = sampling_params
        self.release_after_rollout = release_after_rollout
        self.driver: SyncCBDriver | None = None     # built at the first rollout

    def driver_for(self, model: torch.nn.Module) -> SyncCBDriver:
        """The persistent driver on `model`, built again only where another model object comes (it follows the
        model's moves and casts itself)."""
        if self.driver is None or self.driver.model is not model:
            if self.driver is not None:
                self.driver.release()
            self.driver = SyncCBDriver(model, self.config)
        return self.driver

    def generate(self, model: torch.nn.Module, prompt_ids: list[list[int]],
                 context: contextlib.AbstractContextManager | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt (TRL passes each prompt already repeated num_generations times).

        Args:
            model: the trained model, unwrapped (a PeftModel where LoRA is trained).
            prompt_ids: the prompts' token ids.
            context: entered around the driver's call (the trainer's profiling and the rollout's forward modes).

        Returns:
            (completion_ids, logprobs): lists aligned with prompt_ids; a completion ends with EOS where it met one,
            and each token's logprob is that of log_softmax(logits / temperature), as the trainer recomputes it.
        """
        driver = self.driver_for(model)
        if driver.cache.num_blocks == 0:
            return_allocator_cache(driver.device)
        with context if context is not None else contextlib.nullcontext():
            results = driver.generate(prompt_ids, self.sampling_params, progress_bar=bool(self.config.progress_bar))
        return [r.token_ids for r in results], [r.logprobs for r in results]

    def after_rollout(self) -> None:
        """Free the KV cache where the release policy asks it; the captured decode graphs are kept and replayed over
        the next rollout's cache (`SyncCBDriver.release`)."""
        if self.driver is not None and releases_cache(self.release_after_rollout, self.driver.cache.nbytes):
            self.driver.release(keep_graphs=True)


def releases_cache(asked: bool | None, cache_bytes: int) -> bool:
    """Whether a rollout's KV cache of cache_bytes is freed (asked: release_after_rollout)."""
    return cache_bytes > KEPT_CACHE_MAX_BYTES if asked is None else asked


def return_allocator_cache(device: torch.device) -> None:
    """Before a rollout allocates its KV pools again: the training step's cached blocks go back to the device (they
    are split into sizes the pools cannot use), so the card holds the larger of rollout and training, not both."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
