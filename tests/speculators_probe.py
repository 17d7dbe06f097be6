"""Runs INSIDE the speculators 0.9.0 venv (tests/speculators_env.py), never imported by the suite.

  probe.py run DRAFT_DIR INPUTS OUT           load DRAFT_DIR with speculators' own Eagle3DraftModel
  probe.py write OUT_DIR INPUTS OUT FLAGS     build a draft with speculators' own classes, save_pretrained it
  probe.py batch JOBS_JSON                    several of the above in one process (imports are slow)

Both run speculators' forward for two TTT steps on INPUTS (taps, input_ids, position_ids) and save
the logits of each step (captured at lm_head) to OUT. fp32, eager attention (no flex on CPU).
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file


def _forward(model, inputs: dict) -> dict:
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().clone()))
    ids = inputs["input_ids"]
    with torch.no_grad():
        model(hidden_states=inputs["taps"], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=inputs["position_ids"], ttt_steps=2)
    hook.remove()
    return {"logits0": logits[0].contiguous(), "logits1": logits[1].contiguous(),
            "d2t": model.d2t.clone(), "t2d": model.t2d.clone()}


def run(draft_dir: str, inputs_path: str, out: str) -> dict:
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    config = SpeculatorModelConfig.from_pretrained(draft_dir)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(draft_dir, config=config).float().eval()
    save_file(_forward(model, load_file(inputs_path)), out)
    return {"class": type(model).__name__, "config_class": type(config).__name__,
            "norm_before_residual": config.norm_before_residual, "norm_output": config.norm_output,
            "fc_norm": config.fc_norm, "norm_before_fc": config.norm_before_fc,
            "layer_ids": config.eagle_aux_hidden_state_layer_ids}


def write(out_dir: str, inputs_path: str, out: str, flags_json: str) -> dict:
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    flags = json.loads(flags_json)
    # "layer": more LlamaConfig keys (a window as scripts/train.py create_transformer_layer_config sets one);
    # "verifier": the verifier's path, recorded as speculators_config.verifier.name_or_path
    extra, verifier = flags.pop("layer", {}), flags.pop("verifier", None)
    layer = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        max_position_embeddings=256, tie_word_embeddings=False, **extra)
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=64, eagle_aux_hidden_state_layer_ids=flags.pop("ids"),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=verifier,
                                                                     architectures=["LlamaForCausalLM"])),
        **flags)
    torch.manual_seed(1234)
    model = Eagle3DraftModel(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    keep = torch.randperm(128)[:64].sort().values
    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[keep] = True
    model.load_vocab_mappings(t2d, keep - torch.arange(64))
    model.save_pretrained(out_dir)
    save_file(_forward(model, load_file(inputs_path)), out)
    return {"class": type(model).__name__}


def batch(jobs_json: str) -> dict:
    with open(jobs_json) as f:
        jobs = json.load(f)
    return {name: OPS[job[0]](*job[1:]) for name, job in jobs.items()}


OPS = {"run": run, "write": write, "batch": batch}

if __name__ == "__main__":
    print(json.dumps(OPS[sys.argv[1]](*sys.argv[2:])))
