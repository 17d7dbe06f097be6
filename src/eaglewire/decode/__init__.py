"""Decoding with a draft: the loop and what it stands on.

`decoder.py` (SpecDecoder: one round on one screen) stands over the rest. `acceptance.py` holds every verification
rule, greedy and lossless sampling, chain and tree. `tree.py` builds EAGLE-2 trees. `draft_runner.py` runs the
draft's static-shape drafting loops (chains and EAGLE-2 trees). `rounds.py` runs rounds that never wait for the
host. `speedups.py` applies the speed-ups from outside the models. The models' fixed-shape forwards, their K/V
storage, the compiled and CUDA-graph toolkit, the speed-ups' model copies and sampling are runtime/'s.
generate.py is `eaglewire generate`.
"""
