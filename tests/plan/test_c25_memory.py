"""C25: memory before launch. Qwen3-30B-A3B on 8 GPUs at TP4 EP8 ETP1 PP1.

Parameter count by hand (HF Qwen3-MoE: q/k RMSNorms over head_dim, untied embeddings, a
router per layer, no shared expert), H=2048, L=48, E=128, I=768, nh=32, ng=4, d=128, V=151,936:

    attention / layer  q [4096,2048] + k, v [512,2048] + o [2048,4096]   = 18,874,368
    norms / layer      input + post-attention [2048] x 2 + q/k [128] x 2 =      4,352
    router / layer     [128, 2048]                                       =    262,144
    experts / layer    128 x 3 x 2048 x 768                              = 603,979,776
    layer total                                                          = 623,120,640
    48 layers = 29,909,790,720; embedding + lm_head 2 x 151,936 x 2048 = 622,329,856; final norm 2048
    total 30,532,122,624 (30.5B), routed experts 48 x 603,979,776 = 28,991,029,248 (29.0B)

Per GPU at TP4 EP8 ETP1 (Megatron: vocab padded to a multiple of 128 x TP = 512 -> 152,064 rows,
split over TP; attention split over TP; norms and router whole on every TP rank; experts / EP):

    dense  48 x (18,874,368 / 4 + 4,352 + 262,144) + 2 x 152,064 x 2048 / 4 + 2048 = 394,999,808
    expert 28,991,029,248 / 8                                                      = 3,623,878,656
    total 4,018,878,464 (4.0B)

bf16 weights 2 B, fp32 grads 4 B, fp32 master + 2 Adam moments 12 B per parameter; the
distributed optimizer shards dense state over DP x CP = 2 and expert state over EDP = 1.
"""

from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import load_config
from moe_async.plan.memory import GiB
from moe_async.plan.report import make_plan

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3_30b_a3b.yaml"
C25 = ["trainer.nodes=1", "trainer.devices_per_node=8", "trainer.tensor_model_parallel_size=4",
       "trainer.expert_model_parallel_size=8", "trainer.expert_tensor_parallel_size=1",
       "trainer.pipeline_model_parallel_size=1", "trainer.use_distributed_optimizer=true",
       "trainer.params_dtype=bf16", "cluster.nodes=null",
       # C25 was measured without the shipped config's recompute and offload, at balanced routing
       "trainer.optimizer_cpu_offload=false", "trainer.recompute_granularity=null", "trainer.recompute_method=null",
       "trainer.recompute_num_layers=null", "cluster.moe_imbalance=1"]

TOTAL, EXPERT = 30_532_122_624, 28_991_029_248
DENSE_GPU, EXPERT_GPU = 394_999_808, 3_623_878_656


def _plan(extra=()):
    return make_plan(load_config(CONFIG, [*C25, *extra]), family_check=False)


def test_parameter_counts_exact():
    s = _plan().shape
    assert s.total == TOTAL and s.expert_total == EXPERT
    assert round(s.total / 1e9, 1) == 30.5 and round(s.expert_total / 1e9, 1) == 29.0
    assert s.num_moe_layers == 48 and not s.tied


