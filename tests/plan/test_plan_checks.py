"""``moe-async plan``'s checks: the layout against the model (C24's rules plus heads, KV
groups, experts, expert FFN, layers) and the cluster, the architecture's sources, errors
naming the field and the rule."""

import json
from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import load_config
from moe_async.plan.arch import ArchError, model_shape
from moe_async.plan.memory import PlanError
from moe_async.plan.report import make_plan

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3_30b_a3b.yaml"
QWEN3_30B = load_config(CONFIG).model.arch


def _plan(*overrides):
    # the checks below were written at 16 trainer GPUs (the shipped config runs slime's 8)
    return make_plan(load_config(CONFIG, ["trainer.nodes=2", *overrides]), family_check=False)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        # 4 KV groups: Megatron cannot split them over TP8 (SGLang could, by replication)
        (["trainer.tensor_model_parallel_size=8"], "trainer.tensor_model_parallel_size=8 does not divide the 4 KV groups"),
        (["trainer.tensor_model_parallel_size=1", "trainer.expert_model_parallel_size=16", "trainer.nodes=4"],
         None),  # fits the rules (checked below: no error)
        (["trainer.expert_model_parallel_size=16", "trainer.expert_tensor_parallel_size=1", "model.arch.num_experts=120"],
         "trainer.expert_model_parallel_size=16 does not divide the 120 experts"),
        (["trainer.expert_tensor_parallel_size=2", "model.arch.moe_intermediate_size=769"],
         "trainer.expert_tensor_parallel_size=2 does not divide the expert FFN size 769"),
        (["trainer.pipeline_model_parallel_size=2", "model.arch.num_hidden_layers=47"],
         "47 layers (model.arch: num_hidden_layers) are not divisible by trainer.pipeline_model_parallel_size=2 x "
         "virtual_pipeline_model_parallel_size=1"),
        (["trainer.pipeline_model_parallel_size=2", "trainer.virtual_pipeline_model_parallel_size=5"],
         "are not divisible by trainer.pipeline_model_parallel_size=2 x virtual_pipeline_model_parallel_size=5 = 10"),
        (["trainer.nodes=1", "trainer.devices_per_node=16"], "trainer: 16 ranks per node"),
        (["engine.tensor_parallel_size=3", "engine.expert_parallel_size=1"],
         "engine.tensor_parallel_size=3 does not divide the 32 attention heads"),
        (["engine.num_engines=3", "cluster.nodes=3"], "= 28 GPUs exceed cluster.nodes=3 x gpus_per_node=8 = 24"),
        # an engine of 16 GPUs on 8-GPU nodes: one Ray bundle cannot span nodes (SGLang --nnodes)
        (["engine.tensor_parallel_size=16", "engine.expert_parallel_size=16"],
         "16 GPUs per node exceed cluster.gpus_per_node=8: set engine.nodes_per_engine=2"),
        (["engine.tensor_parallel_size=8", "engine.expert_parallel_size=8", "engine.devices_per_engine=8",
          "engine.nodes_per_engine=2"], "engine.nodes_per_engine=2: an engine spanning nodes takes them whole"),
        (["weight_sync.transport=tensor", "weight_sync.backend=auto"],
         "weight_sync.transport='tensor' hands the engines memory handles"),
        (["engine.devices_per_engine=12"], "an engine larger than a node takes whole nodes, so its devices must be a "
                                           "multiple of 8"),
    ],
)
def test_layout_against_model_and_cluster(overrides, needle):
    if needle is None:
        assert _plan(*overrides).trainer.layout.edp == 2
        return
    with pytest.raises(PlanError, match="layout does not fit") as e:
        _plan(*overrides)
    assert needle in str(e.value)


def test_every_broken_rule_is_listed_at_once():
    with pytest.raises(PlanError) as e:
        _plan("trainer.tensor_model_parallel_size=8", "trainer.nodes=2", "engine.tensor_parallel_size=3",
              "engine.expert_parallel_size=1")
    msg = str(e.value)
    assert "KV groups" in msg and "engine.tensor_parallel_size=3" in msg and msg.count("\n  ") >= 2


def test_megatron_rule_itself_still_refused_first(capsys):
    # C24: 64 GPUs at TP4 PP16 EP4 with ETP = TP is refused by the layout rule (config load, exit 2)
    rc = main(["plan", str(CONFIG), "trainer.nodes=8", "trainer.tensor_model_parallel_size=4",
               "trainer.pipeline_model_parallel_size=16", "trainer.expert_model_parallel_size=4",
               "trainer.expert_tensor_parallel_size=4"])
    assert rc == 2 and "Megatron's expert rule" in capsys.readouterr().err


def test_arch_from_config_json_and_agreement(tmp_path, capsys):
    d = tmp_path / "Qwen3-30B-A3B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**QWEN3_30B, "rope_theta": 1e6, "use_sliding_window": True}))
    p = make_plan(load_config(CONFIG, [f"model.hf_path={d}"]))
    assert p.shape.source == str(d / "config.json") and p.shape.total == 30_532_122_624
    # the trainer family's own refusal of a field is reported, not hidden
    assert any("moe-async train would refuse" in w and "use_sliding_window" in w for w in p.warnings)
    with pytest.raises(PlanError, match=r"model\.arch\.hidden_size=4096 differs from .*config\.json: hidden_size=2048"):
        make_plan(load_config(CONFIG, [f"model.hf_path={d}", "model.arch.hidden_size=4096"]))


