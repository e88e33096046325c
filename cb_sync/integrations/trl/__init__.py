"""TRL integration: `CBSyncGRPOTrainer`, a `trl.GRPOTrainer` whose rollouts come from cb_sync."""

from .trainer import CBSyncGRPOTrainer

__all__ = ["CBSyncGRPOTrainer"]
