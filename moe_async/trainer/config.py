"""Trainer section of an experiment config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, StrictInt, field_validator, model_validator

from moe_async.config_base import ConfigModel
from moe_async.lora.config import LoraConfig

if TYPE_CHECKING:
    from moe_async.layout import ParallelLayout

# The off-policy corrections of trainer/loss.py (formulas and sources there).
OffPolicyCorrection = Literal["none", "tis", "tis_seq", "mis", "mis_seq", "icepop", "opsm", "decoupled_ppo"]


class TrainerConfig(ConfigModel):
    """Megatron-Core trainer: parallel layout, optimizer, GRPO loss.

    The policy loss is GRPO's clipped surrogate (Shao et al., 2024, DeepSeekMath) with
    asymmetric clipping (DAPO, Yu et al., 2025) and a truncated importance weight
    ``min(exp(logp_old - logp_rollout), tis_cap)`` per token against the rollout logprobs
    (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL").
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # layout sizes are StrictInt: YAML ``true`` or ``2.0`` is an error naming the field, not 1 / 2
    tensor_model_parallel_size: StrictInt = Field(1, ge=1, description="TP size.")
    pipeline_model_parallel_size: StrictInt = Field(1, ge=1, description="PP size.")
    expert_model_parallel_size: StrictInt = Field(1, ge=1, description="EP size.")
    expert_tensor_parallel_size: StrictInt = Field(
        1,
        ge=1,
        description=(
            "ETP size (Megatron-Core expert tensor parallelism): each expert's FFN weights split "
            "over ETP ranks (fc1 by output, fc2 by input columns), independent of TP for the dense "
            "layers. Megatron's rules, checked when the trainer starts: ETP divides the expert FFN "
            "size, and ETP x EP divides TP x CP x DP (the world size / PP). Default 1 (Megatron-Core's "
            "own default would be TP)."
        ),
    )
    # --- trainer resources: the world of ranks (one Megatron rank per device) ---
    nodes: StrictInt = Field(1, ge=1, description="Nodes the trainer's ranks span (node order = rank order).")
    devices_per_node: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "Trainer ranks per node: GPUs on a cluster (one device per rank), processes on a CPU. "
            "None: world_size / nodes."
        ),
    )
    world_size: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "Trainer ranks in all. None: nodes x devices_per_node when devices_per_node is set, else the "
            "smallest world the layout fits, lcm(TP x CP x PP, ETP x EP x PP) (1 for the one-process default). "
            "DP = world / (TP x CP x PP) and EDP = world / (ETP x EP x PP) (Megatron's rule, moe_async/layout.py)."
        ),
    )
    context_parallel_size: StrictInt = Field(
        1,
        ge=1,
        description=(
            "CP size (Megatron-Core context parallelism: each sequence padded to a multiple of "
            "2 x CP (x TP with sequence parallelism) and split into 2 x CP chunks, rank r keeping "
            "chunks r and 2 x CP - 1 - r; attention over the CP group). With CUDA it needs "
            "Transformer Engine (TE's CP attention; Megatron-Core 0.16.1's local attention asserts "
            "context_parallel_size == 1); without CUDA moe_async.compat.cp_attention provides it. "
            "Not with router_replay R2 or virtual pipeline stages."
        ),
    )
    virtual_pipeline_model_parallel_size: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "Virtual pipeline stages (model chunks) per PP rank: Megatron-Core's interleaved 1F1B "
            "schedule. None/1: one chunk per PP rank. > 1 needs pipeline_model_parallel_size > 1 "
            "(Megatron's parallel_state refuses it otherwise) and a layer count divisible by "
            "PP x VPP (checked when the model is built); each PP rank holds layers "
            "[(v*PP + p) * L/(PP*VPP), ...) in chunk v."
        ),
    )
    use_distributed_optimizer: bool = Field(
        False,
        description=(
            "Megatron's distributed optimizer: Adam state and fp32 main params sharded over the "
            "data-parallel group (grads reduce-scattered, params all-gathered). Its checkpoints "
            "resume only with this option on; saved in Megatron's 'dp_reshardable' format they "
            "resume at any DP size but only at the saving TP/PP/EP/ETP/VPP/CP, with "
            "dist_ckpt_optim_fully_reshardable at any layout."
        ),
    )
    dist_ckpt_optim_fully_reshardable: bool = Field(
        False,
        description=(
            "With use_distributed_optimizer: save the optimizer state in Megatron's "
            "'fully_reshardable' format (Megatron-LM's --dist-ckpt-optim-fully-reshardable): "
            "gathered over the DP group and stored per parameter, like the plain optimizer's, so "
            "the checkpoint resumes at any TP/PP/EP/ETP/VPP/CP/DP. Off (Megatron-LM's default): "
            "'dp_reshardable', each rank writes its own shard without gathering (less memory and "
            "time at save), resumable at another DP size only. Loading reads either format, "
            "whatever this option says."
        ),
    )
    lr: float = Field(1e-6, gt=0, description="Adam learning rate.")
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = Field(1.0, gt=0, description="Global grad-norm clip.")
    micro_batch_size: StrictInt = Field(4, ge=1, description="Sequences per micro-batch (the most, with max_tokens_per_micro_batch).")
    max_tokens_per_micro_batch: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "Dynamic micro-batch size (verl's ppo_max_token_len_per_gpu, slime's --max-tokens-per-gpu): "
            "a micro-batch holds consecutive sequences while B x S (padded positions, S >= 64) stays "
            "within this many tokens, at most micro_batch_size of them; a longer sequence goes alone. "
            "None: micro_batch_size sequences each. The loss is a per-token mean over the global "
            "batch, so the cut does not change it. With sequence_packing='thd' the budget counts the packed "
            "row's T (real tokens) instead of B x S. At PP > 1 padded micro-batches share one shape per "
            "step (S the batch's longest, B the step's largest cut; the rows past a micro-batch's own "
            "sequences are zero-weight fillers); with virtual pipeline stages only with sequence_packing='thd'."
        ),
    )
    sequence_packing: Literal["auto", "thd", "padded"] = Field(
        "auto",
        description=(
            "How a micro-batch's variable-length sequences reach the model. 'thd': packed back to "
            "back into ONE row [1, T] without padding between them (Megatron-Core's packed sequences: "
            "PackedSeqParams with qkv_format='thd', cu_seqlens, positions restarting at 0 per sequence; "
            "attention within each sequence only), T = their token count rounded up to a multiple of TP "
            "(at least 64); with PP > 1 each micro-batch keeps its T (Megatron's variable_seq_lengths; with "
            "virtual pipeline stages the batch's largest T); max_tokens_per_micro_batch then counts T, "
            "the real tokens. With CUDA it needs Transformer Engine (TE's THD attention; Megatron-Core "
            "0.16.1's local attention refuses packed_seq_params); without CUDA moe_async.compat."
            "thd_attention provides it. Not with context_parallel_size > 1. 'padded': each sequence a row "
            "[B, S] right-padded to the longest (at least 64), dense causal mask. 'auto': 'thd' with CUDA "
            "and Transformer Engine (and CP 1), else 'padded'. On CPU set 'thd' for variable-length "
            "rollouts (measurements: docs/trainer.md)."
        ),
    )
    make_vocab_size_divisible_by: int = Field(
        128,
        ge=1,
        description=(
            "Megatron's vocab-parallel embedding/output layer get V rounded up to a multiple of "
            "this x TP (zero rows, masked out of the softmax, dropped again on export)."
        ),
    )
    params_dtype: Literal["fp32", "bf16"] = "fp32"
    eps_clip: float = Field(0.2, gt=0, description="PPO clip, lower side (1 - eps).")
    eps_clip_high: float = Field(0.28, gt=0, description="PPO clip, upper side (1 + eps).")
    off_policy_correction: OffPolicyCorrection = Field(
        "tis",
        description=(
            "Treatment of off-policy / rollout-trainer mismatch, one loss (trainer/loss.py): "
            "'tis' truncated IS per token min(exp(logp_old - logp_rollout), tis_cap) (Yao et al. "
            "2025); 'tis_seq' the same with the per-sequence geometric-mean ratio; 'mis' / "
            "'mis_seq' masked IS: tokens / sequences whose ratio leaves [mis_low, mis_high] are "
            "rejected (Liu, Yao et al. 2025); 'icepop' tokens whose ratio leaves "
            "[1/icepop_beta, icepop_beta] get zero gradient (Ring-1T, Ling team 2025); 'opsm' "
            "token TIS plus masking negative-advantage sequences whose KL(rollout||train) "
            "estimate exceeds opsm_delta (DeepSeek-V3.2 report); 'decoupled_ppo' PPO ratio to "
            "a proximal policy recomputed with the weights before the update, times the "
            "truncated behaviour weight (Hilton et al. 2022; AReaL); 'none' only for on-policy "
            "(async.mode='sync')."
        ),
    )
    tis_cap: float = Field(
        2.0, gt=0, description="Cap C of the truncated importance weight (tis, tis_seq, opsm, decoupled_ppo)."
    )
    mis_low: float = Field(0.5, ge=0, description="Lower bound of the ratio band kept by mis / mis_seq.")
    mis_high: float = Field(2.0, gt=0, description="Upper bound of the ratio band kept by mis / mis_seq.")
    icepop_beta: float = Field(
        2.0, gt=1, description="IcePop band: token ratios outside [1/beta, beta] get zero gradient."
    )
    opsm_delta: float = Field(
        1e-4, ge=0, description="OPSM threshold delta, nats per token, on the sequence KL(rollout||train)."
    )
    moe_aux_loss_coeff: float = Field(1e-3, ge=0, description="Load-balancing aux loss weight.")
    moe_router_bias_update_rate: float = Field(
        0.0,
        ge=0,
        description=(
            "Aux-loss-free load balancing (DeepSeek-V3; Wang et al. 2024, arXiv:2408.15664): after "
            "each optimizer step every MoE router's fp32 expert bias (HF e_score_correction_bias) "
            "moves by +rate for experts given fewer than the mean number of tokens in the global "
            "batch and by -rate for those given more (Megatron-Core's get_updated_expert_bias, "
            "counts all-reduced over TP x CP x DP). 0 keeps the bias as loaded. Only for models "
            "whose router has an expert bias (deepseek_v3); others are refused."
        ),
    )
    num_threads: int = Field(1, ge=1, description="torch threads in the trainer process.")
    cpu_affinity: list[StrictInt] | None = Field(
        None,
        description="Core ids the trainer process is pinned to (os.sched_setaffinity, Linux); None = no pinning.",
    )
    # --- router replay (moe_async/replay) ---
    router_replay: Literal["off", "R3", "R2"] = Field(
        "off",
        description=(
            "MoE routing replay through Megatron's RouterReplay: 'R3' forces the engine's "
            "routed experts (rollout.return_routed_experts) on the trainer's routers, 'R2' the "
            "routes of the trainer's own old-policy forward; gate weights always come from the "
            "trainer's router scores. Agreement/mismatch metrics are reported in every mode."
        ),
    )
    # --- memory and MoE-kernel features: Megatron-Core's own, under Megatron's names ---
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None,
        description=(
            "Activation recompute (Megatron-Core's TransformerConfig.recompute_granularity): 'full' "
            "keeps only each recomputed layer's input and runs its forward again in the backward "
            "(recompute_method / recompute_num_layers choose the layers); 'selective' recomputes only "
            "the submodules in recompute_modules. None: no recompute. Gradients are unchanged."
        ),
    )
    recompute_method: Literal["uniform", "block"] | None = Field(
        None,
        description=(
            "With recompute_granularity='full' (required there): 'uniform' splits each pipeline stage's "
            "layers into groups of recompute_num_layers and keeps only each group's input; 'block' "
            "recomputes the first recompute_num_layers layers of each stage and keeps the rest."
        ),
    )
    recompute_num_layers: StrictInt | None = Field(
        None,
        ge=1,
        description="Layers per recompute group ('uniform') or recomputed layers per stage ('block'); "
                    "required with recompute_granularity='full'.",
    )
    recompute_modules: list[Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                    "shared_experts"]] | None = Field(
        None,
        description=(
            "With recompute_granularity='selective': the submodules recomputed (Megatron-Core's names: "
            "core_attn, moe_act, layernorm, mla_up_proj (MLA models), mlp, moe, shared_experts). None: "
            "Megatron's default ['core_attn']."
        ),
    )
    optimizer_cpu_offload: bool = Field(
        False,
        description=(
            "Megatron-Core's HybridDeviceOptimizer (slime's --optimizer-cpu-offload): the fp32 main "
            "params and Adam state of optimizer_offload_fraction of the parameters live in host memory "
            "and are stepped there by torch's CPU Adam; the gradients go to the host and the updated "
            "params come back each step. Needs use_distributed_optimizer (Megatron-Core's rule)."
        ),
    )
    optimizer_offload_fraction: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Fraction of the optimizer state (by parameter count) offloaded with optimizer_cpu_offload.",
    )
    moe_grouped_gemm: bool = Field(
        False,
        description=(
            "Grouped expert MLP (Megatron-Core's moe_grouped_gemm): the local experts of a rank run as one "
            "grouped GEMM: Transformer Engine's TEGroupedMLP where TE is installed, else Megatron-Core's legacy "
            "GroupedMLP (the grouped_gemm package on a GPU; without CUDA the CPU grouped GEMM of "
            "moe_async.compat); a CUDA host with neither is refused naming this field. Checkpoints (weights, "
            "the plain optimizer's state) and the HF export are the sequential expert MLP's; the distributed "
            "optimizer's state resumes only into the saving layout. False: the sequential expert MLP."
        ),
    )
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = Field(
        "alltoall",
        description=(
            "Megatron-Core's MoE token dispatcher: 'alltoall' (tokens sent to their experts' EP ranks), "
            "'allgather' (every EP rank gathers all tokens), 'flex' (DeepEP's fused dispatch/combine; "
            "needs CUDA and the deep_ep package, refused with a clear error otherwise)."
        ),
    )
    moe_expert_capacity_factor: float | None = Field(
        None,
        gt=0,
        description=(
            "Expert capacity = factor x tokens x top_k / experts per micro-batch (Megatron-Core's "
            "token-drop mode; tokens over capacity are dropped by moe_token_drop_policy). None: no "
            "capacity, no token dropped. Not with router_replay (the replayed routes would be cut)."
        ),
    )
    moe_pad_expert_input_to_capacity: bool = Field(
        False,
        description="With moe_expert_capacity_factor: pad every expert's input to its capacity (static shapes).",
    )
    moe_token_drop_policy: Literal["probs", "position"] = Field(
        "probs",
        description="With moe_expert_capacity_factor: drop the tokens of lowest router probability ('probs') "
                    "or the latest in the sequence ('position').",
    )
    num_layers_in_first_pipeline_stage: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "Uneven pipeline stages (Megatron-Core's field; slime's --decoder-first-pipeline-num-layers): "
            "layers on the first PP stage; the other stages share the rest evenly. None: even split. "
            "Needs pipeline_model_parallel_size > 1, no virtual pipeline stages."
        ),
    )
    num_layers_in_last_pipeline_stage: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "Layers on the last PP stage (slime's --decoder-last-pipeline-num-layers); the middle stages "
            "share the rest evenly. None: even split."
        ),
    )
    seed: int = 1234
    lora: LoraConfig | None = Field(None, description=(
        "LoRA adapters (rank, alpha, dropout, PEFT target_modules, routed experts per_expert|shared|off): "
        "the base frozen, the optimizer over adapter parameters only; None trains every parameter."))
    # --- checkpoints (driver: moe_async/orchestration/driver.py) ---
    save_interval: int = Field(
        0,
        ge=0,
        description=(
            "Save a torch_dist checkpoint (model, optimizer, RNG, step, prompt position) every this "
            "many steps and after the last step; 0 = never. Written to <save_dir>/step_<N> via a "
            "temporary name and a rename, then <save_dir>/latest names it."
        ),
    )
    save_dir: str | None = Field(
        None, description="Directory of the step_<N> checkpoints; None = <run dir>/checkpoints."
    )
    load: str | None = Field(
        None,
        description=(
            "Checkpoint to resume from: a step_<N> directory, or a save_dir holding a 'latest' "
            "file. The run continues at step N+1 and stops at num_steps, which counts steps in "
            "total, as slime's --num-rollout and verl's total_training_steps do. Checked before "
            "any process starts."
        ),
    )
    resume: Literal["never", "auto"] = Field(
        "never",
        description=(
            "'auto': resume from the run's own latest checkpoint when one exists (a requeued job: "
            "same MOE_ASYNC_RUN_ID, set by launch/slurm/train.sbatch), else from trainer.load, else "
            "start; 'never': only trainer.load. A save_dir holding another run's checkpoints is "
            "refused either way."
        ),
    )

    @field_validator("cpu_affinity")
    @classmethod
    def _check_affinity(cls, v: list[int] | None) -> list[int] | None:
        from moe_async.affinity import validate_core_list

        return validate_core_list(v)

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.eps_clip >= 1:
            raise ValueError("trainer.eps_clip must be < 1")
        if self.mis_low >= self.mis_high:
            raise ValueError(f"trainer.mis_low ({self.mis_low}) must be < trainer.mis_high ({self.mis_high})")
        if (self.virtual_pipeline_model_parallel_size or 1) > 1 and self.pipeline_model_parallel_size < 2:
            raise ValueError(
                f"trainer.virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} needs "
                f"trainer.pipeline_model_parallel_size > 1 (got {self.pipeline_model_parallel_size}): Megatron-Core's "
                "interleaved schedule splits each pipeline rank's layers into virtual stages (parallel_state: "
                "'pipeline-model-parallel size should be greater than 1 with interleaved schedule')"
            )
        self.layout  # world size, DP and EDP by Megatron's rule (LayoutError names the fields)
        if self.devices_per_node is not None and self.world_size is not None \
                and self.world_size != self.nodes * self.devices_per_node:
            raise ValueError(
                f"trainer.world_size={self.world_size} differs from trainer.nodes={self.nodes} x "
                f"trainer.devices_per_node={self.devices_per_node} = {self.nodes * self.devices_per_node}; "
                "set one of them")
        if self.resolved_world_size % self.nodes:
            raise ValueError(
                f"trainer.world_size={self.resolved_world_size} is not divisible by trainer.nodes={self.nodes} "
                "(every node holds the same number of ranks)")
        # refused here already (not only by MegatronTrainer at init) so that `moe-async show-config`
        # and train name it before any process starts
        if (why := unsupported_combination(self)) is not None:
            raise ValueError(why)
        if self.dist_ckpt_optim_fully_reshardable and not self.use_distributed_optimizer:
            raise ValueError(
                "trainer.dist_ckpt_optim_fully_reshardable=true needs trainer.use_distributed_optimizer=true "
                "(it chooses the distributed optimizer's checkpoint format; the plain optimizer's state "
                "already loads at any layout)"
            )
        if self.sequence_packing == "thd" and self.context_parallel_size > 1:
            raise ValueError(
                f"trainer.sequence_packing='thd' with trainer.context_parallel_size={self.context_parallel_size}: "
                "not supported (Megatron-Core's THD context-parallel split needs Transformer Engine's "
                "thd_get_partitioned_indices, and the CPU CP attention takes no packed sequences); use "
                "sequence_packing='padded' with CP"
            )
        if self.sequence_packing == "thd" and _cuda_available() and not _have_transformer_engine():
            raise ValueError(
                "trainer.sequence_packing='thd' with CUDA needs Transformer Engine (not importable here): "
                "Megatron-Core's local attention (transformer/dot_product_attention.py) asserts "
                "'Packed sequence is not supported by DotProductAttention'; use sequence_packing='padded' "
                "or 'auto'"
            )
        if (self.max_tokens_per_micro_batch is not None and (self.virtual_pipeline_model_parallel_size or 1) > 1
                and self.sequence_packing != "thd"):
            raise ValueError(
                f"trainer.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} with "
                f"trainer.virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} needs "
                "sequence_packing='thd' (padded micro-batches cut by a budget are not run with virtual pipeline "
                "stages; at PP > 1 without them every micro-batch of a step gets one padded [B, S] shape)"
            )
        if (why := memory_feature_refusal(self)) is not None:
            raise ValueError(why)
        if (why := lora_refusal(self)) is not None:
            raise ValueError(why)
        if self.context_parallel_size > 1 and _cuda_available() and not _have_transformer_engine():
            raise ValueError(
                f"trainer.context_parallel_size={self.context_parallel_size} with CUDA needs Transformer Engine "
                "(not importable here): Megatron-Core's local attention (transformer/"
                "dot_product_attention.py) asserts 'Context parallelism is only supported by "
                "TEDotProductAttention' (the CPU path has its own CP attention, moe_async.compat.cp_attention)"
            )
        return self

    @property
    def resolved_world_size(self) -> int:
        """The trainer's ranks: ``world_size``, else ``nodes x devices_per_node``, else the
        smallest world the layout fits (lcm of the dense and expert grids' model-parallel part)."""
        import math

        if self.world_size is not None:
            return self.world_size
        if self.devices_per_node is not None:
            return self.nodes * self.devices_per_node
        tp, pp, cp, ep = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                          self.context_parallel_size, self.expert_model_parallel_size)
        return math.lcm(tp * cp * pp, self.expert_tensor_parallel_size * ep * pp, self.nodes)

    @property
    def layout(self) -> "ParallelLayout":
        """The checked :class:`~moe_async.layout.ParallelLayout` (DP and EDP derived).

        Raises: :class:`~moe_async.layout.LayoutError` naming the fields and Megatron's rule."""
        from moe_async.layout import resolve_layout

        return resolve_layout(self.resolved_world_size, self.tensor_model_parallel_size,
                              self.pipeline_model_parallel_size, self.context_parallel_size,
                              self.expert_model_parallel_size, self.expert_tensor_parallel_size)


