"""Training a draft: trainer.py (`eaglewire train`: the loop, evaluation, checkpoints) with config.py (TrainConfig),
and cli.py, its command line. Beside them: data.py (batches, offline from shards or online from the target), ttt.py
(the training-time test), metrics.py (accuracy, acceptance estimates, the log and its plot) and state.py (what a
resumed run continues from)."""
