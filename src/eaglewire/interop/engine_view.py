"""`EngineView`: what an engine really reads from a draft directory, as data (the doctor's input)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, kw_only=True)
class FlagView:
    """One norm flag: the value written (None: absent), where, and the behaviour the engine will run."""

    written: bool | None
    where: str | None
    engine_default: bool | None  # what the engine assumes when absent (None: the flag is not read at all)
    effective: bool  # the behaviour the engine runs
    supported: bool  # False: the engine cannot run the written behaviour (hard-coded otherwise)


@dataclass(frozen=True, kw_only=True)
class EngineView:
    """What `engine` at `engine_version` reads from `path`. Lists, not printing: checks are built on it.

    `ids` / `ids_where`: the layer ids the engine reads and the key they came from (None: absent,
    the engine falls back to its default taps, `default_used`). `ids_ignored`: {key: ids} present
    under keys this engine never reads. `captured_taps`: canonical taps the engine will capture
    (None when the target's layer count is unknown or the ids are invalid, see problems).
    `weights_kept`: stored name -> engine parameter. `weights_dropped`: silently ignored names.
    `weights_missing`: names the engine needs but the directory lacks.
    """

    engine: str
    engine_version: str
    path: str
    architecture: str | None
    recognised: bool  # the directory is in a format this engine loads as an EAGLE-3 draft
    ids: list[int] | None
    ids_where: str | None
    ids_ignored: dict[str, list[int]]
    default_used: bool
    convention: str | None
    captured_taps: list[int] | None
    num_aux_expected: int  # taps the engine's fc is built for
    fc_in_features: int | None  # fc.weight's input width as stored
    target_hidden_size: int | None
    weights_kept: dict[str, str]
    weights_dropped: list[str]
    weights_missing: list[str]
    draft_vocab_size: int | None
    lm_head_from_target: bool
    embedding_replaced: bool  # the engine uses the target's embedding instead of the stored one
    norm_flags: dict[str, FlagView]
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)
