"""`--engine-args` resolved as the engines resolve them (sglang server_args.py, vllm config/speculative.py)."""

import json

import pytest

from eaglewire.doctor import engine_args as ea
from eaglewire.errors import UsageError

SEED = "--speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16"


def test_sglang_server_args_topk1_forces_draft_tokens_to_steps_plus_1_the_seed_incident():
    run = ea.parse("sglang", "python -m sglang.launch_server --model-path M " + SEED)
    assert (run.algorithm, run.num_steps, run.topk, run.num_draft_tokens) == ("EAGLE3", 1, 1, 2)
    (o,) = run.overrides
    assert (o.setting, o.requested, o.used, o.severity) == ("--speculative-num-draft-tokens", 16, 2, "warning")
    assert not run.refusals


@pytest.mark.parametrize("arch,auto", [("LlamaForCausalLM", (5, 4, 8)), ("DeepseekV3ForCausalLM", (3, 1, 4)),
                                       ("Grok1ForCausalLM", (5, 4, 8)), ("Qwen3ForCausalLM", (3, 1, 4)),
                                       ("Qwen2ForCausalLM", (3, 1, 4)), (None, (3, 1, 4))])
def test_sglang_auto_choose_speculative_params_by_target_architecture(arch, auto):
    """speculative_hook.py:795-825 (0.5.17; 0.5.11 server_args.py:7471-7506): only Llama and Grok-1 get (5, 4, 8);
    every architecture it does not name falls to (3, 1, 4)."""
    run = ea.parse("sglang", "--speculative-algorithm=EAGLE3", target_arch=arch)
    assert (run.num_steps, run.topk, run.num_draft_tokens) == auto
    assert run.overrides[0].used == list(auto) and run.overrides[0].severity == "info"


def test_sglang_refusals_and_aliases_from_server_args():
    assert ea.parse("sglang", "--speculative-algorithm EAGLE3 --speculative-eagle-topk 4").refusals  # steps unset
    r = ea.parse("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 4 "
                           "--speculative-num-draft-tokens 8 --page-size 16")
    assert not r.refusals  # no backend named: SGLang picks one for the hardware first
    tree = ("--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 4 "
            "--speculative-num-draft-tokens 8 --page-size 16 --attention-backend ")
    for backend, refused in (("flashinfer", False), ("fa3", False), ("triton", False), ("torch_native", True)):
        r = ea.parse("sglang", tree + backend)  # speculative_hook.py:666-681 (0.5.17)
        assert bool(r.refusals) == refused and all("page-size" in x.why for x in r.refusals), backend
    old = ea.parse("sglang", tree + "triton", engine_version="0.5.12")  # before 0.5.13: flashinfer and fa3 only
    assert old.refusals and "only flashinfer, fa3" in old.refusals[0].why
    assert ea.parse("sglang", "--speculative_algorithm NEXTN").algorithm == "EAGLE"  # NEXTN is EAGLE
    off = ea.parse("sglang", "--model-path M")
    assert off.algorithm is None and off.overrides[0].severity == "error"
    tm = ea.parse("sglang", SEED.replace("16", "2") + " --speculative-token-map hot.pt")
    assert [o.setting for o in tm.overrides] == ["--speculative-token-map"]


def test_vllm_method_detected_from_the_draft_path_as_speculative_py_does():
    """vllm/config/speculative.py: 'eagle-' in the path -> eagle (checked first), 'eagle3' -> eagle3, else draft_model."""
    for path, method in [("/m/llama-eagle-3", "eagle"), ("/m/EAGLE3-llama", "eagle3"), ("/m/my-draft", "draft_model")]:
        run = ea.parse("vllm", f"vllm serve T --speculative-config '{json.dumps({'model': path, 'num_speculative_tokens': 3})}'")
        assert run.algorithm == method, path
    spec = ea.parse("vllm", "--speculative-config '{\"num_speculative_tokens\": 2}'", draft_path="/d",
                    draft_config={"speculators_model_type": "eagle3"})
    assert spec.algorithm == "eagle3" and spec.num_steps == 2 and spec.num_draft_tokens == 3
    need_k = ea.parse("vllm", "--speculative-config '{\"method\": \"eagle3\", \"model\": \"/d\"}'")
    assert need_k.refusals
    dotted = ea.parse("vllm", "--speculative-config.method eagle3 --speculative-config.num_speculative_tokens 4")
    assert (dotted.algorithm, dotted.num_steps) == ("eagle3", 4)


def test_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError, match="must be an integer"):
        ea.parse("sglang", "--speculative-num-steps three")
    with pytest.raises(UsageError, match="not JSON"):
        ea.parse("vllm", "--speculative-config {method")
    with pytest.raises(UsageError, match="--engine"):
        ea.parse("trtllm", "")


def test_rewriting_arguments_keeps_the_rest():
    fixed = ea.with_option(SEED + " --tp 2", "speculative-num-draft-tokens", 2)
    run = ea.parse("sglang", fixed)
    assert not run.overrides and run.given["tp"] == "2"
    v = ea.with_speculative_config("vllm serve T --speculative-config '{\"method\": \"eagle\", \"model\": \"/d\", "
                                   "\"num_speculative_tokens\": 3}'", method="eagle3")
    assert ea.parse("vllm", v).algorithm == "eagle3" and ea.parse("vllm", v).draft_path == "/d"


def test_sglang_tree_of_more_draft_tokens_than_its_steps_draft():
    """eagle_utils.py organize_draft_results: torch.topk picks num_draft_tokens - 1 of the topk + (steps - 1) x
    topk^2 drafted candidates; steps 2 of topk 2 draft 6, so 8 draft tokens fail at the first request."""
    (r,) = ea.parse("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 2 --speculative-eagle-topk 2 "
                              "--speculative-num-draft-tokens 8").refusals
    assert "at most 6 candidates" in r.why and r.fix == {"speculative-num-draft-tokens": 7}
    assert not ea.parse("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 6 --speculative-eagle-topk 8 "
                                  "--speculative-num-draft-tokens 64").refusals