def unsupported_combination(cfg: TrainerConfig) -> str | None:
    """The refusal, naming the fields, of a parallel combination MegatronTrainer does not run,
    or None: router replay R2 with context parallelism (its recording forward is not split over
    CP; R3 runs), with pipeline parallelism or virtual pipeline stages, and virtual
    pipeline stages with CP (not tested together). Raised as ValueError by the TrainerConfig
    validator and as NotImplementedError by MegatronTrainer (a config built without validation)."""
    cp, vpp = cfg.context_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
    if cp > 1 and cfg.router_replay == "R2":
        return (f"trainer.router_replay='R2' with trainer.context_parallel_size={cp}: R2's recording forward "
                "is not split over the context-parallel ranks (R3 and off run)")
    if cp > 1 and vpp > 1:
        return (f"trainer.virtual_pipeline_model_parallel_size with trainer.context_parallel_size={cp}: "
                "not implemented (not tested together)")
    pp = cfg.pipeline_model_parallel_size
    if pp > 1 and vpp == 1 and cfg.router_replay == "R2":
        return (f"trainer.router_replay='R2' with trainer.pipeline_model_parallel_size={pp}: R2's recording "
                "forward is not implemented with pipeline parallelism (R3 and off run)")
    if vpp > 1 and cfg.router_replay == "R2":
        return (f"trainer.router_replay='R2' with trainer.virtual_pipeline_model_parallel_size={vpp}: R2's "
                "recording forward is not implemented with pipeline parallelism (which VPP needs)")
    return None