def test_per_gpu_memory_8_gpus():
    t = _plan().trainer
    assert (t.layout.dp, t.layout.edp) == (2, 1)
    assert (t.dense_params, t.expert_params) == (DENSE_GPU, EXPERT_GPU)
    assert round(t.params / 1e9, 1) == 4.0
    n = DENSE_GPU + EXPERT_GPU
    assert t.weights == 2 * n and t.grads == 4 * n
    assert t.optimizer_distributed == 12 * (DENSE_GPU // 2 + EXPERT_GPU)
    assert t.optimizer_plain == 12 * n
    # C25's figures, GiB, with the tolerance of its rounding ("~")
    assert t.weights / GiB == pytest.approx(7.5, abs=0.05)       # 7.49
    assert t.grads / GiB == pytest.approx(14.9, abs=0.1)         # 14.97
    assert t.optimizer / GiB == pytest.approx(42.7, abs=0.05)    # 42.71
    assert t.static / GiB == pytest.approx(65, abs=0.5)          # 65.16
    assert (t.weights + t.grads) / GiB == pytest.approx(22, abs=0.5)  # optimizer offloaded: 22.46


def test_16_gpus_edp2_halves_the_expert_optimizer():
    t = _plan(["trainer.nodes=2"]).trainer
    assert (t.layout.world_size, t.layout.dp, t.layout.edp) == (16, 4, 2)
    assert (t.dense_params, t.expert_params) == (DENSE_GPU, EXPERT_GPU)  # the same shards, replicated
    assert t.optimizer_distributed == 12 * (DENSE_GPU // 4 + EXPERT_GPU // 2)
    assert t.static / GiB == pytest.approx(44, abs=0.5)          # 43.81


def test_activation_formula():
    """T = 8192 tokens, t = T / TP = 2048 per rank; per layer 2t(2H + (2*4096 + 2*512)/TP) +
    2t*2H + 4tE + 2tk(H + 3I); logits 10 T V_pad / TP (moe_async/plan/memory.py)."""
    t = _plan(["trainer.max_tokens_per_micro_batch=8192"]).trainer
    tok, h = 2048, 2048
    layer = 2 * tok * (2 * h + 9216 / 4) + 2 * tok * 2 * h + 4 * tok * 128 + 2 * tok * 8 * (h + 3 * 768)
    assert t.tokens_per_micro_batch == 8192
    assert t.activations == int(48 * layer + 10 * 8192 * 152_064 / 4)  # 12,073,304,064 B = 11.24 GiB


def test_engine_and_weight_sync():
    p = _plan(["engine.tensor_parallel_size=8", "engine.expert_parallel_size=8", "engine.num_engines=1"])
    # TP8 > 4 KV heads: SGLang keeps one KV head per rank -> 48 layers x (k, v) x 128 x bf16
    assert p.engine.kv_bytes_per_token == 48 * 2 * 128 * 2
    assert p.sync.bytes == 2 * TOTAL
    assert p.sync.seconds == pytest.approx(2 * TOTAL / 50e9)     # 1.22 s at 50 GB/s
    p4 = _plan(["engine.tensor_parallel_size=4", "engine.expert_parallel_size=4"])
    per_layer = (18_874_368 - 2 * 1_048_576 + 603_979_776) // 4 + 2 * 1_048_576 // 4 + 4_352 + 262_144
    assert p4.engine.weights == 2 * (151_936 * 2048 * 2 // 4 + 48 * per_layer + 2048)  # 14.24 GiB
    assert p4.engine.kv_pool == int(0.85 * 79.6 * GiB) - p4.engine.weights


def test_weight_sync_bytes_per_sender():
    """weight_sync.senders: all at TP4 EP8 on 8 ranks: Megatron lays EP over the TP x DP ranks,
    so 8 senders, not TP x EP: every rank sends its 16 experts; the TP-split tensors (attention
    48 x 18,874,368 + embedding and lm_head 622,329,856, each sent whole) and the replicated
    norms are spread over both data-parallel replicas (ranks 0-3 and 4-7): the bytes per sender
    differ by less than the largest of them."""
    one = _plan([]).sync
    assert one.sender_bytes == () and one.sender_seconds == one.seconds
    p = _plan(["weight_sync.senders=all"]).sync
    expert, split, held = 28_991_029_248 // 8, 48 * 18_874_368 + 622_329_856, 48 * (4_352 + 262_144) + 2048
    assert len(p.sender_bytes) == 8  # never more senders than trainer ranks (TP x EP = 32 was counted)
    assert sum(p.sender_bytes) == 2 * (8 * expert + split + held)
    assert min(p.sender_bytes) >= 2 * expert  # each rank its own experts
    assert sum(p.sender_bytes[4:]) > 4 * 2 * expert  # DP rank 1 shares the dense tensors (it sent experts only)
    assert max(p.sender_bytes) - min(p.sender_bytes) <= 2 * 311_164_928  # the largest split tensor
    assert sum(p.sender_bytes) == p.bytes == 2 * TOTAL  # every byte sent once
    assert p.seconds == pytest.approx(2 * TOTAL / 50e9)  # every engine rank still receives every byte
    assert p.sender_seconds == pytest.approx(max(p.sender_bytes) / 50e9)


@pytest.mark.parametrize("tp, ep, etp, pp, world", [(4, 8, 1, 1, 8), (2, 2, 1, 2, 8), (2, 4, 2, 1, 8)])
def test_sender_ranks_follow_megatrons_rank_grids(tp, ep, etp, pp, world):
    """The holders the plan gives ``assign_senders`` are Megatron-Core's own groups
    (``RankGenerator``, order tp-cp-ep-dp-pp): dense TP-split tensors on whole TP groups, one
    per data-parallel rank of the stage (the replicas share the sending); each expert on whole
    expert-TP groups, one per expert data-parallel rank; the norms on every rank of the stage."""
    from megatron.core.parallel_state import RankGenerator

    from moe_async.plan.memory import sender_meta

    cfg = load_config(CONFIG, [*C25, f"trainer.devices_per_node={world}", f"trainer.tensor_model_parallel_size={tp}",
                               f"trainer.expert_model_parallel_size={ep}", f"trainer.expert_tensor_parallel_size={etp}",
                               f"trainer.pipeline_model_parallel_size={pp}"])
    lay = cfg.trainer.layout
    dense = RankGenerator(tp=tp, ep=1, dp=lay.dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=lay.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    stage_of = {r: st for g in dense.get_ranks("pp") for st, r in enumerate(g)}
    tp_groups = [frozenset(g) for g in dense.get_ranks("tp")]
    etp_groups = [frozenset(g) for g in expert.get_ranks("tp")]
    ep_of = {r: k for g in expert.get_ranks("ep") for k, r in enumerate(g)}
    meta = sender_meta(_plan().shape, cfg, "bfloat16")
    holders: dict[str, set[int]] = {}
    for r, rank_meta in enumerate(meta):
        for name, *_ in rank_meta:
            holders.setdefault(name, set()).add(r)
    for name, rs in holders.items():
        stage = {stage_of[r] for r in rs}
        assert len(stage) == 1, (name, rs)
        in_stage = {r for r in range(world) if stage_of[r] in stage}
        if ".expert" in name:  # whole ETP groups, one per expert-DP rank, all of one EP rank
            groups = [g for g in etp_groups if g <= rs]
            assert set().union(*groups) == rs and len(groups) == lay.edp, (name, rs)
            assert len({ep_of[r] for r in rs}) == 1
        elif "replicated" in name or name == "final_norm":
            assert rs == in_stage
        else:  # whole TP groups, one per DP rank: every rank of the stage
            groups = [g for g in tp_groups if g <= rs]
            assert set().union(*groups) == rs == in_stage and len(groups) == lay.dp, (name, rs)
    experts_per_rank = [sum(".expert" in m[0] for m in rank_meta) for rank_meta in meta]
    assert sum(experts_per_rank) == 48 * 128 * etp * lay.edp and max(experts_per_rank) == 48 // pp * 128 // ep
    assert {stage_of[r] for r in holders["embedding"]} == {0}
    assert {stage_of[r] for r in holders["output_layer"] | holders["final_norm"]} == {pp - 1}


def test_plan_refuses_what_exceeds_the_device(capsys):
    # 8 H100: 65 GiB static + 22.5 GiB of activations at 16384 tokens + 2 GiB of sync buckets
    # (1 GiB, overlapped) > 75.6 GiB usable
    assert main(["plan", str(CONFIG), *C25]) == 3
    cap = capsys.readouterr()
    assert "<- configured" in cap.out and "DOES NOT FIT" in cap.out
    assert "moe-async: does not fit: trainer: 89.7 GiB per GPU exceed the 75.6 GiB usable" in cap.err
    assert "cluster.gpu_memory_gib - cluster.reserved_gib" in cap.err and "optimizer_cpu_offload=true" in cap.err
    # the same on H200s fits (exit 0), and the shipped 8-GPU layout (slime's: offload + recompute) fits an H100
    assert main(["plan", str(CONFIG), *C25, "cluster.gpu_memory_gib=140.4"]) == 0
    assert main(["plan", str(CONFIG)]) == 0


def test_shipped_layout_is_slimes_and_recompute_offload_imbalance_are_counted(capsys):
    """The shipped Qwen3-30B-A3B plan: 8 trainer GPUs at TP4 EP8 with the optimizer offloaded and
    full recompute (slime's run-qwen3-30B-A3B.sh). Full uniform-1 recompute keeps each layer's
    bf16 input 2 t H per micro-batch plus one layer's activations during its recompute; the
    offloaded optimizer leaves the GPU (its state per node in host memory); the routed experts'
    activations double at moe_imbalance 2."""
    p = make_plan(load_config(CONFIG), family_check=False)
    t = p.trainer
    assert (t.layout.world_size, t.layout.tp, t.layout.ep, t.layout.edp) == (8, 4, 8, 1)
    assert t.offload_fraction == 1.0 and t.optimizer == 0
    assert t.host_optimizer_per_node == t.optimizer_distributed * 8
    tok, h = 16384 / 4, 2048
    layer2 = (2 * tok * (2 * h + 9216 / 4) + 2 * tok * 2 * h + 4 * tok * 128
              + 2 * tok * 8 * (h + 2 * 768) * 2 + 2 * tok * 8 * 768 * 2)  # experts' part x2
    logits = 10 * 16384 * 152_064 / 4
    assert t.activations == int(48 * 2 * tok * h + layer2 + logits)
    assert t.activations_no_recompute == int(48 * layer2 + logits)
    assert t.sync_buckets == 2 * 2**30
    assert t.total <= 0.85 * t.usable  # headroom >= 15% at moe_imbalance 2
    assert main(["plan", str(CONFIG)]) == 0
    out = capsys.readouterr().out
    for row in ("full recompute, uniform 1 layer(s)", "x2 (cluster.moe_imbalance", "100% offloaded to CPU",
                "<- configured, headroom", "sync buckets on a sending rank", "pipeline stages: 48 layers"):
        assert row in out, row


def test_fits_only_balanced_is_a_warning(capsys):
    """Without recompute at 8192 tokens the 16-GPU layout fits at balanced routing but not at 2x
    hot experts: a warning naming cluster.moe_imbalance, not a refusal."""
    args = ["plan", str(CONFIG), "trainer.nodes=2", "trainer.optimizer_cpu_offload=false",
            "trainer.recompute_granularity=null", "trainer.recompute_method=null", "trainer.recompute_num_layers=null"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warning: trainer:" in out and "only with balanced routing (moe_imbalance 1)" in out
