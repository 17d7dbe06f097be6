"""The doctor on drafts trained elsewhere: a native draft exported for SGLang and vLLM, its eaglewire
record removed (as a speculators or SpecForge checkpoint arrives), then its layer ids written right,
shifted by +1 (the seed incident's fault), left out, or put under the key the other engine reads.
Each variant goes through `eaglewire doctor --probe`, and the table says what the doctor concluded.

    python benchmarks/doctor_foreign.py --draft CKPT --target smollm2-135m [--probe 32] [--suite mt-bench]
        [--variants right,plus1] [--json OUT]

Expected: `plus1` is PROBE_WIRING (an error) in both formats, `right` PROBE_OK; `missing` and `wrong-place`
are settled by the probe (the draft reads its trained taps best, which the fallback may or may not give).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from eaglewire import interop, targets
from eaglewire.doctor import DoctorRequest, diagnose
from eaglewire.interop.common import IDS_KEY, PROVENANCE_KEY


def _nested(cfg: dict) -> dict:
    return cfg.setdefault("eagle_config", {})


def _ids(fmt: str, cfg: dict) -> list[int]:
    return list((_nested(cfg) if fmt == "sglang" else cfg)[IDS_KEY])


def _put(fmt: str, cfg: dict, ids) -> None:
    holder = _nested(cfg) if fmt == "sglang" else cfg
    holder.pop(IDS_KEY, None)
    if ids is not None:
        holder[IDS_KEY] = list(ids)


def _elsewhere(fmt: str, cfg: dict) -> None:
    """The ids under the other engine's key: SGLang never reads the top level, vLLM never the nested one."""
    ids = _ids(fmt, cfg)
    _put(fmt, cfg, None)
    _put("vllm" if fmt == "sglang" else "sglang", cfg, ids)


VARIANTS = {
    "right": lambda fmt, cfg: None,
    "plus1": lambda fmt, cfg: _put(fmt, cfg, [i + 1 for i in _ids(fmt, cfg)]),
    "missing": lambda fmt, cfg: _put(fmt, cfg, None),
    "wrong-place": _elsewhere,
}


def foreign(native: Path, fmt: str, variant: str, root: Path) -> Path:
    out = root / f"{fmt}-{variant}"
    interop.export_draft(native, fmt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop(PROVENANCE_KEY)
    VARIANTS[variant](fmt, cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="native draft checkpoint")
    p.add_argument("--target", required=True)
    p.add_argument("--probe", type=int, default=32)
    p.add_argument("--suite", default=None)
    p.add_argument("--probe-tokens", type=int, default=128)
    p.add_argument("--formats", default="sglang,vllm")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    target = targets.load_target(a.target)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in a.formats.split(","):
            engine = "sglang" if fmt == "sglang" else "vllm"
            for variant in a.variants.split(","):
                d = foreign(Path(a.draft), fmt, variant, Path(tmp))
                t0 = time.perf_counter()
                r = diagnose(DoctorRequest(d, target=target, engine=engine, probe=a.probe, suite=a.suite,
                                           probe_tokens=a.probe_tokens))
                seconds = time.perf_counter() - t0
                verdict = next((f for f in r.findings if f.code in ("PROBE_WIRING", "PROBE_OK")), None)
                w = (r.probe or {}).get("wirings") or []
                best = max(w[1:], key=lambda x: x["acceptance_length"], default=None)
                rows.append({"format": fmt, "variant": variant, "ids": r.context["engine_ids"],
                             "engine_taps": r.context["engine_taps"], "exit": r.exit_code,
                             "codes": [f"{f.severity}:{f.code}" for f in r.findings],
                             "verdict": f"{verdict.severity}:{verdict.code}" if verdict else None,
                             "message": verdict.message if verdict else None,
                             "engine_length": w[0]["acceptance_length"] if w else None,
                             "best_other": best["taps"] if best else None,
                             "best_other_length": best["acceptance_length"] if best else None,
                             "vs_engine": best["vs_engine"] if best else None, "seconds": round(seconds, 1),
                             "prompts": (r.probe or {}).get("prompts"), "positions": (r.probe or {}).get("positions")})
                print(f"{fmt}/{variant}: {rows[-1]['verdict']} exit {r.exit_code} ({seconds:.0f} s)", file=sys.stderr)
    print(f"{'format':<8}{'variant':<13}{'ids':<16}{'captures':<16}{'verdict':<22}{'accept-len':<12}"
          f"{'best other':<16}{'its length':<12}exit")
    for r in rows:
        print(f"{r['format']:<8}{r['variant']:<13}{str(r['ids']):<16}{str(r['engine_taps']):<16}{str(r['verdict']):<22}"
              f"{r['engine_length'] or 0:<12.2f}{str(r['best_other']):<16}{r['best_other_length'] or 0:<12.2f}"
              f"{r['exit']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"draft": a.draft, "target": a.target, "probe": a.probe,
                                            "suite": a.suite, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
