"""Start-up checks of a run's model layout and context against the model, before any process.

:func:`refuse_layout_before_run_dir` applies plan's model rules to the HF config known before
the model is made (no run dir yet); :func:`made_model_checks` applies what needs the made model
(its ``config.json`` and tokenizer): prompt room, layout, the teacher's top-k, a chat template
where prompts are rendered through it, the chat template showing the agent's tools. Both raise
:class:`~moe_async.errors.UserInputError` naming the model and the broken rule."""

from __future__ import annotations

from moe_async.config import ExperimentConfig
from moe_async.errors import UserInputError
from moe_async.orchestration.lifecycle import refuse_prompt_room


def refuse_layout_before_run_dir(cfg: ExperimentConfig) -> bool:
    """Plan's model rules (heads, KV groups, experts, layers by the parallel sizes) on the
    model's HF config as known before the model is made or the run dir exists
    (:func:`~moe_async.models.prepare.configured_hf_config`: ``hf``'s ``config.json``, a made
    source's cached one, ``random_moe``'s from its sizes). Returns True when they were checked,
    False when the config cannot be known yet (``smollm2_upcycled`` not made: checked after
    preparation). Raises UserInputError naming every broken rule."""
    from moe_async.models.prepare import configured_hf_config
    from moe_async.plan.report import hf_config_layout_errors

    hf_config = configured_hf_config(cfg.model)
    if hf_config is None:
        return False
    where = cfg.model.hf_path if cfg.model.source == "hf" else f"model.source={cfg.model.source}"
    if errs := hf_config_layout_errors(cfg, hf_config, str(where)):
        raise UserInputError(f"layout does not fit the model {where}: " + "; ".join(errs))
    _refuse_lora_matching_nothing(cfg, hf_config, str(where))
    return True


def _refuse_lora_matching_nothing(cfg: ExperimentConfig, hf_config: dict | None, where: str) -> None:
    """UserInputError when ``trainer.lora`` adapts no linear of the model (plan's
    :func:`~moe_async.plan.report.lora_match_error`)."""
    from moe_async.plan.report import lora_match_error

    if hf_config is not None and (why := lora_match_error(cfg, hf_config, where)):
        raise UserInputError(why)


def made_model_checks(cfg: ExperimentConfig, model_path: str, room_checked: bool, layout_checked: bool) -> None:
    """What needs the made model (its config.json, tokenizer): before any Ray process.
    Raises UserInputError naming the model and the rule."""
    from moe_async.agent.start_up import check_template_shows_tools
    from moe_async.plan.report import model_layout_errors

    if not room_checked:  # data.max_prompt_length against the model's context
        refuse_prompt_room(cfg, model_path)
    if not layout_checked and (errs := model_layout_errors(cfg, model_path)):
        raise UserInputError(f"layout does not fit the model {model_path}: " + "; ".join(errs))
    if not layout_checked and cfg.trainer.lora is not None:
        from moe_async.models.prepare import configured_hf_config

        _refuse_lora_matching_nothing(cfg, configured_hf_config(cfg.model), model_path)
    if cfg.teacher.enabled:  # teacher.top_k against the vocabulary
        from moe_async.orchestration.teacher_pool import check_teacher_top_k

        check_teacher_top_k(cfg, model_path)
    # prompts are rendered through the tokenizer's chat template unless files give raw strings;
    # the models made here (random_moe, smollm2_upcycled) carry a ChatML template by construction,
    # so only a user's checkpoint (source=hf) pays for loading its tokenizer at start-up
    templated = cfg.rollout.agent.enabled or not cfg.data.enabled or cfg.data.apply_chat_template
    tools = cfg.rollout.agent.enabled and bool(cfg.rollout.agent.tools)
    if templated and (cfg.model.source == "hf" or tools):
        from moe_async.models.prepare import load_tokenizer

        tok = load_tokenizer(model_path)
        if not getattr(tok, "chat_template", None):
            raise UserInputError(f"model {model_path}: its tokenizer has no chat template (tokenizer_config.json's "
                                 "chat_template or chat_template.jinja), and every prompt is rendered through it; add one"
                                 + (", or give string prompts with data.apply_chat_template=false"
                                    if cfg.data.enabled and not cfg.rollout.agent.enabled else ""))
        if tools:  # the model's chat template shows the tools
            check_template_shows_tools(cfg.rollout.agent, tok, model_path)
