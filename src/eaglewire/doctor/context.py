"""What the static checks and the probe share: the Context of one examination (the draft as examined,
the target, the engine and what it will read and run) and the translations between taps and the engine's
ids. Index rules come only from eaglewire.taps (through the engine view and CONVENTIONS).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import interop
from ..errors import TapError
from ..interop.common import IDS_KEY
from ..taps import CONVENTIONS, TapContract
from .engine_args import EngineRun
from .findings import Remedy
from .subject import Subject, TargetFacts


@dataclass
class Context:
    subject: Subject
    target: TargetFacts | None  # loaded (--target) or from the draft's recorded fingerprint
    engine: str | None
    version: str | None  # the engine version the checks assume
    version_assumed: str  # how that version was chosen, in words
    view: interop.EngineView | None
    run: EngineRun | None
    engine_args: str | None

    @property
    def num_layers(self) -> int | None:
        n = self.target.num_layers if self.target else None
        if n is None and self.subject.contract is not None:
            n = self.subject.contract.num_layers
        return n

    @property
    def model_type(self) -> str | None:
        return self.target.model_type if self.target else None

    @property
    def loaded(self) -> bool:
        return bool(self.target and self.target.loaded)

    @property
    def convention(self) -> str | None:
        if self.engine == "sglang":
            return interop.sglang.convention_for(self.model_type, self.version)
        return "vllm" if self.engine else None

    @property
    def ids_key(self) -> str:
        return f"eagle_config.{IDS_KEY}" if self.engine == "sglang" else IDS_KEY

    @property
    def is_native(self) -> bool:
        return self.subject.kind == "native"


def engine_name(ctx: Context) -> str:
    return f"SGLang {ctx.view.engine_version}" if ctx.engine == "sglang" and ctx.view else (
        "vLLM" if ctx.engine == "vllm" else str(ctx.engine))


def ids_for(ctx: Context, taps) -> tuple[list[int] | None, str | None]:
    """Ids that make this engine capture `taps` -> (ids, None) or (None, why it cannot)."""
    try:
        return CONVENTIONS[ctx.convention].to_ids(tuple(taps), ctx.num_layers), None
    except TapError as e:
        return None, str(e)


def raw_taps(convention: str, ids: list[int], num_layers: int) -> tuple[int, ...]:
    """The taps a convention's rule maps ids to, before its range check (to tell out-of-range apart)."""
    conv = CONVENTIONS[convention]
    loose = dataclasses.replace(conv, lowest_tap=lambda n: -(1 << 30), highest_tap=lambda n: 1 << 30)
    return loose.from_ids(ids, num_layers)


def taps_remedy(ctx: Context, taps) -> Remedy | None:
    ids, _ = ids_for(ctx, taps)
    return Remedy(config_set={ctx.ids_key: ids}) if ids is not None else None


def contract_ids_remedy(ctx: Context, taps) -> tuple[str, Remedy | None]:
    """For the probe: the config change that makes the engine capture `taps` (and records them)."""
    taps = tuple(taps)
    if ctx.engine is None or ctx.view is None:
        if ctx.is_native and ctx.num_layers:
            c = TapContract(ctx.num_layers, tuple(sorted(taps)))
            return "record the taps this draft reads", Remedy(config_set={"taps": c.to_dict()})
        return "feed it these taps", None
    ids, why = ids_for(ctx, taps)
    if ids is None:
        return f"{engine_name(ctx)} cannot be configured to capture them ({why})", None
    sets = {ctx.ids_key: ids}
    if ctx.subject.provenance is not None and ctx.subject.contract and tuple(ctx.subject.contract.taps) != taps:
        sets["eaglewire.taps"] = TapContract(ctx.num_layers, taps).to_dict()  # the record was wrong too
    return f"make {engine_name(ctx)} capture them", Remedy(config_set=sets)


def probe_command(ctx: Context) -> tuple[str, ...]:
    """The doctor command that measures which taps this draft reads."""
    target = ctx.target.spec if ctx.target is not None and ctx.target.spec else "TARGET"
    return ("eaglewire", "doctor", "--draft", str(ctx.subject.path), "--target", target, "--engine",
            str(ctx.engine), "--probe", "32")
