"""SpecForge 0.2.0 as a peer trainer: its offline feature files, its own `specforge train` for a wall-clock
budget, and its own `specforge export --to hf`, whose directory `eaglewire import --from` reads as it is.

    w = Writer(data_dir, target_dir=T, hidden_size=H); w.add(ids, mask, taps, last, final) ...; w.close()
    train(data_dir, T, out_dir, seconds=600, python=PEERS_PYTHON)  # -> {"checkpoint": out_dir/"hf", ...}

Sources: the specforge==0.2.0 wheel (file:line inside its package) and sgl-project/SpecForge for what the
wheel lacks (scripts/prepare_hidden_states.py, docs/). SpecForge trains offline here: its online path needs
an SGLang capture server and Mooncake (config/schema.py:54, 714-723).

This file runs in two interpreters: the orchestrator's (Writer, train) and the one SpecForge is installed in,
as `python peer_specforge.py prepare|check ...`, where SpecForge itself resolves its defaults and reads the
data back. So it imports only the standard library and torch at the top.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

MANIFEST = "eaglewire-peer.json"  # beside the feature files; SpecForge reads only *.ckpt(.gz) (offline_reader.py:44)
GROUP = 2000  # files per rows_{i}-{i+2000}/ folder, as prepare_hidden_states.py writes them (file_group_size)
EMBED_KEY = "model.embed_tokens.weight"  # SpecForge's default embedding_key (config/schema.py:65)
CALIBRATE_STEPS = 20
WARMUP_STEPS = 5  # steps a calibration leaves out of the rate: flex_attention's compile and its dynamic-shape recompile


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def specforge_ids(num_layers: int) -> list[int]:
    """SpecForge's EAGLE-3 ids, [1, N//2-1, N-4] (algorithms/model_providers.py:204): the 0-based OUTPUT of
    layer j, i.e. HF hidden_states[j+1]. They name hidden_states[2], [N//2], [N-3], what the Writer stores."""
    return [1, num_layers // 2 - 1, num_layers - 4]


# --- the data ------------------------------------------------------------------------------------

class Writer:
    """Writes samples as SpecForge's offline EAGLE-3 feature files, one `torch.save` dict a sample, streamed:
    input_ids [T] and loss_mask [T] (int64), aux_hidden_state [1, T, 3H] (the three taps concatenated low ->
    high) and hidden_state [1, T, H] (the POST-norm last state; training applies the target's lm_head to it).
    Layout and keys: scripts/prepare_hidden_states.py (_save_tensor_sync, _get_file_path); read back by
    runtime/data_plane/offline_reader.py and algorithms/eagle3/data.py:10-27.
    """

    def __init__(self, out_dir, *, target_dir, hidden_size: int, dtype: torch.dtype = torch.bfloat16):
        self.out_dir = Path(out_dir)
        cfg = _text_config(json.loads((Path(target_dir) / "config.json").read_text()))
        if cfg.get("hidden_size") != hidden_size:
            raise ValueError(f"hidden_size {hidden_size} != the target's {cfg.get('hidden_size')} "
                             f"({target_dir}/config.json)")
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            # SpecForge walks the folder recursively (offline_reader.py:72-82): old files would train too.
            raise ValueError(f"{self.out_dir} is not empty: SpecForge would read every *.ckpt under it")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.num_layers, self.hidden_size, self.dtype = int(cfg["num_hidden_layers"]), hidden_size, dtype
        self.target_dir = str(Path(target_dir).resolve())
        self.lengths: list[int] = []
        self.bytes = 0
        self.skipped = 0

    def add(self, input_ids, loss_mask, taps, last, final) -> None:
        """taps [T, 3, H]: HF hidden_states[2], [N//2], [N-3]; final [T, H]: post-norm. `last` (pre-norm) is
        not SpecForge's: unused."""
        T, H = int(input_ids.shape[0]), self.hidden_size
        for name, x, shape in (("input_ids", input_ids, (T,)), ("loss_mask", loss_mask, (T,)),
                               ("taps", taps, (T, 3, H)), ("final", final, (T, H))):
            if tuple(x.shape) != shape:
                raise ValueError(f"Writer.add: {name} has shape {tuple(x.shape)}, expected {shape}")
        if not bool(loss_mask.any()):
            # SpecForge's own preparation drops a sample with no trainable token (data/preprocessing.py:329-351;
            # EAGLE-3 asks for one, algorithms/common/defaults.py:18).
            self.skipped += 1
            return
        i = len(self.lengths)
        record = {"input_ids": _own(input_ids, torch.long), "loss_mask": _own(loss_mask, torch.long),
                  "aux_hidden_state": _own(taps.reshape(T, 3 * H), self.dtype)[None],
                  "hidden_state": _own(final, self.dtype)[None]}
        g = i // GROUP * GROUP
        path = self.out_dir / f"rows_{g}-{g + GROUP}" / f"data_{i}.ckpt"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")  # not *.ckpt: a torn write is never read
        torch.save(record, tmp)
        os.replace(tmp, path)
        self.bytes += path.stat().st_size
        self.lengths.append(T)

    def close(self) -> dict:
        info = {"samples": len(self.lengths), "tokens": sum(self.lengths), "bytes": self.bytes,
                "skipped_no_loss": self.skipped}
        manifest = {**info, "format": "specforge-0.2.0 offline eagle3", "target": self.target_dir,
                    "num_layers": self.num_layers, "hidden_size": self.hidden_size, "dtype": str(self.dtype),
                    "hf_hidden_states": [2, self.num_layers // 2, self.num_layers - 3],
                    "specforge_ids": specforge_ids(self.num_layers), "lengths": self.lengths}
        (self.out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return info


def _own(x: torch.Tensor, dtype) -> torch.Tensor:
    """A compact CPU copy: torch.save writes a view's whole storage, a batch's worth."""
    return x.detach().to(device="cpu", dtype=dtype, memory_format=torch.contiguous_format, copy=True)


# --- the target as SpecForge reads it ------------------------------------------------------------

def target_view(target_dir, work_dir) -> tuple[Path, str]:
    """(a directory SpecForge loads the target head from, its model.lm_head_key).

    TargetHead.load_weights needs exactly one *.index.json and looks lm_head_key up in its weight_map
    (modeling/target/target_head.py:71-84). A target saved as one model.safetensors has no index, and one with
    tied embeddings has no lm_head.weight: then a folder of links to its files plus an index, and the
    embedding as the head (what a SpecForge user does by hand).
    """
    from safetensors import safe_open

    target_dir = Path(target_dir).resolve()
    indexes = sorted(target_dir.glob("*.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"{target_dir} has {len(indexes)} *.index.json files; SpecForge needs exactly one")
    if indexes:
        keys, path = set(json.loads(indexes[0].read_text())["weight_map"]), target_dir
    else:
        files = sorted(target_dir.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"{target_dir}: no *.index.json and {len(files)} *.safetensors files")
        with safe_open(str(files[0]), "pt") as f:
            keys = set(f.keys())
        path = Path(work_dir) / "target"
        path.mkdir(parents=True)
        for p in target_dir.iterdir():
            (path / p.name).symlink_to(p)
        (path / f"{files[0].name}.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: files[0].name for k in sorted(keys)}}))
    if EMBED_KEY not in keys:
        raise ValueError(f"{target_dir}: no {EMBED_KEY} (SpecForge's embedding_key)")
    return path, ("lm_head.weight" if "lm_head.weight" in keys else EMBED_KEY)


# --- training ------------------------------------------------------------------------------------

def _yaml(d: dict, indent: str = "") -> str:
    """YAML for a nested dict of scalars and lists, via JSON scalars (YAML 1.2 reads JSON)."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(f"{indent}{k}:\n{_yaml(v, indent + '  ')}")
        else:
            out.append(f"{indent}{k}: {json.dumps(v)}")
    return "\n".join(out)


class _Run:
    """One SpecForge subprocess: its output teed to a log, its `step N: {...}` lines timed as they come.

    Each step line carries perf/optimizer_step_time_s, the time since the previous line (controller.py:685-720),
    so with log_interval 1 their sum is the training loop's wall time."""

    STEP = re.compile(r"^step (\d+): (\{.*\})\s*$")

    def __init__(self, argv, *, cwd, env, log, timeout: float):
        self.argv, self.steps, self.tail = list(argv), [], deque(maxlen=60)
        self.start = time.monotonic()
        proc = subprocess.Popen(self.argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        timer = threading.Timer(timeout, proc.terminate)  # SpecForge unwinds on SIGTERM (cli.py:43-82)
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                self.tail.append(line.rstrip("\n"))
                m = self.STEP.match(line)
                if m:
                    metrics = ast.literal_eval(m.group(2))
                    self.steps.append((int(m.group(1)), time.monotonic(), metrics.get("perf/optimizer_step_time_s")))
            self.rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
        log.flush()
        self.end = time.monotonic()
        if self.rc != 0:
            last = "\n".join(self.tail)
            raise RuntimeError(f"specforge {self.argv[3]} failed (exit {self.rc}"
                               f"{', timed out' if self.end - self.start >= timeout else ''}); log {log.name}:\n{last}")

    def step_times(self) -> list[float]:
        return [t for _, _, t in self.steps if t is not None]

    def startup_s(self) -> float | None:
        """Launch to the first step's start (imports, target head, vocabulary map, model and data set-up)."""
        if not self.steps or self.steps[0][2] is None:
            return None
        return self.steps[0][1] - self.steps[0][2] - self.start


def _helper(python, *args, env, cwd) -> dict:
    """Run this file's SpecForge-side command in SpecForge's interpreter; its last stdout line is JSON."""
    r = subprocess.run([str(python), str(Path(__file__).resolve()), *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"peer_specforge.py {args[0]} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _override(overrides, key):
    found = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key]
    return found[-1] if found else None


def train(data_dir, target_dir, out_dir, *, seconds: float, python: str, env: dict | None = None,
          device: str = "cuda", log_path=None, overrides=(), draft: dict | None = None,
          calibrate_steps: int = CALIBRATE_STEPS) -> dict:
    """Train SpecForge's EAGLE-3 draft on a Writer's data for `seconds` of its training loop, then export it.

    run.yaml holds what a user must set (target, data, output), SpecForge's own generated draft config (one
    layer, draft vocabulary 32,000: algorithms/eagle3/providers.py:182-186) with the taps the data holds,
    and nothing else, so every training setting is SpecForge's default (config/schema.py:515-585): 7 TTT
    steps, AdamW lr 1e-4 with cosine decay after 1.5% warmup, one sample a step, flex_attention, bf16.

    The budget is a step cap: SpecForge saves a checkpoint when its loop ends (training/trainer.py:527-529)
    or at save_interval, but not on a signal (cli.py:263-270 unwinds without saving), and training.max_steps
    is also its cosine's horizon (training/assembly.py:249). A calibration run of `calibrate_steps` steps
    measures the step time after WARMUP_STEPS (its checkpoint is discarded); the run then gets
    max_steps = seconds / step time, and enough epochs over the data to reach it. Its warm-up is not
    subtracted: cold, it is mostly compiling (46 s on an H200), which the calibration leaves cached (8 s
    there), so train_s, the run's measured loop, exceeds `seconds` by about that much.
    `training.max_steps=N` among `overrides` skips the calibration.

    device "cpu" (tests): FSDP is refused without an accelerator, so training.fsdp_sharding NO_SHARD (DDP,
    training/backend.py:232-252); flex_attention has no CPU backward, so sdpa; the Triton loss kernel runs in
    Triton's interpreter (TRITON_INTERPRET=1) and torch.compile is off (TORCHDYNAMO_DISABLE=1, about 18 s of
    compiling on 2 cores). `draft`: fields to set in the draft config (e.g. draft_vocab_size for a toy target).
    """
    data_dir, out_dir = Path(data_dir).resolve(), Path(out_dir).resolve()
    manifest_path = data_dir / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{data_dir}: no {MANIFEST}; write the data with Writer and close() it")
    manifest = json.loads(manifest_path.read_text())
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides)
    ids = list(manifest["specforge_ids"])
    target, lm_head_key = target_view(target_dir, out_dir)

    model = {"target_model_path": str(target), "draft_model_config": str(out_dir / "draft.json")}
    if lm_head_key != "lm_head.weight":
        model["lm_head_key"] = lm_head_key
    run = {"model": model, "data": {"hidden_states_path": str(data_dir)}, "output_dir": str(out_dir / "train")}
    run_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        run["training"] = {"fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa"}
        run_env.update(TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1", CUDA_VISIBLE_DEVICES="")
    elif device.startswith("cuda:"):
        run_env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    (out_dir / "run.yaml").write_text(_yaml(run) + "\n")

    # SpecForge generates the draft config a user without one gets, adds the data's ids and checks that its
    # own offline-capture resolution names the same layers (application/composition.py:60-133).
    t0 = time.monotonic()
    prep = _helper(python, "prepare", out_dir / "run.yaml", json.dumps(ids), json.dumps(draft or {}), *overrides,
                   env=run_env, cwd=out_dir)
    prepare_s = time.monotonic() - t0
    cfg = prep["config"]
    argv = [str(python), "-m", "specforge.cli", "train", "-c", str(out_dir / "run.yaml")]
    log_path = Path(log_path) if log_path else out_dir / "specforge.log"
    samples = manifest["samples"]
    per_step = cfg["training"]["batch_size"] * cfg["training"]["accumulation_steps"]

    def epochs_for(steps):  # one epoch = samples // batch micro-batches (training/schedule.py:28)
        return max(1, math.ceil(steps * per_step / samples))

    calibration = None
    with open(log_path, "w") as log:
        fixed = _override(overrides, "training.max_steps")
        if fixed is None:
            k = calibrate_steps
            log.write(f"# calibration: {k} steps\n")
            calib = _Run(argv + overrides + [f"training.max_steps={k}", f"training.num_epochs={epochs_for(k)}",
                                             "training.log_interval=1", "run_id=calibrate",
                                             f"output_dir={out_dir / 'calibrate'}"],
                         cwd=out_dir, env=run_env, log=log, timeout=1800)
            times = calib.step_times()
            if len(times) <= WARMUP_STEPS:
                raise RuntimeError(f"calibration logged {len(times)} step times; needs more than {WARMUP_STEPS}")
            step_s = sum(times[WARMUP_STEPS:]) / len(times[WARMUP_STEPS:])
            warmup_extra = sum(times[:WARMUP_STEPS]) - WARMUP_STEPS * step_s
            steps = max(1, int(seconds / step_s))
            calibration = {"steps": k, "step_s": step_s, "warmup_extra_s": warmup_extra,
                           "wall_s": calib.end - calib.start, "startup_s": calib.startup_s()}
            shutil.rmtree(out_dir / "calibrate")
            extra = [f"training.max_steps={steps}", f"training.num_epochs={epochs_for(steps)}"]
        else:
            steps = int(fixed)
            extra = [] if _override(overrides, "training.num_epochs") else [f"training.num_epochs={epochs_for(steps)}"]
        log.write(f"# training: {steps} steps\n")
        command = argv + overrides + extra + ["training.log_interval=1"]
        real = _Run(command, cwd=out_dir, env=run_env, log=log, timeout=1800 + 3 * seconds)
        if not real.steps:
            raise RuntimeError(f"specforge train logged no step; log {log_path}:\n" + "\n".join(real.tail))

        run_id = _override(command, "run_id") or cfg["run_id"]
        checkpoint = Path(_override(command, "output_dir") or cfg["output_dir"]) / f"{run_id}-step{real.steps[-1][0]}"
        mappings = sorted((out_dir / cfg["data"]["cache_dir"] / "vocab_mapping").glob("*.pt"))
        if len(mappings) > 1:
            raise RuntimeError(f"{len(mappings)} vocabulary maps under {out_dir}/cache; expected one")
        export = [str(python), "-m", "specforge.cli", "export", "--to", "hf", "--checkpoint", str(checkpoint),
                  "--draft-config", str(out_dir / "draft.json"), "--output-dir", str(out_dir / "hf"),
                  "--embedding-source", str(target)] + (["--vocab-mapping", str(mappings[0])] if mappings else [])
        log.write("# export\n")
        exported = _Run(export, cwd=out_dir, env=run_env, log=log, timeout=900)

    hf = json.loads((out_dir / "hf" / "config.json").read_text())
    exported_ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if exported_ids != ids:
        raise RuntimeError(f"the export's eagle_config ids are {exported_ids}, the data holds {ids}")
    times = real.step_times()
    max_len = cfg["data"]["max_length"]
    mean_len = sum(min(n, max_len) for n in manifest["lengths"]) / samples
    t = cfg["training"]
    return {
        "checkpoint": str(out_dir / "hf"),
        "steps": real.steps[-1][0],
        # expected, not counted: SpecForge's loader shuffles (seeded) and truncates at data.max_length
        "tokens": round(real.steps[-1][0] * per_step * mean_len),
        "train_s": sum(times),
        "startup_s": real.startup_s(),
        "after_s": real.end - real.steps[-1][1],  # the final checkpoint and teardown
        "prepare_s": prepare_s,
        "export_s": exported.end - exported.start,
        "calibration": calibration,
        "settings": {
            "ttt_length": t["ttt_length"], "learning_rate": t["learning_rate"], "lr_scheduler": t["lr_scheduler"],
            "warmup_ratio": t["warmup_ratio"], "max_grad_norm": t["max_grad_norm"],
            "optimizer": "AdamW over fp32 master weights, weight decay 0 (specforge/optimizer.py:12-43)",
            "batch_size": t["batch_size"], "accumulation_steps": t["accumulation_steps"],
            "attention_backend": t["attention_backend"], "fsdp_sharding": t["fsdp_sharding"],
            "torch_dtype": cfg["model"]["torch_dtype"], "max_length": max_len, "max_steps": steps,
            "num_epochs": int(_override(command, "training.num_epochs") or t["num_epochs"]), "seed": t["seed"],
            "draft_vocab_size": prep["draft"]["draft_vocab_size"], "draft_layers": prep["draft"]["num_hidden_layers"],
            "specforge_ids": ids, "hf_hidden_states": manifest["hf_hidden_states"],
            "exported_eagle_config_ids": exported_ids, "lm_head_key": lm_head_key},
        "command": command,
        "export_command": export,
    }


# --- SpecForge's side: run as `python peer_specforge.py CMD` in its interpreter ----------------------

def _prepare(run_yaml: str, ids_json: str, draft_json: str, *overrides: str) -> dict:
    """SpecForge's own draft config for this run (training/model_loading.py:211-258, what `specforge train`
    generates when model.draft_model_config is unset) with `eagle_config.eagle_aux_hidden_state_layer_ids`
    set, as SpecForge's checked-in configs do (configs/deepseek-v3-671b-eagle3.json); the export carries it
    into the served config.json. Then the effective run config, and the layers SpecForge's own offline
    capture would take for it, which must be the data's."""
    from specforge.application import resolve_run
    from specforge.application.composition import resolve_offline_capture
    from specforge.config import load_config
    from specforge.training.model_loading import draft_config_dict

    ids = json.loads(ids_json)
    bare = load_config(run_yaml, [*overrides, "model.draft_model_config="])
    draft = draft_config_dict(bare, provider=resolve_run(bare).algorithm.providers.model.draft_config)
    draft.update(json.loads(draft_json))
    if draft["draft_vocab_size"] > draft["vocab_size"]:
        raise ValueError(f"draft_vocab_size {draft['draft_vocab_size']} > the target's vocabulary "
                         f"{draft['vocab_size']}: pass draft={{'draft_vocab_size': ...}}")
    draft["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    cfg = load_config(run_yaml, list(overrides))
    Path(cfg.model.draft_model_config).write_text(json.dumps(draft, indent=2, sort_keys=True) + "\n")
    layers = list(resolve_offline_capture(cfg).capture_layers)
    if layers != ids:
        raise ValueError(f"SpecForge resolves capture layers {layers} for this run, the data holds {ids}")
    return {"config": cfg.model_dump(mode="json"), "draft": draft, "capture_layers": layers}


def _check(data_dir: str, dump: str | None = None) -> dict:
    """Every file through SpecForge's own offline reader (keys and tensors checked: offline_reader.py:50-69),
    feature store and EAGLE-3 normalizer (algorithms/eagle3/data.py:10-27), as its loader does; `dump` saves
    the first sample's normalized tensors (safetensors) for a comparison."""
    from specforge.algorithms.eagle3.data import build_offline_reader, normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    reader = build_offline_reader(data_dir, run_id="check", ttt_length=7, max_len=1 << 30)
    reader.validate_files = True
    store, widths, tokens, refs = LocalFeatureStore(), set(), 0, reader.read()
    for i, ref in enumerate(refs):
        raw, handle = store.get(ref)
        sample = normalize_offline_sample(raw, max_len=1 << 30)
        store.release(handle)
        T = sample["input_ids"].shape[1]
        if sample["hidden_state"].shape[:2] != (1, T) or sample["target"].shape[:2] != (1, T):
            raise ValueError(f"{ref.feature_store_uri}: lengths differ")
        widths.add((sample["hidden_state"].shape[2], sample["target"].shape[2], str(sample["hidden_state"].dtype)))
        tokens += T
        if dump and i == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in sample.items()}, dump)
    return {"samples": len(refs), "tokens": tokens, "widths": sorted(widths),
            "first": refs[0].feature_store_uri if refs else None}


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    print(json.dumps({"prepare": _prepare, "check": _check}[cmd](*rest)))
