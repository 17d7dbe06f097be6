"""The tap contract and its translations, one test per convention rule, naming the source."""

import json

import pytest

from eaglewire.errors import TapError
from eaglewire.taps import (CONVENTIONS, TapContract, default_taps, sglang_convention, sglang_default_taps)

KIMI_LAYERS = 61  # Kimi-K2.5 / DeepSeek-V3: 61 decoder layers


def test_default_taps_are_eagle3s():
    # SafeAILab/EAGLE modeling_llama_kv.py and SpecForge: [2, N//2, N-3]
    assert default_taps(30) == (2, 15, 27)
    assert default_taps(61) == (2, 30, 58)
    with pytest.raises(TapError, match="at least 7 layers"):
        default_taps(6)


@pytest.mark.parametrize("bad, msg", [((), "at least one tap"), ((3, 2), "increasing"), ((2, 2), "distinct"),
                                      ((31,), "out of range"), ((-1,), "out of range")])
def test_contract_rejects_bad_taps(bad, msg):
    with pytest.raises(TapError, match=msg):
        TapContract(30, bad)


def test_parse_from_cli():
    assert TapContract.parse(30, "3, 15,27").taps == (3, 15, 27)
    assert TapContract.parse(30, None).taps == (2, 15, 27)
    with pytest.raises(TapError, match="comma-separated integers"):
        TapContract.parse(30, "2;15")


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_every_convention_round_trips_exactly(name):
    conv = CONVENTIONS[name]
    for taps in [(2, 15, 27), (3, 15, 29), (5,), (2, 3, 4, 20)]:
        assert conv.from_ids(conv.to_ids(taps, 30), 30) == taps


def test_vllm_uses_ids_as_taps():
    # vllm/model_executor/models/llama.py: aux state = hidden_states + residual BEFORE layer j
    assert CONVENTIONS["vllm"].to_ids((2, 15, 27), 30) == [2, 15, 27]
    assert CONVENTIONS["vllm"].to_ids((1, 30), 30) == [1, 30]  # id N: EagleModelMixin, vLLM PR #36063
    # vllm/model_executor/models/interfaces.py _maybe_add_hidden_state keeps the embedding tensor itself at id 0,
    # which layernorm.py's in-place fused_add_rms_norm overwrites: served, id 0 fed the last layer's state (run 20)
    with pytest.raises(TapError, match="not the embedding"):
        CONVENTIONS["vllm"].to_ids((0, 15, 27), 30)
    with pytest.raises(TapError, match="not the embedding"):
        CONVENTIONS["vllm"].from_ids([0, 15, 27], 30)
    with pytest.raises(TapError, match="upgrade vLLM"):
        CONVENTIONS["vllm-legacy"].to_ids((0, 15), 30)


def test_sglang_llama_adds_one():
    # sglang/srt/models/llama.py set_eagle3_layers_to_capture: [val + 1 for val in layer_ids]
    assert CONVENTIONS["sglang"].to_ids((2, 15, 27), 30) == [1, 14, 26]
    assert CONVENTIONS["sglang"].from_ids([2, 15, 27], 30) == (3, 16, 28)


def test_same_tensor_has_vllm_id_one_larger_than_sglang_id():
    for tap in range(1, 30):
        assert CONVENTIONS["vllm"].to_ids((tap,), 30)[0] == CONVENTIONS["sglang"].to_ids((tap,), 30)[0] + 1


def test_sglang_cannot_capture_the_embedding_or_the_last_layer():
    # sglang llama.py: residual is None at layer 0 (crash); the loop never reaches layer N
    with pytest.raises(TapError, match="embedding .*residual is None"):
        CONVENTIONS["sglang"].to_ids((0, 15, 27), 30)
    with pytest.raises(TapError, match="cannot express taps \\[30\\]"):
        CONVENTIONS["sglang"].to_ids((2, 15, 30), 30)


def test_sglang_default_branch_differs_from_explicit_branch():
    # sglang #23569: absent ids -> [2, N//2, N-3] used WITHOUT +1; writing them explicitly shifts by one
    assert sglang_default_taps(30) == (2, 15, 27)
    assert CONVENTIONS["sglang"].from_ids([2, 15, 27], 30) == (3, 16, 28)


def test_seed_incident_kimi_deepseek_first_id_heuristic():
    """Training captured taps [3, 31, 59]; SGLang ids [2, 30, 58] were right before PR #25454, wrong after."""
    taps = (3, 31, 59)
    legacy, heuristic = CONVENTIONS["sglang-deepseek-legacy"], CONVENTIONS["sglang-deepseek"]
    assert legacy.to_ids(taps, KIMI_LAYERS) == [2, 30, 58]
    assert heuristic.from_ids([2, 30, 58], KIMI_LAYERS) == (2, 30, 58)  # shifted: the incident
    assert heuristic.to_ids(taps, KIMI_LAYERS) == [3, 31, 59]
    # sglang/srt/models/deepseek_v2.py (#25454): +1 only when the first id is 1
    assert heuristic.from_ids([1, 30, 58], KIMI_LAYERS) == (2, 31, 59)
    with pytest.raises(TapError, match="starting at tap 1"):
        heuristic.to_ids((1, 30, 58), KIMI_LAYERS)


