"""vllm-project/speculators 0.9.0 as a peer trainer: its offline data, its trainer under a wall-clock
budget, and the hand-off to `eaglewire import`.

speculators trains offline from hidden states computed beforehand (its own capture needs a vLLM
server). `file:line` below is inside the speculators-0.9.0 wheel (`speculators/...`) or the
hs_connectors-0.9.0 wheel (`hs_connectors/...`); read them with `pip download --no-deps`.

The data directory `speculators train --data-path D` reads:
  D/data-*.arrow, dataset_info.json, state.json   a `datasets` save_to_disk of rows input_ids,
      loss_mask (int64 0/1), seq_len, in torch format (train/data.py:164 load_from_disk;
      cli/prepare_data.py:243 writes it)
  D/token_freq.pt      {token id: count} over loss-masked tokens (train/vocab_mapping.py:20-56),
      read only with --draft-vocab-size (train/cli.py:360-395, 398-420)
  D/hidden_states/hs_{i}.safetensors   row i's `hidden_states` [T, 4, H]: the three aux taps low ->
      high, then the last layer's PRE-norm output, and `token_ids` [T] int64 (hs_connectors/
      transfer.py:141-143; split at train/data.py:324-333, the last re-normed by the verifier's norm
      at models/eagle3/core.py:250-253). A row whose token_ids differ from input_ids is dropped
      with only a warning (train/data.py:314-322).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

NUM_TAPS = 3  # speculators' fc reads 3 taps by default: [2, N//2, N-3] (models/utils.py:111)
LOG_TAIL = 40  # lines of the trainer's log quoted in an error
SAVE_TIMEOUT_S = 300  # speculators' own watchdog ends an interrupt save after 120 s (train/graceful_shutdown.py:33)

# Run inside `python` (the interpreter that has speculators): speculators' own functions turn our
# rows into its dataset, as `speculators prepare-data` does for rows that already carry input_ids and
# loss_mask (data_generation/preprocessing.py:458-483 passes them through, dropping rows without a
# supervised token and cutting rows at max_length; :918-923 counts tokens; cli/prepare_data.py:243
# saves). prepare-data also shuffles (preprocessing.py:869, 907); we keep the order so that row i
# stays hs_{i}.
_BUILD = r"""
import json, sys
from datasets import Dataset
from speculators.data_generation.preprocessing import build_speculator_training_dataset
from speculators.train.vocab_mapping import save_token_frequency_distribution
rows_path, out, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
ids, masks = [], []
with open(rows_path) as f:
    for line in f:
        r = json.loads(line)
        ids.append(r["input_ids"]); masks.append(r["loss_mask"])
raw = Dataset.from_dict({"input_ids": ids, "loss_mask": masks})
ds = build_speculator_training_dataset(raw, None, max_length=max_len, num_proc=1)
save_token_frequency_distribution(ds, output_path=out + "/token_freq.pt")
ds.save_to_disk(out)
print(json.dumps({"rows": len(ds), "tokens": int(sum(ds.with_format(None)["seq_len"]))}))
"""


def _tail(text: str, n: int = LOG_TAIL) -> str:
    lines = [re.sub(r"\s{3,}", "  ", ln.rstrip())[:300] for ln in text.splitlines()]  # rich pads to COLUMNS
    return "\n".join([ln for ln in lines if ln.strip("│ ")][-n:])


def _run_python(python: str, code: str, args: list[str], env: dict | None, what: str) -> str:
    r = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, env=_env(env))
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {r.returncode}):\n{_tail(r.stdout + r.stderr)}")
    return r.stdout


# speculators 0.9.0's trainer assumes an accelerator: it moves the model and every batch with
# `.to(local_rank)`, an int (train/trainer.py:348, 533), synchronizes it (trainer.py:80) and autocasts
# on "cuda" when there is none (trainer.py:228, 539); a CPU-only torch raises on the first two. For
# device="cpu" (tests) this sitecustomize maps exactly those three onto the CPU; nothing else changes.
_CPU_SHIM = """
import torch
if not torch.accelerator.is_available():
    def _cpu(args, kwargs):
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = ("cpu",) + tuple(args[1:])
        if isinstance(kwargs.get("device"), int):
            kwargs["device"] = "cpu"
        return args, kwargs
    def _wrap(to):
        def wrapped(self, *args, **kwargs):
            args, kwargs = _cpu(args, kwargs)
            return to(self, *args, **kwargs)
        return wrapped
    torch.Tensor.to = _wrap(torch.Tensor.to)
    torch.nn.Module.to = _wrap(torch.nn.Module.to)
    torch.accelerator.synchronize = lambda *a, **k: None
    class _Autocast(torch.autocast):
        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)
    torch.autocast = _Autocast