def test_no_architecture_anywhere_names_model_arch(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {CONFIG}\nmodel: {{arch: null, hf_path: {tmp_path / 'none'}}}\n")
    assert main(["plan", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "model.arch: plan needs the model's architecture" in err and "has no config.json" in err


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model_type": "gpt2"}, "model.arch: model_type='gpt2' is not one plan counts"),
        ({"hidden_size": None}, "model.arch.hidden_size is required"),
        ({"num_experts": 0}, "model.arch.num_experts=0: must be an integer >= 1"),
        ({"num_key_value_heads": 5}, "model.arch.num_attention_heads=32 is not a multiple of num_key_value_heads=5"),
        ({"num_experts_per_tok": 200}, "model.arch.num_experts_per_tok=200 exceeds the 128 experts"),
        ({"tie_word_embeddings": "no"}, "model.arch.tie_word_embeddings='no': must be true or false"),
    ],
)
def test_bad_arch_fields_named(change, needle):
    with pytest.raises(ArchError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        model_shape({**QWEN3_30B, **change}, "model.arch")


def test_arch_only_with_hf_source():
    from moe_async.config import ConfigError

    with pytest.raises(ConfigError, match="model.arch describes an HF checkpoint"):
        load_config(CONFIG, ["model.source=random_moe", "model.hf_path=null"])


def test_uneven_stages_leaving_a_stage_empty_are_refused():
    """Megatron-Core refuses a first/last stage size of 0 and an empty middle stage; so do the
    config (sizes >= 1) and plan (48 layers at PP4 with 24 + 24 on the first and last stages
    leave the 2 middle stages none); 46 + 1 at PP3 (one layer in the middle) still fits."""
    from pydantic import ValidationError

    from moe_async.trainer.config import TrainerConfig

    for f in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        with pytest.raises(ValidationError, match="greater than or equal to 1"):
            TrainerConfig(**{f: 0})
    with pytest.raises(PlanError, match="leave 0 layers for 2 other stage") as e:
        _plan("trainer.pipeline_model_parallel_size=4", "trainer.nodes=4", "trainer.num_layers_in_first_pipeline_stage=24",
              "trainer.num_layers_in_last_pipeline_stage=24")
    assert "at least one each" in str(e.value)
    _plan("trainer.pipeline_model_parallel_size=3", "trainer.num_layers_in_first_pipeline_stage=46",
          "trainer.num_layers_in_last_pipeline_stage=1", "trainer.nodes=3")


def test_recompute_num_layers_above_a_stage_is_refused():
    """Full recompute's ``recompute_num_layers`` counts layers of one pipeline stage (Megatron-Core:
    1 to the layers per pipeline rank): above the largest stage it is refused, naming the field
    (by plan, and by ``moe-async train`` before the run dir or Ray: the same model rules)."""
    from moe_async.plan.report import hf_config_layout_errors

    full = ("trainer.recompute_granularity=full", "trainer.recompute_method=block")
    with pytest.raises(PlanError, match=r"trainer.recompute_num_layers=49 exceeds the 48 layers of the largest "
                                        r"pipeline stage \(48 layers, model.arch: num_hidden_layers"):
        _plan(*full, "trainer.recompute_num_layers=49")
    _plan(*full, "trainer.recompute_num_layers=48")
    with pytest.raises(PlanError, match="recompute_num_layers=25 exceeds the 24 layers of the largest pipeline stage"):
        _plan(*full, "trainer.recompute_num_layers=25", "trainer.pipeline_model_parallel_size=2", "trainer.nodes=4")
    uneven = (*full, "trainer.pipeline_model_parallel_size=2", "trainer.nodes=4",
              "trainer.num_layers_in_first_pipeline_stage=30")  # stages of 30 + 18
    _plan(*uneven, "trainer.recompute_num_layers=30")
    with pytest.raises(PlanError, match="recompute_num_layers=31 exceeds the 30 layers"):
        _plan(*uneven, "trainer.recompute_num_layers=31")
    with pytest.raises(PlanError, match=r"exceeds the 12 layers of the largest pipeline chunk .* x virtual stages 2"):
        _plan(*full, "trainer.recompute_num_layers=13", "trainer.pipeline_model_parallel_size=2", "trainer.nodes=4",
              "trainer.virtual_pipeline_model_parallel_size=2")
    cfg = load_config(None, [*full, "trainer.recompute_num_layers=3"])
    errs = hf_config_layout_errors(cfg, {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64,
                                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                         "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256},
                                   "/tiny/config.json")
    assert any("trainer.recompute_num_layers=3 exceeds the 2 layers" in e and "/tiny/config.json" in e
               for e in errs), errs


def test_router_bias_update_without_an_expert_bias_is_refused():
    """``trainer.moe_router_bias_update_rate > 0`` on a model whose router has no expert bias
    (Qwen3's softmax router) is refused by plan's model rules, naming the field (before the run
    dir and Ray in ``moe-async train``; the trainer used to refuse it only when built, inside
    its actor); a deepseek_v3 model takes it."""
    with pytest.raises(PlanError, match=r"trainer.moe_router_bias_update_rate=0.001: model_type='qwen3_moe' "
                                        r"\(model.arch\) has no router expert bias"):
        _plan("trainer.moe_router_bias_update_rate=0.001")
    _plan("trainer.moe_router_bias_update_rate=0")
    ds3 = load_config(CONFIG.parent / "deepseek_v3.yaml", ["trainer.moe_router_bias_update_rate=0.001"])
    make_plan(ds3, family_check=False)  # no error
