"""Decoding with a draft: the loop and what it stands on.

decoder.py (SpecDecoder: one round on one screen) over acceptance.py (every verification rule, greedy and
lossless sampling, chain and tree), tree.py (EAGLE-2 trees), runners.py / draft_runner.py (the target's and
the draft's static-shape forwards), kv_slots.py (their K/V storage), rounds.py (rounds that never wait for the
host), and the speed-ups applied from outside the models by speedups.py (projections.py, prepack.py,
attention.py, compiled.py). generate.py is `eaglewire generate`.
"""