def memory_feature_refusal(cfg: TrainerConfig) -> str | None:
    """The refusal, naming the fields, of a recompute / optimizer-offload / expert-capacity /
    uneven-pipeline setting Megatron-Core would refuse (its TransformerConfig and
    OptimizerConfig rules, checked here so that the message names ``trainer.*``), or None."""
    g, m, n = cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers
    if g == "full" and (m is None or n is None):
        return ("trainer.recompute_granularity='full' needs trainer.recompute_method ('uniform' or 'block') and "
                "trainer.recompute_num_layers (Megatron-Core's TransformerConfig)")
    if g != "full" and (m is not None or n is not None):
        return (f"trainer.recompute_method / trainer.recompute_num_layers are for recompute_granularity='full' "
                f"(got recompute_granularity={g!r})")
    if cfg.recompute_modules is not None and g != "selective":
        return f"trainer.recompute_modules needs trainer.recompute_granularity='selective' (got {g!r})"
    if "moe_act" in (cfg.recompute_modules or ()) and not cfg.moe_grouped_gemm:
        return ("trainer.recompute_modules with 'moe_act' needs trainer.moe_grouped_gemm=true (Megatron-Core "
                "recomputes the experts' activation only in the grouped expert MLP); use 'moe' to recompute the "
                "whole MoE layer")
    if cfg.optimizer_cpu_offload and not cfg.use_distributed_optimizer:
        return ("trainer.optimizer_cpu_offload=true needs trainer.use_distributed_optimizer=true "
                "(Megatron-Core's HybridDeviceOptimizer runs inside the distributed optimizer)")
    if cfg.moe_expert_capacity_factor is None and cfg.moe_pad_expert_input_to_capacity:
        return "trainer.moe_pad_expert_input_to_capacity=true needs trainer.moe_expert_capacity_factor"
    if cfg.moe_expert_capacity_factor is not None and cfg.router_replay != "off":
        return (f"trainer.moe_expert_capacity_factor with trainer.router_replay={cfg.router_replay!r}: dropping "
                "tokens over capacity would cut the replayed routes (set one of them off)")
    first, last = cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        if cfg.pipeline_model_parallel_size < 2:
            return ("trainer.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage need "
                    f"trainer.pipeline_model_parallel_size > 1 (got {cfg.pipeline_model_parallel_size})")
        if (cfg.virtual_pipeline_model_parallel_size or 1) > 1:
            return ("trainer.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage with "
                    "trainer.virtual_pipeline_model_parallel_size: not supported here")
    return None


