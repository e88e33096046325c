"""cb_sync: synchronous continuous batching for Hugging Face causal LMs, from the very modules being trained."""

from .config import CBConfig, SamplingParams
from .engine.driver import SyncCBDriver
from .scheduler.request import GenerationResult

__all__ = ["CBConfig", "GenerationResult", "SamplingParams", "SyncCBDriver"]
__version__ = "0.1.0"
