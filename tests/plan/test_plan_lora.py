"""``moe-async plan`` with ``trainer.lora``: the frozen base keeps its weights only, the adapters
add weights, fp32 grads and Adam state, and the weight sync is the adapter's PEFT tensors (fp32).

Hand count, Qwen3-30B-A3B (H=2048, L=48, E=128, I=768, nh=32, ng=4, d=128: q=4096, kv=512) at
TP4 EP8, rank 16, all seven targets, one adapter per expert:

    per GPU, one layer  qkv  A 16x2048 whole + B (4096+2x512)x16 / 4     =    53,248
                        o    A 16x4096 / 4 + B 2048x16 whole              =    49,152
                        experts 128/8 x (16x2048 + 2x768x16 + 16x768 + 2048x16)
                                = 16 x 102,400                            = 1,638,400
    48 layers: dense 48 x 102,400 = 4,915,200; expert 48 x 1,638,400 = 78,643,200; 83,558,400
    PEFT (sync), one layer  q/k/v 3 x 32,768 (A each) + 81,920 = 180,224; o 65,536 + 32,768
                            = 98,304; experts 128 x 102,400 = 13,107,200: 13,385,728
    48 layers: 642,514,944 elements x 4 bytes (fp32) = 2,570,059,776 bytes

Base per GPU (tests/plan/test_c25_memory.py): 394,999,808 dense + 3,623,878,656 expert.
"""

from pathlib import Path

from moe_async.config import load_config
from moe_async.layout import ParallelLayout
from moe_async.lora.config import LoraConfig
from moe_async.plan.arch import model_shape
from moe_async.plan.lora import lora_counts
from moe_async.plan.report import make_plan
from moe_async.plan.table import format_plan

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3_30b_a3b.yaml"
LAYOUT = ["trainer.nodes=1", "trainer.devices_per_node=8", "trainer.tensor_model_parallel_size=4",
          "trainer.expert_model_parallel_size=8", "trainer.expert_tensor_parallel_size=1",
          "trainer.pipeline_model_parallel_size=1", "trainer.use_distributed_optimizer=true",
          "trainer.params_dtype=bf16", "cluster.nodes=null", "trainer.optimizer_cpu_offload=false",
          "trainer.moe_grouped_gemm=false"]
BASE_GPU = 394_999_808 + 3_623_878_656
AD_DENSE, AD_EXPERT = 4_915_200, 78_643_200
PEFT_BYTES = 2_570_059_776


def test_qwen3_30b_lora_memory_and_sync_by_hand():
    cfg = load_config(CONFIG, [*LAYOUT, "trainer.lora.rank=16"])
    plan = make_plan(cfg, family_check=False)
    t, full = plan.trainer, make_plan(load_config(CONFIG, LAYOUT), family_check=False).trainer
    assert t.adapter_params == AD_DENSE + AD_EXPERT == 83_558_400
    assert t.params == full.params == BASE_GPU  # the base as without LoRA
    assert t.weights == (BASE_GPU + AD_DENSE + AD_EXPERT) * 2  # bf16 base + adapters
    assert t.grads == (AD_DENSE + AD_EXPERT) * 4  # fp32 grads of the adapters only
    assert t.optimizer_plain == (AD_DENSE + AD_EXPERT) * 12  # fp32 master + 2 moments, adapters only
    assert t.optimizer_distributed == AD_DENSE * 12 // 2 + AD_EXPERT * 12 // 1  # dense / DP2, expert / EDP1
    assert t.sync_buckets == 0 and t.activations == full.activations
    assert plan.sync.bytes == PEFT_BYTES  # adapter-only sync vs the whole model's
    assert full.grads == BASE_GPU * 4 and plan.sync.bytes < make_plan(load_config(CONFIG, LAYOUT),
                                                                      family_check=False).sync.bytes / 20
    text = format_plan(plan, cfg, "qwen3_30b_a3b.yaml")
    assert "LoRA rank 16 (experts: per_expert): 83,558,400 adapter parameters per GPU" in text
    assert "weight sync  adapter only: 2.5701 GB" in text


# the tiny Mixtral of tests/lora (hidden 64, 4 heads, 2 KV heads, 4 experts of width 128, 2 layers)
TINY = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 256, "tie_word_embeddings": False}


def test_tiny_mixtral_counts_equal_the_trainers():
    """The numbers tests/lora/test_lora_trainer.py measures on the trainer: 18,944 adapter
    parameters at TP1 (9,472 on a PP2 stage) and 19,968 elements in the exported PEFT tensors."""
    shape = model_shape(TINY, "tiny")
    lo = LoraConfig(rank=4, alpha=8.0)
    one = lora_counts(shape, list(shape.layers), lo, ParallelLayout(world_size=1))
    assert one.dense + one.expert == 18_944 and one.peft == 19_968
    stage = lora_counts(shape, list(shape.layers[:1]), lo, ParallelLayout(pp=2, world_size=2))
    assert stage.dense + stage.expert == 9_472
    tp2 = lora_counts(shape, list(shape.layers), lo, ParallelLayout(tp=2, world_size=2))
    # TP2: qkv B (128x4) and o A (4x64) halved on each rank: 2 layers x (256 + 128) fewer
    assert tp2.dense + tp2.expert == 18_944 - 2 * (256 + 128) and tp2.peft == 19_968
    shared = lora_counts(shape, list(shape.layers), lo.model_copy(update={"experts": "shared"}),
                         ParallelLayout(world_size=1))
    assert shared.expert == 2 * 2048 and shared.peft == 19_968  # one adapter per layer, exported per expert


# tests/lora/_lora_ds3_counts.py's tiny DeepSeek-V3 (MLA, 4 heads of v_head_dim 24: o takes 96 of hidden 64;
# layer 0 dense of 96, layers 1-2 MoE: 8 experts of 32 and one shared expert of 32)
TINY_DS3 = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_attention_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1, "q_lora_rank": 32,
            "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 4, "vocab_size": 256}


def test_tiny_deepseek_v3_counts_mla_o_as_the_trainer():
    """MLA's o projection is adapted (A [4, 96] split by TP, B [64, 4] whole): 20,480 exported
    elements and 19,712 trainer parameters at TP1 (tests/lora/test_lora_trainer.py measures
    both on the trainer); at TP2 o's A, the dense and shared fc2's A and the fc1 B halved."""
    shape = model_shape(TINY_DS3, "tiny")
    lo = LoraConfig(rank=4, alpha=8.0)
    one = lora_counts(shape, list(shape.layers), lo, ParallelLayout(world_size=1))
    assert one.peft == 20_480 and one.dense + one.expert == 19_712
    o = lora_counts(shape, list(shape.layers), LoraConfig(rank=4, target_modules=["o_proj"]),
                    ParallelLayout(world_size=1))
    assert o.peft == o.dense == 3 * (4 * 96 + 64 * 4)
    tp2 = lora_counts(shape, list(shape.layers), lo, ParallelLayout(tp=2, world_size=2))
    assert tp2.peft == 20_480 and tp2.dense == one.dense - 3 * 192 - (384 + 192) - 2 * (128 + 64)
