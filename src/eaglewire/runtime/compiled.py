"""What the runners' static forwards are built with: torch.compile's options and CUDA graph capture.

The runners compile a forward per padded size with `torch.compile(dynamic=False)` and capture it in a
CUDA graph of their own; inductor's autotuning is asked for per runner and size (runners.py says which).
"""

from __future__ import annotations

import logging

import torch

from ..errors import EaglewireError


def capture_graph(fn, device: torch.device, pool=None) -> tuple[object, object]:
    """Warm fn up on a side stream, capture it in a CUDA graph: (replay, its static outputs)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):  # lazy allocations and library autotuning happen outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


# inductor settings of "max-autotune-no-cudagraphs" (the CUDA graphs are ours), without its report of
# every matmul it times on stderr. Only what this torch knows is passed (an unknown key is an error).
AUTOTUNE = {"max_autotune": True, "coordinate_descent_tuning": True, "autotune_num_choices_displayed": 0,
            "max_autotune_report_choices_stats": False}


def compile_options(device: torch.device, autotune: bool) -> dict:
    """torch.compile options of a runner's static forwards: matmul autotuning on CUDA if asked."""
    if not autotune or device.type != "cuda":
        return {}
    import torch._inductor.config as inductor

    _quiet_skipped_choices()
    return {k: v for k, v in AUTOTUNE.items() if hasattr(inductor, k)}


class _SkippedChoice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Ignoring this choice" not in record.getMessage()


def _quiet_skipped_choices() -> None:
    """Inductor logs every matmul template it skips while autotuning (e.g. a tiling that needs more shared
    memory than the GPU has) as an ERROR with its traceback: dozens of alarming lines for choices it
    simply does not take. Only those records are dropped; the logger's other messages stay."""
    log = logging.getLogger("torch._inductor.select_algorithm")
    if not any(isinstance(f, _SkippedChoice) for f in log.filters):
        log.addFilter(_SkippedChoice())


class CompileError(EaglewireError):
    """torch.compile could not compile a runner's forward (never silently run eagerly instead)."""
