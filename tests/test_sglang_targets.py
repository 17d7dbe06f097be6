"""benchmarks/sglang_targets.py on a small stand-in of SGLang's srt/models/ (SGLang itself needs CUDA): which
EntryClass runs a set_eagle3_layers_to_capture, its own or a base class's in another file."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sglang_targets  # noqa: E402


def _site(tmp_path):
    models = tmp_path / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    (models / "llama.py").write_text(
        "class LlamaForCausalLM(nn.Module):\n"
        "    def set_eagle3_layers_to_capture(self, layer_ids=None):\n"
        "        self.model.layers_to_capture = [v + 1 for v in layer_ids]\n"
        "class Phi3ForCausalLM(LlamaForCausalLM):\n    pass\n"
        "EntryClass = [LlamaForCausalLM, Phi3ForCausalLM]\n")
    (models / "mistral.py").write_text(
        "\ufefffrom sglang.srt.models.llama import LlamaForCausalLM\n"
        "class MistralForCausalLM(llama.LlamaForCausalLM):\n    pass\n"
        "EntryClass = MistralForCausalLM\n")
    (models / "gemma2.py").write_text("class Gemma2ForCausalLM(nn.Module):\n    pass\nEntryClass = Gemma2ForCausalLM\n")
    return tmp_path


def test_inherited_setters_are_found_and_missing_ones_named(tmp_path, capsys):
    site = _site(tmp_path)
    assert sglang_targets.scan(site / "sglang" / "srt" / "models") == {
        "LlamaForCausalLM": "llama", "Phi3ForCausalLM": "llama", "MistralForCausalLM": "llama",
        "Gemma2ForCausalLM": None}
    assert sglang_targets.main([str(site), "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "3 of 4 target classes" in out and "Gemma2ForCausalLM   no set_eagle3_layers_to_capture" in out
    assert json.loads((tmp_path / "t.json").read_text())["MistralForCausalLM"] == "llama"


def test_a_folder_without_sglang_is_one_line_exit_2(tmp_path, capsys):
    assert sglang_targets.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
