"""Adapters to other libraries: `transformers` (model.generate_batch drop-in) and `trl` (CBSyncGRPOTrainer)."""
