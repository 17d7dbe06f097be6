"""The trainer's output directory: what may be in it, the resume state, and the final checkpoint.

CKPT/
  model.safetensors, config.json   the native checkpoint (checkpoint.save_draft), written last
  train_log.jsonl, train_curves.png
  resume-state/                    while training: model.safetensors (draft state),
                                   state.safetensors (optimizer moments, RNG), state.json (the rest)

The resume state is written to resume-state.tmp/ and swapped in by renames, so a kill -9 at any
instant leaves either the previous or the new state complete. Nothing is unpickled: tensors are
safetensors, everything else JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import checkpoint, files
from ..errors import UsageError

RESUME = "resume-state"
LOG = "train_log.jsonl"
PNG = "train_curves.png"
_FINAL_TMP = ".final-tmp"
OWN = {LOG, PNG, RESUME, RESUME + ".old", RESUME + ".tmp", _FINAL_TMP, checkpoint.WEIGHTS, checkpoint.CONFIG}


def out_status(out: Path, resume: bool) -> str:
    """'fresh', 'resume' or 'done' for --out; raises (touching nothing) when --out holds anything else, or when
    resume is asked and --out holds no run: a mistyped path must not start a fresh run in silence."""
    if not out.exists():
        if resume:
            raise UsageError(f"--out {out}: no such directory, nothing to resume; to start a fresh run there, "
                             "drop --resume")
        return "fresh"
    if not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    names = {p.name for p in out.iterdir()}
    foreign = sorted(n for n in names if n not in OWN and not n.startswith(".final-tmp"))
    if foreign:
        raise UsageError(f"--out {out}: holds files that are not a training run's ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}): choose a new or empty directory")
    has_state = bool(names & {RESUME, RESUME + ".old"})
    if checkpoint.CONFIG in names and not has_state:
        if resume:
            return "done"
        raise UsageError(f"--out {out}: already holds a trained draft; choose another --out (or delete it)")
    if has_state:
        if not resume:
            raise UsageError(f"--out {out}: holds an unfinished run; pass --resume to continue it, or choose "
                             "another --out")
        return "resume"
    if resume:
        raise UsageError(f"--out {out}: holds no resume state, nothing to resume; to start a fresh run there, "
                         "drop --resume")
    return "fresh"  # at most a log of a run killed before its first checkpoint


def _flatten_optim(sd: dict) -> tuple[dict, list]:
    tensors = {f"optim/{fqn}/{k}": v.detach().to("cpu").contiguous()
               for fqn, st in sd["state"].items() for k, v in st.items()}
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def _unflatten_optim(tensors: dict, groups: list) -> dict:
    state: dict = {}
    for key, v in tensors.items():
        if key.startswith("optim/"):
            fqn, name = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(fqn, {})[name] = v
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def save_state(out: Path, model_sd: dict, optim_sd: dict, rng: dict, meta: dict) -> None:
    """Write the resume state atomically (rank 0 only). The previous state waits at resume-state.old while
    the new one is renamed in: a run killed between the two renames resumes from it (load_state)."""
    opt_tensors, groups = _flatten_optim(optim_sd)
    with files.atomic_dir(out / RESUME, tmp=out / (RESUME + ".tmp"), old=out / (RESUME + ".old")) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in model_sd.items()},
                  str(tmp / "model.safetensors"))
        save_file({**opt_tensors, **{f"rng/{k}": v for k, v in rng.items()}}, str(tmp / "state.safetensors"))
        (tmp / "state.json").write_text(json.dumps({**meta, "optimizer_param_groups": groups}, indent=1))


def load_state(out: Path) -> tuple[dict, dict, dict, dict]:
    """(model state, optimizer state, rng tensors, meta) of the newest complete resume state."""
    d = out / RESUME if (out / RESUME / "state.json").exists() else out / (RESUME + ".old")
    fix = f"the resume state is damaged: delete {d} to start over"
    meta = files.read_json(d / "state.json", fix=fix)
    model_sd = files.read_safetensors(d / "model.safetensors", fix=fix)
    extra = files.read_safetensors(d / "state.safetensors", fix=fix)
    optim_sd = _unflatten_optim(extra, meta.pop("optimizer_param_groups"))
    rng = {k[len("rng/"):]: v for k, v in extra.items() if k.startswith("rng/")}
    return model_sd, optim_sd, rng, meta


def rng_state(device: torch.device) -> dict:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def finish(out: Path, draft, **save_kwargs) -> Path:
    """The native checkpoint into --out beside the log: weights first, config.json last (the marker)."""
    stage = out / _FINAL_TMP
    shutil.rmtree(stage, ignore_errors=True)
    checkpoint.save_draft(draft, stage, **save_kwargs)
    os.replace(stage / checkpoint.WEIGHTS, out / checkpoint.WEIGHTS)
    os.replace(stage / checkpoint.CONFIG, out / checkpoint.CONFIG)
    shutil.rmtree(stage, ignore_errors=True)
    return out


def drop_state(out: Path) -> None:
    for name in (RESUME, RESUME + ".old", RESUME + ".tmp"):
        shutil.rmtree(out / name, ignore_errors=True)


def discard(out: Path, created: bool) -> None:
    """Remove what a run that never reached a resume state wrote (its log), and --out if it made it."""
    if any((out / n).exists() for n in (RESUME, RESUME + ".old", checkpoint.CONFIG)):
        return
    for name in (LOG, PNG, RESUME + ".tmp"):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()
    if created and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
