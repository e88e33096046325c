"""The training step's speed-ups and metrics, apart from the rollout: logprob forwards (whole rows, or trimmed by length
groups), cuDNN attention's warm-up, PEFT's LoRA input casts skipped, the decoder layers compiled, the garbage
collector's freezes, and the generator-vs-trainer logprob gap. The submodules are imported by name."""
