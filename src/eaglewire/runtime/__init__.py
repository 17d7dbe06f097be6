"""Running models at fixed shapes: the low-level toolkit that decoding and the data stage both stand on.

`kv_slots.py` is K/V storage written at slots. `runners.py` runs static-shape forwards of a model over that
storage, compiled and replayed in CUDA graphs. `compiled.py` holds the compile options and the graph capture.
`attention.py` is grouped-query attention reading K/V heads in place. `projections.py` and `prepack.py` make
copies of a model with fused projections, or with oneDNN-packed linears on a CPU. `sampling.py` draws a token
from logits.
Nothing here knows about speculation (rounds, trees, acceptance): that is decode/, which sits above, so that
data/ and train/ can borrow the toolkit without depending on the decoder.
"""