def lora_refusal(cfg: TrainerConfig) -> str | None:
    """The refusal, naming the fields, of a ``trainer.lora`` setting the adapters cannot run
    with (checked before any process starts), or None: dropout or the grouped expert MLP or
    ETP > 1 with routed-expert adapters, one ``shared`` expert adapter at EP > 1. The only
    check of these combinations (the adapters' setup does not repeat it)."""
    lo = cfg.lora
    if lo is None:
        return None
    if lo.experts == "off":
        return None
    if lo.dropout > 0:
        return (f"trainer.lora.dropout={lo.dropout} with trainer.lora.experts={lo.experts!r}: PEFT's adapters on "
                "fused expert parameters take no dropout; set dropout 0 or experts 'off'")
    if cfg.moe_grouped_gemm:
        return (f"trainer.lora.experts={lo.experts!r} with trainer.moe_grouped_gemm=true: LoRA adapts the "
                "sequential expert MLP; set moe_grouped_gemm=false or trainer.lora.experts='off'")
    if cfg.expert_tensor_parallel_size > 1:
        return (f"trainer.lora.experts={lo.experts!r} with trainer.expert_tensor_parallel_size="
                f"{cfg.expert_tensor_parallel_size}: not supported; set it to 1 or trainer.lora.experts='off'")
    if lo.experts == "shared" and cfg.expert_model_parallel_size > 1:
        return (f"trainer.lora.experts='shared' with trainer.expert_model_parallel_size="
                f"{cfg.expert_model_parallel_size}: one adapter for all experts needs EP 1 (use 'per_expert': "
                "each expert's adapter lives on its EP rank)")
    return None