def test_sglang_convention_depends_on_family():
    """sglang 0.5.17 srt/models/: deepseek_v2.py serves deepseek_v32 too (DeepseekV32ForCausalLM, :3196) and
    glm4_moe.py's GlmMoeDsaForCausalLM subclasses it (:1461); glm4_moe.py's own class keeps llama's +1."""
    assert sglang_convention("llama") == "sglang"
    assert sglang_convention("qwen3") == "sglang"
    assert sglang_convention("glm4_moe") == "sglang"
    assert sglang_convention("deepseek_v3") == "sglang-deepseek"
    assert sglang_convention("kimi_k2", (0, 5, 12)) == "sglang-deepseek-legacy"
    for model_type in ("deepseek_v32", "glm_moe_dsa", "kimi_k25"):
        assert sglang_convention(model_type, (0, 5, 17)) == "sglang-deepseek"
    assert sglang_convention("gpt_oss", (0, 5, 17)) == "sglang-gpt-oss"
    assert sglang_convention("gpt_oss", (0, 5, 16)) == "sglang"  # not read before 0.5.17: llama's rule, tap N refused
    assert sglang_convention("qwen3_moe") == "sglang-communicator"


def test_sglang_gpt_oss_keeps_ids_that_reach_the_last_layer():
    """sglang 0.5.17 models/gpt_oss.py:1328-1343: ids as they are when their largest is N, else +1; :723-741
    captures boundary i + 1 after layer i, so tap N (boundary N) is captured."""
    conv = CONVENTIONS["sglang-gpt-oss"]
    assert conv.from_ids([24, 30, 36], 36) == (24, 30, 36)
    assert conv.from_ids([1, 17, 32], 36) == (2, 18, 33)
    assert conv.from_ids([1, 17, 35], 36) == (2, 18, 36)
    assert conv.to_ids((2, 18, 36), 36) == [1, 17, 35]  # +1 always: read alike by both forms of the rule
    with pytest.raises(TapError, match="boundary 0"):
        conv.to_ids((0, 18, 33), 36)


def test_sglang_glm4_moe_lite_reads_the_heuristic_but_cannot_capture_the_embedding():
    """sglang 0.5.17 models/glm4_moe_lite.py:1013-1028 (deepseek_v2's first-id heuristic), :814 and :838-840
    (llama's capture: residual is None at layer 0)."""
    conv = CONVENTIONS["sglang-glm4-moe-lite"]
    assert conv.from_ids([1, 20, 40], 47) == (2, 21, 41) and conv.from_ids([3, 20, 40], 47) == (3, 20, 40)
    with pytest.raises(TapError, match="taps 0 and 1 cannot be written"):
        conv.to_ids((0, 20, 40), 47)
    with pytest.raises(TapError, match="taps 0 and 1 cannot be written"):
        conv.from_ids([0, 20, 40], 47)


def test_sglang_moe_families_capture_the_embedding_at_id_minus_1():
    """sglang 0.5.17 models/qwen2_moe.py:891-894 flags layers[id + 1] (:1203-1218); the flagged layer captures
    through layers/communicator.py:505-535 (a clone of the residual, the embedding at layer 0: :619-620)."""
    conv = CONVENTIONS["sglang-communicator"]
    assert conv.to_ids((0, 24, 45), 48) == [-1, 23, 44] and conv.from_ids([-1, 23, 44], 48) == (0, 24, 45)
    with pytest.raises(TapError, match="never the output of the last layer"):
        conv.to_ids((2, 24, 48), 48)


def test_specforge_and_modelopt_count_layer_outputs():
    # SpecForge / ModelOpt: "0-based output of layer j" = tap j+1; default [1, N//2-1, N-4]
    assert CONVENTIONS["specforge"].to_ids((2, 15, 27), 30) == [1, 14, 26]
    assert CONVENTIONS["specforge"].to_ids((30,), 30) == [29]
    with pytest.raises(TapError, match="no layer's output"):
        CONVENTIONS["specforge"].to_ids((0,), 30)


def test_hf_index_has_no_pre_norm_last_state():
    # transformers modeling_llama.py: hidden_states[N] is after the final norm
    assert CONVENTIONS["hf"].to_ids((0, 2, 29), 30) == [0, 2, 29]
    with pytest.raises(TapError, match="after the final norm"):
        CONVENTIONS["hf"].to_ids((30,), 30)


def test_contract_serialises_with_every_engines_words():
    c = TapContract(30, (2, 15, 27))
    d = json.loads(json.dumps(c.to_dict()))
    assert d["in_conventions"]["sglang"] == [1, 14, 26]
    assert d["in_conventions"]["vllm"] == [2, 15, 27]
    assert TapContract.from_dict(d) == c
    e = TapContract(30, (0, 15, 30)).to_dict()
    assert e["in_conventions"]["sglang"].startswith("unsupported")
    with pytest.raises(TapError, match="missing field"):
        TapContract.from_dict({"taps": [1]})


def test_the_taps_table_gives_each_sglang_rule_of_a_family_with_its_releases():
    """`eaglewire taps` on a DeepSeek-V3 target: both of deepseek_v2.py's rules (PR #25454, in 0.5.13), each with
    the releases it holds for; a llama target has one rule, for every release."""
    from eaglewire.commands import engine_table

    rows = {r["convention"]: r for r in engine_table(TapContract(61, (3, 31, 59)), "deepseek_v3")}
    assert rows["sglang-deepseek"]["ids"] == [3, 31, 59]
    assert rows["sglang-deepseek"]["sglang_releases"] == "0.5.13 and newer"
    assert rows["sglang-deepseek-legacy"]["ids"] == [2, 30, 58]
    assert rows["sglang-deepseek-legacy"]["sglang_releases"] == "before 0.5.13"
    llama = {r["convention"]: r for r in engine_table(TapContract(30, (2, 15, 27)), "llama")}
    assert llama["sglang"]["sglang_releases"] == "every release" and "sglang-deepseek" not in llama
