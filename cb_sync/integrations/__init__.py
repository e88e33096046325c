"""Adapters to other libraries: `transformers` (the model.generate_batch drop-in) and `trl` (CBSyncGRPOTrainer, a
package: the trainer, its generation object and its training-side parts)."""