def _cuda_available() -> bool:
    """True when torch sees a CUDA device (the GPU path: NCCL + the TE layer spec)."""
    import torch

    return torch.cuda.is_available()


def _have_transformer_engine() -> bool:
    """True when ``transformer_engine`` imports (with CUDA; the TE layer spec is used):
    :func:`moe_async.megatron.parallel.have_te`."""
    from moe_async.megatron.parallel import have_te

    return have_te()


def resolve_sequence_packing(packing: str, context_parallel_size: int = 1) -> str:
    """``trainer.sequence_packing`` as run: 'thd' or 'padded'. 'auto' is 'thd' with CUDA and
    Transformer Engine (TE's fused THD attention, no FLOPs on padding) and no context
    parallelism (refused with thd), else 'padded' (on the CPU path 'thd' gains only where
    there is padding to save: docs/trainer.md).

    Raises:
        ValueError: ``packing`` not 'auto', 'thd' or 'padded'; 'thd' with CUDA but without
            Transformer Engine (naming ``trainer.sequence_packing``)."""
    if packing == "auto":
        gpu_thd = _cuda_available() and _have_transformer_engine() and context_parallel_size == 1
        return "thd" if gpu_thd else "padded"
    if packing not in ("thd", "padded"):
        raise ValueError(f"trainer.sequence_packing must be 'auto', 'thd' or 'padded', got {packing!r}")
    if packing == "thd" and _cuda_available() and not _have_transformer_engine():
        # checked again here, on the host that runs the trainer: the config may have been
        # validated on another one (a CPU-only driver handing it to a CUDA worker)
        raise ValueError("trainer.sequence_packing='thd' with CUDA needs Transformer Engine (not importable on "
                         "this host): Megatron-Core's local attention asserts 'Packed sequence is not supported "
                         "by DotProductAttention'; use sequence_packing='padded' or 'auto'")
    return packing
