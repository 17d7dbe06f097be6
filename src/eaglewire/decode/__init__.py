"""Decoding with a draft: the loop and what it stands on.

decoder.py (SpecDecoder: one round on one screen) over acceptance.py (every verification rule, greedy and
lossless sampling, chain and tree), tree.py (EAGLE-2 trees), draft_runner.py (the draft's static-shape drafting
loops: chains and EAGLE-2 trees), rounds.py (rounds that never wait for the host), and the speed-ups applied
from outside the models by speedups.py. The models' fixed-shape forwards, their K/V storage, the compiled and
CUDA-graph toolkit, the speed-ups' model copies and sampling are runtime/'s. generate.py is `eaglewire generate`.
"""
