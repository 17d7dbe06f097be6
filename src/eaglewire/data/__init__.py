"""Training data: datagen.py (`eaglewire datagen`: prompts -> the target's replies -> taps -> shards), batchgen.py
(batched regeneration on CUDA), shards.py (the on-disk format and its manifest), suites.py (benchmark prompt
suites, kept out of training)."""
