"""benchmarks/eagle3_targets.py on small stand-ins of SGLang's srt/models/ and vLLM's model_executor/models/
(both engines need CUDA): which target class runs an EAGLE-3 draft, through its own class or a base class's in
another file."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eagle3_targets  # noqa: E402


def _sglang(tmp_path):
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


def _vllm(tmp_path):
    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "interfaces.py").write_text("class SupportsEagle3(SupportsEagleBase, Protocol):\n    pass\n")
    (models / "llama.py").write_text("class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsEagle3):\n    pass\n")
    (models / "mistral.py").write_text("class MistralForCausalLM(LlamaForCausalLM):\n    pass\n")
    (models / "mixtral.py").write_text("class MixtralForCausalLM(nn.Module, SupportsLoRA, SupportsPP):\n    pass\n")
    (models / "registry.py").write_text(
        '_TEXT_GENERATION_MODELS = {\n    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),\n'
        '    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),\n'
        '    "MixtralForCausalLM": (\n        "mixtral",\n        "MixtralForCausalLM",\n    ),\n}\n'
        '_MULTIMODAL_MODELS = {\n}\n'
        '_SPECULATIVE_DECODING_MODELS = {\n    "Eagle3LlamaForCausalLM": ("llama_eagle3", "Eagle3LlamaForCausalLM"),\n}\n')
    return tmp_path


def test_sglang_inherited_setters_are_found_and_missing_ones_named(tmp_path, capsys):
    site = _sglang(tmp_path)
    assert eagle3_targets.scan_sglang(site) == {"LlamaForCausalLM": "llama", "Phi3ForCausalLM": "llama",
                                                "MistralForCausalLM": "llama", "Gemma2ForCausalLM": None}
    assert eagle3_targets.main(["sglang", str(site), "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "3 of 4 target classes" in out and "Gemma2ForCausalLM   no set_eagle3_layers_to_capture" in out
    assert json.loads((tmp_path / "t.json").read_text())["MistralForCausalLM"] == "llama"


def test_vllm_targets_are_the_registered_generators_and_supportseagle3_decides(tmp_path):
    """registry.py's text-generation and multimodal tables only (a draft class is no target); SupportsEagle3 in a
    class's bases, followed across files."""
    assert eagle3_targets.scan_vllm(_vllm(tmp_path)) == {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                                                         "MixtralForCausalLM": None}


def test_a_folder_without_the_engine_is_one_line_exit_2(tmp_path, capsys):
    assert eagle3_targets.main(["vllm", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