"""


def _env(extra: dict | None, device: str | None = None, scratch: Path | None = None) -> dict:
    env = {**os.environ, **(extra or {})}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # speculators logs through rich, which wraps at 80 columns off a terminal: one record per line.
    env.setdefault("COLUMNS", "2000")  # a step record: 600-800 characters
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        shim = scratch / "cpu-shim"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(_CPU_SHIM)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    elif device and device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    return env


def _target_config(target_dir: Path) -> dict:
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{target_dir}: no config.json; pass the target's Hugging Face model directory")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config") or cfg  # speculators reads a multimodal target's text_config (train/cli.py:153)


def _new_dir(path: Path, what: str) -> Path:
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{path}: exists and is not empty; choose a new {what} directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Writer:
    """Streams samples into the data directory `speculators train --data-path` reads.

    add() writes each sample's hidden states at once (nothing big stays in memory); close() has
    speculators' own code (in `python`, default this interpreter) build the row table and
    token_freq.pt from the ids and masks. Samples without a loss-masked token are skipped, as
    prepare-data drops them (preprocessing.py:393-394): a dropped row would shift every later hs_{i}.
    """

    def __init__(self, out_dir: Path, *, target_dir: Path, hidden_size: int, dtype: torch.dtype = torch.bfloat16,
                 python: str | None = None, env: dict | None = None):
        cfg = _target_config(target_dir)
        if cfg.get("hidden_size") != hidden_size:
            raise ValueError(f"hidden_size {hidden_size} != the target's {cfg.get('hidden_size')} ({target_dir})")
        self.out = _new_dir(out_dir, "data")
        self.hidden_size, self.vocab_size, self.dtype = hidden_size, cfg.get("vocab_size"), dtype
        self.python, self.env = python or sys.executable, env
        (self.out / "hidden_states").mkdir()
        self._rows_path = self.out / ".rows.jsonl"  # ids and masks only; removed by close()
        self._rows = open(self._rows_path, "w")
        self.samples = self.tokens = self.loss_tokens = self.skipped = self.bytes = self.max_len = 0

    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, taps: torch.Tensor, last: torch.Tensor,
            final: torch.Tensor | None = None) -> int | None:
        """One sample: taps [T, 3, H] (speculators' aux layers low -> high), last [T, H] (the last
        layer's output before the final norm). `final` (post-norm) is not stored: speculators applies
        the verifier's norm itself. Returns the sample's row index, or None if it was skipped."""
        T, H = input_ids.shape[0], self.hidden_size
        if input_ids.dim() != 1 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be a 1-D integer tensor, got {tuple(input_ids.shape)} {input_ids.dtype}")
        if tuple(loss_mask.shape) != (T,):
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != input_ids' ({T},)")
        if tuple(taps.shape) != (T, NUM_TAPS, H):
            raise ValueError(f"taps shape {tuple(taps.shape)} != ({T}, {NUM_TAPS}, {H})")
        if tuple(last.shape) != (T, H):
            raise ValueError(f"last shape {tuple(last.shape)} != ({T}, {H})")
        if self.vocab_size is not None and T and int(input_ids.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(input_ids.max())} >= the target's vocab_size {self.vocab_size}")
        mask = loss_mask.bool()
        if not bool(mask.any()):
            self.skipped += 1
            return None
        # [T, 4, H]: what vLLM's extract_hidden_states writes for aux ids + [N] (the last, pre-norm).
        hs = torch.cat([taps, last[:, None]], dim=1).to(self.dtype).contiguous().cpu()
        if not bool(torch.isfinite(hs).all()):
            raise ValueError(f"sample {self.samples}: hidden states hold non-finite values")
        ids = input_ids.long().cpu()
        path = self.out / "hidden_states" / f"hs_{self.samples}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({"hidden_states": hs, "token_ids": ids.contiguous()}, str(tmp))
        tmp.rename(path)
        self._rows.write(json.dumps({"input_ids": ids.tolist(), "loss_mask": mask.long().tolist()}) + "\n")
        self.bytes += path.stat().st_size
        self.tokens += T
        self.loss_tokens += int(mask.sum())
        self.max_len = max(self.max_len, T)
        self.samples += 1
        return self.samples - 1

    def close(self) -> dict:
        """Build the row table and token_freq.pt with speculators' code; -> counts and bytes written."""
        self._rows.close()
        if self.samples == 0:
            raise ValueError("no sample with a loss-masked token was added")
        t0 = time.perf_counter()
        out = _run_python(self.python, _BUILD, [str(self._rows_path), str(self.out), str(self.max_len)], self.env,
                          "building speculators' dataset")
        built = json.loads(out.strip().splitlines()[-1])
        if (built["rows"], built["tokens"]) != (self.samples, self.tokens):
            raise RuntimeError(f"speculators kept {built['rows']} rows of {built['tokens']} tokens, not "
                               f"{self.samples} of {self.tokens}: hs_{{i}} would no longer match row i")
        self._rows_path.unlink()
        table = sum(p.stat().st_size for p in self.out.iterdir() if p.is_file())
        return {"samples": self.samples, "tokens": self.tokens, "loss_tokens": self.loss_tokens,
                "skipped": self.skipped, "bytes": self.bytes + table, "build_s": round(time.perf_counter() - t0, 2)}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._rows.closed:
            self._rows.close()


# --- training -------------------------------------------------------------------------------------

# One metrics record per optimizer step (train/trainer.py:587-596), flattened to `k=v, ...` by
# FormatDictFilter (train/logger.py:250-263).
_STEP = re.compile(r"global_step=(\d+)")
_LOSS = re.compile(r"train/loss=([-+0-9.e]+)")
_TPS = re.compile(r"profile/tokens_per_s=([-+0-9.e]+)")
_STEP_MS = re.compile(r"profile/step_ms=([-+0-9.e]+)")

# speculators 0.9.0's defaults for an eagle3 draft (train/config/schema.py, line by field; the derived
# ones resolved as schema.py:789-808 does). train() overlays what the run set, read from the run.yaml
# speculators writes beside its checkpoints (train/cli.py:633-634; config/artifacts.py:18-64 keeps
# exactly the values a flag or a YAML gave).
DEFAULTS = {
    "speculator_type": "eagle3",  # :716
    "ttt_steps": 3, "ttt_step_loss_decay": 1.0,  # :316, :321
    "loss_fn": "kl_div", "loss_implementation": "fused",  # :806, :304
    "optimizer": "muon", "lr": 1e-3, "muon_lr": 1e-3,  # :339, :344, :797 (muon_lr = lr)
    "weight_decay": 0.01, "muon_weight_decay": 0.1, "muon_momentum": 0.95,  # :345, :358, :355
    "scheduler_type": "linear", "scheduler_warmup_steps": None,  # :371, :374 (None: 1% of the total, trainer.py:205-206)
    "scheduler_total_steps": None,  # :382 (None: epochs x batches per epoch, trainer.py:180)
    "epochs": 20, "checkpoint_freq": 1.0,  # :391, :392 (a save and a validation every epoch)
    "total_seq_len": 8192, "train_data_ratio": 0.9, "hidden_states_dtype": "bfloat16",  # :210, :213, :218
    "draft_vocab_size": None,  # :129 (None: the target's whole vocabulary)
    "num_layers": 1, "draft_arch": "llama",  # :800, :790
    "full_attention_indices": [], "sliding_window": 2048,  # :177, :172
    "norm_before_residual": True, "norm_before_fc": True, "norm_output": True, "fc_norm": False,  # :145, :792, :794, :161
    "embed_requires_grad": False, "target_layer_ids": None,  # :149, :115 (None: [2, N//2, N-3])
    "draft_attn_impl": "simple_flex_attention", "num_workers": 12, "seed": 42, "max_steps": None,  # :190, :224, :728, :423
}


def _settings(run_yaml: Path) -> dict:
    import yaml

    given = {}
    for k, v in ((yaml.safe_load(run_yaml.read_text()) or {}).get("train") or {}).items():
        given.update(v if isinstance(v, dict) else {k: v})  # groups nest their fields (artifacts.py:57-61)
    settings = {**DEFAULTS, **{k: v for k, v in given.items() if k in DEFAULTS}}
    if "muon_lr" not in given:
        settings["muon_lr"] = settings["lr"]
    return settings


def _steps(log: str) -> dict:
    steps = [int(m) for m in _STEP.findall(log)]
    losses = [float(m) for m in _LOSS.findall(log)]
    tokens = sum(round(float(a) * float(b) / 1000) for a, b in zip(_TPS.findall(log), _STEP_MS.findall(log)))
    return {"steps": max(steps) + 1 if steps else 0, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "tokens": tokens or None}


# speculators' SIGINT handler raises TrainingInterruptedError wherever the main thread is
# (train/graceful_shutdown.py:111-115); inside a log call, logging's handleError swallows it, prints
# "--- Logging error ---", and training goes on to its last epoch (seen on an H200, 2026-12-03: with
# log_freq 1 the trainer is logging most of the time).
_LOST = re.compile(r"--- Logging error ---[\s\S]{0,8000}?TrainingInterruptedError")
LOST_WHY = ("its TrainingInterruptedError was raised inside a log call and swallowed by logging "
            "(graceful_shutdown.py:115)")
# Inside an epoch's save the same exception can surface as another: pydantic wraps it while config.json is
# serialised (PydanticSerializationError: ... TrainingInterruptedError: SIGINT, seen in CI on 2026-12-05), the
# graceful handler (graceful_shutdown.py:140) does not catch that, and the process exits 1 with the epoch half
# written. So the budget's SIGINT waits until no save is under way (trainer.py:689, 737-756);
# should one still land there, the row is the last epoch saved within the budget.
_AFTER_SAVE = re.compile(r"epoch \d+/\d+ started|No val loader")
BROKEN_WHY = ("its TrainingInterruptedError was raised inside an epoch's save and wrapped by another exception, "
              "which the graceful handler does not catch (graceful_shutdown.py:140)")
_VAL = re.compile(r"val/full_acc_(\d+)_epoch=([-+0-9.e]+)")


def _saving(log: str) -> bool:
    """An epoch's checkpoint is being written: the log's last milestone is its "Saving checkpoint" line."""
    at = log.rfind("Saving checkpoint to ")
    return at >= 0 and _AFTER_SAVE.search(log, at) is None


def _validation(log: str) -> dict | None:
    """speculators' own last validation (its held-out last 10% of rows): full accuracy by TTT step."""
    last = {}
    for k, v in _VAL.findall(log):
        last[int(k)] = float(v)
    return {"full_acc": [last[k] for k in sorted(last)]} if last else None


def _final_epoch(save: Path) -> Path | None:
    """The last epoch's checkpoint once every epoch has run (train/trainer.py:736-744), else None."""
    if not (save / "run.yaml").is_file():
        return None
    last = save / str(_settings(save / "run.yaml")["epochs"] - 1)
    return last if (last / "model.safetensors").is_file() else None


def _interrupt_outside_saves(proc: subprocess.Popen, log_path: Path) -> int | None:
    """SIGINT the trainer unless it is writing a checkpoint. It is stopped while its log is read, so the log says
    where it is and it cannot enter a save before the SIGINT: -> the log's length then, or None (try again)."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        text = log_path.read_text(errors="replace")
        if _saving(text):
            return None
        proc.send_signal(signal.SIGINT)
        return len(text)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def train(data_dir: Path, target_dir: Path, out_dir: Path, *, seconds: float, python: str, env: dict | None = None,
          device: str = "cuda", log_path: Path | None = None, extra_args=(), poll_s: float = 0.2) -> dict:
    """`speculators train` on data_dir with its own defaults for `seconds` of training, then SIGINT.

    The budget runs from the first logged step, so imports, the data and model set-up, the loader
    workers' start and the first step's compilation count as startup_s. Two flags are set:
    --full-attention-indices 0 (speculators' draft layers default to a sliding window of 2,048,
    schema.py:172-183; with it the layer attends over the whole sequence as eaglewire's and
    SpecForge's do, which changes nothing for samples up to 2,048 tokens and makes the saved config
    say what `eaglewire import` builds) and --on-missing raise (the default asks a vLLM server for a
    missing sample, train/data.py:278). Not --max-steps: it runs one more step in every later epoch
    (train/trainer.py:601-605). Left at speculators' default, and worth knowing under a budget: the
    linear LR decays over 20 epochs (trainer.py:180), each epoch ends in a save and a validation, and
    the last 10% of rows are held out (--train-data-ratio 0.9, train/data.py:172-182).

    -> checkpoint (what `eaglewire import --from` reads), steps, loss_first/loss_last (train/loss:
    the sum over the TTT steps, models/eagle3/core.py:319), tokens (from each step's logged
    tokens_per_s x step_ms, 3 significant digits each), train_s (first step to SIGINT), startup_s
    (launch to first step), save_s (SIGINT to exit), interrupted, settings, command, log.
    """
    out = _new_dir(out_dir, "output")  # an existing save path would be resumed from (trainer.py:267-296)
    save = out / "checkpoints"
    log_path = Path(log_path) if log_path else out / "train.log"
    args = ["--verifier-name-or-path", str(target_dir), "--data-path", str(data_dir), "--save-path", str(save),
            "--log-dir", str(out / "logs"), "--full-attention-indices", "0", "--on-missing", "raise"]
    if device == "cpu":  # the same math without what needs a GPU: flex_attention has no CPU backward (torch's
        # flex_attention.py _validate_device), the fused losses need Triton (losses/utils.py:117-123)
        args += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    elif fused_loss_fails():
        args += ["--loss-implementation", "eager"]
    args += [str(a) for a in extra_args]
    argv = [python, "-m", "speculators", "train", *args]  # the console script `speculators` (speculators.__main__:app)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(env, device, out),
                                start_new_session=True)  # our own Ctrl-C must not reach it twice
    first = sigint = lost = None
    marks = {}  # epoch checkpoint -> (when the poll first saw it, the log's length then)
    try:
        while proc.poll() is None:
            now = time.perf_counter()
            text = log_path.read_text(errors="replace")
            if first is None and _STEP.search(text):
                first = now
            for d in save.glob("[0-9]*"):  # one a finished epoch (train/trainer.py:736-744)
                if d.name not in marks and (d / "model.safetensors").is_file():
                    marks[d.name] = (now, len(text))
            if first is not None and sigint is None and now - first >= seconds and _final_epoch(save) is None:
                at_sigint = _interrupt_outside_saves(proc, log_path)  # it then saves `interrupted/`
                sigint = now if at_sigint is not None else None  # (graceful_shutdown.py:140-168)
            if sigint is not None and _LOST.search(text, at_sigint):
                lost = now  # it trains on: stop it, and keep the last epoch saved within the budget
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            if sigint is not None and now - sigint > SAVE_TIMEOUT_S:
                raise RuntimeError(f"speculators did not exit {SAVE_TIMEOUT_S} s after SIGINT")
            time.sleep(poll_s)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    end = time.perf_counter()
    text = log_path.read_text(errors="replace")
    first = first if first is not None else end  # it finished between two polls
    broken = (sigint is not None and proc.returncode not in (0, -signal.SIGINT)
              and "TrainingInterruptedError" in text[at_sigint:]
              and not (save / "interrupted" / "model.safetensors").is_file())
    if lost is not None or broken:
        why = LOST_WHY if lost is not None else BROKEN_WHY
        within = [k for k, (t, _) in marks.items() if t <= sigint]
        if not within:
            raise RuntimeError(f"speculators lost the SIGINT ({why}) before its first epoch was saved; "
                               f"give it more time; {log_path}")
        ckpt = save / max(within, key=int)
        done, upto = marks[ckpt.name]
        saved_at = text.find(f"Saving checkpoint to {ckpt}")  # its steps end there, wherever the poll saw it
        steps = _steps(text[:saved_at if saved_at >= 0 else upto])
        after = (f"the process was killed {lost - sigint:.0f} s after the SIGINT" if lost is not None
                 else f"the process exited {proc.returncode}")
        return {"checkpoint": ckpt, **steps, "train_s": round(done - first, 2),
                "startup_s": round(first - t0, 2), "save_s": None, "interrupted": False,
                "interrupt_lost": f"{why}: the row is epoch {int(ckpt.name) + 1}'s checkpoint, the last saved "
                                  f"within the budget; {after}",
                "own_validation": _validation(text[:upto]), "settings": _resolved(save, ckpt), "command": argv,
                "log": str(log_path)}
    # The interrupt's save; or, when every epoch ran within the budget, the last epoch's (a SIGINT
    # that lands after run_training has returned ends the process with -2: nothing is lost then).
    interrupted, final = save / "interrupted", _final_epoch(save)
    ckpt = interrupted if (interrupted / "model.safetensors").is_file() else final
    ok = proc.returncode == 0 or (sigint is not None and proc.returncode == -signal.SIGINT and ckpt == final)
    if ckpt is None or not ok:
        raise RuntimeError(f"speculators train failed (exit {proc.returncode}"
                           f"{', no checkpoint in ' + str(save) if ckpt is None else ''}); {log_path}:\n{_tail(text)}")
    return {"checkpoint": ckpt, **_steps(text), "train_s": round((sigint or end) - first, 2),
            "startup_s": round(first - t0, 2), "save_s": round(end - (sigint or end), 2),
            "own_validation": _validation(text),
            "interrupted": ckpt.name == "interrupted", "settings": _resolved(save, ckpt), "command": argv,
            "log": str(log_path)}


def _resolved(save: Path, ckpt: Path) -> dict:
    """The run's settings, with the taps and draft vocabulary as the saved model resolved them."""
    settings = _settings(save / "run.yaml")
    config = json.loads((ckpt / "config.json").read_text())
    settings["target_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    settings["draft_vocab_size"] = config.get("draft_vocab_size")
    return settings


def fused_loss_fails(version: str | None = None) -> bool:
    """speculators' default fused KL loss does not compile on torch 2.11 (the version vLLM 0.26.0 pins): on an H200
    (2026-12-03, triton 3.6) its first step died in dynamo tracing the backward's Triton autotuner
    (losses/fused.py:343 -> "ListVariable(length=21) is already tracked for mutation", the kernel's
    `configs`). The eager loss computes the same KL (losses/utils.py:117-128) and runs there."""
    import torch

    return (version or torch.__version__).startswith("2.11.")


def importable(checkpoint: Path) -> Path:
    """The directory `eaglewire import --from` reads: speculators' checkpoint as it is.

    Its save_pretrained (train/checkpointer.py:350) writes config.json (speculators_model_type eagle3,
    top-level ids in vLLM's convention, every norm flag) and model.safetensors with layers.0.*, fc,
    input_norm, norm, lm_head and embed_tokens, plus d2t and t2d when --draft-vocab-size made a draft
    vocabulary (model.py:48-55); eaglewire's speculators reader takes it without an edit (with no
    d2t it reads the full target vocabulary). No step is needed: this only checks the directory.
    """
    checkpoint = Path(checkpoint)
    cfg = checkpoint / "config.json"
    if not cfg.is_file() or not (checkpoint / "model.safetensors").is_file():
        raise ValueError(f"{checkpoint}: not a speculators checkpoint (config.json and model.safetensors)")
    if json.loads(cfg.read_text()).get("speculators_model_type") != "eagle3":
        raise ValueError(f"{checkpoint}: not an EAGLE-3 speculators checkpoint (speculators_model_type)")
    return checkpoint
