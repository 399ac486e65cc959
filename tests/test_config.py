"""Experiment config: YAML + overrides, errors naming the field, cross checks (C11)."""

import re
from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import ConfigError, dump_config, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["cpu_demo.yaml", "cpu_smoke.yaml"])
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    cfg = load_config(CONFIGS / name)
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_overrides_typed():
    cfg = load_config(CONFIGS / "cpu_smoke.yaml", ["trainer.lr=3e-5", "rollout.task_kwargs.max_digits=2", "async.max_staleness=3"])
    assert cfg.trainer.lr == 3e-5 and isinstance(cfg.trainer.lr, float)
    assert cfg.rollout.task_kwargs["max_digits"] == 2
    assert cfg.async_.max_staleness == 3


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["trainer.lrr=1"], "trainer.lrr: unknown key"),
        (["rollout.temperature=-1"], "rollout.temperature"),
        (["engine.backend=vllm"], "engine.backend"),
        (["async.mode=sync", "async.max_staleness=2"], "max_staleness must be 0"),
        (["trainer.off_policy_correction=none"], "off_policy_correction"),  # C11
        (["weight_sync.interval_steps=3", "async.max_staleness=1"], "interval_steps"),
        (["model.top_k=8"], "model.top_k"),
        (["nonsense"], "key.sub=value"),
    ],
)
def test_bad_values_name_the_field(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_config(CONFIGS / "cpu_smoke.yaml", overrides)


def test_sync_mode_without_correction_is_allowed():
    cfg = load_config(CONFIGS / "cpu_smoke.yaml", ["async.mode=sync", "async.max_staleness=0", "trainer.off_policy_correction=none"])
    assert cfg.async_.mode == "sync"


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: YAML error"):
        load_config(bad)
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_cli_reports_config_errors(capsys):
    assert main(["show-config", str(CONFIGS / "cpu_smoke.yaml"), "trainer.bogus=1"]) == 2
    assert "trainer.bogus: unknown key" in capsys.readouterr().err
    assert main(["show-config", str(CONFIGS / "cpu_smoke.yaml")]) == 0


@pytest.mark.parametrize("override, field", [
    ("trainer.lr=.inf", "trainer.lr"),
    ("trainer.tis_cap=.inf", "trainer.tis_cap"),
    ("rollout.reward_timeout_s=.inf", "rollout.reward_timeout_s"),  # C8: the timeout must bound a step
    ("weight_sync.timeout_s=.inf", "weight_sync.timeout_s"),
    ("engine.request_timeout_s=.inf", "engine.request_timeout_s"),
])
def test_infinite_values_rejected(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(CONFIGS / "cpu_smoke.yaml", [override])


@pytest.mark.parametrize("override, needle", [
    ("rollout.task=nonexistent_task", r"rollout\.task='nonexistent_task' is not a reasoning-gym dataset"),
    ("rollout.task_kwargs={bogus: 1}", r"rollout\.task_kwargs=.*bogus"),
])
def test_bad_task_rejected_at_load(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(CONFIGS / "cpu_smoke.yaml", [override])


def test_duplicate_yaml_keys_rejected(tmp_path):
    """PyYAML keeps the last of two equal keys; a config must refuse them, naming key and lines."""
    f = tmp_path / "dup.yaml"
    f.write_text("trainer:\n  lr: 1.0e-5\n  micro_batch_size: 2\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: duplicate key 'lr' at line 4 \(first at line 2\)"):
        load_config(f)
    f.write_text("trainer:\n  lr: 1.0e-5\ntrainer:\n  micro_batch_size: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'trainer' at line 3"):
        load_config(f)
    f.write_text("trainer:\n  lr: 3.0e-4\n")  # the same keys in different sections are fine
    assert load_config(f).trainer.lr == 3.0e-4


def test_random_model_sizes_only_with_random_source():
    """The random_moe size fields neither appear in a dumped upcycled/hf config (they are not
    the run's model) nor are accepted with those sources (they would be ignored)."""
    cfg = load_config(CONFIGS / "cpu_demo.yaml")
    text = dump_config(cfg)
    # the model section only (trainer.recompute_num_layers is another field)
    model = re.split(r"\n(?=\S)", text[text.index("\nmodel:") + 1:])[0]
    assert "num_layers" not in model and "hidden_size" not in text and "init_seed" in text
    assert "num_layers: 2" in dump_config(load_config(CONFIGS / "cpu_smoke.yaml"))
    with pytest.raises(ConfigError, match=r"\n  model.num_layers sets the size of a random_moe model"):
        load_config(CONFIGS / "cpu_demo.yaml", ["model.num_layers=30"])


def test_last_bucket_pause_refused_with_sglang():
    # SGLang applies each bucket as it arrives: pausing only for the last one would serve
    # requests from half-updated weights (C1); the embedded engine stages, so it may.
    with pytest.raises(ConfigError, match="weight_sync.pause_scope"):
        load_config(Path(__file__).parent.parent / "configs" / "cpu_smoke.yaml", ["engine.backend=sglang", "weight_sync.pause_scope=last_bucket"])
    assert load_config(Path(__file__).parent.parent / "configs" / "cpu_smoke.yaml", ["engine.backend=sglang"]).weight_sync.pause_scope == "sync"
    assert load_config(Path(__file__).parent.parent / "configs" / "cpu_smoke.yaml", ["weight_sync.pause_scope=last_bucket"])
    # SGLang's /update_weights_from_tensor applies each call at once too (fresh-user finding)
    with pytest.raises(ConfigError, match="weight_sync.pause_scope"):
        load_config(Path(__file__).parent.parent / "configs" / "cpu_smoke.yaml",
                    ["engine.backend=sglang", "weight_sync.transport=tensor", "weight_sync.pause_scope=last_bucket"])


def test_yaml_merge_keys_still_work(tmp_path):
    # the duplicate-key check must not break YAML anchors with merge keys; an explicit key
    # next to a merge overrides the merged value (YAML merge semantics), not a duplicate
    p = tmp_path / "m.yaml"
    p.write_text("trainer: &t\n  lr: 1.0e-4\n  micro_batch_size: 2\n"
                 "engine:\n  num_threads: 1\nrollout: {prompts_per_step: 2}\n"
                 "logging: {wandb_mode: disabled}\n")
    load_config(p)
    p.write_text("trainer:\n  <<: {lr: 1.0e-4, micro_batch_size: 2}\n  lr: 2.0e-5\n")
    cfg = load_config(p)
    assert cfg.trainer.lr == 2.0e-5 and cfg.trainer.micro_batch_size == 2
    p.write_text("trainer:\n  <<: {lr: 1.0e-4}\n  lr: 2.0e-5\n  lr: 3.0e-5\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr' at line 4"):
        load_config(p)


@pytest.mark.parametrize("ov", ["=3", ".lr=1", "trainer..lr=1", "trainer.=1"])
def test_override_with_empty_key_named(ov):
    with pytest.raises(ConfigError, match="empty key part"):
        load_config(None, [ov])


@pytest.mark.parametrize("field", ["trainer.cpu_affinity", "engine.cpu_affinity"])
def test_cpu_affinity_takes_integers_only(field):
    """YAML ``true`` is not core 1, nor ``"0"`` core 0 (pydantic's lax mode would accept both)."""
    for bad in ("[true]", '["0"]', "[1.0]"):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, [f"{field}={bad}"])
    assert getattr(load_config(None, [f"{field}=[0]"]), field.split(".")[0]).cpu_affinity == [0]


@pytest.mark.parametrize("override,field", [
    ("trainer.lr=true", "lr"), ("num_steps=true", "num_steps"), ("rollout.max_new_tokens=true", "max_new_tokens"),
    ("rollout.eval_concurrency=true", "eval_concurrency"), ("rollout.eval_timeout_s=false", "eval_timeout_s"),
    ("weight_sync.bucket_bytes=true", "bucket_bytes"), ("async.max_staleness=false", "max_staleness"),
    ("engine.num_engines=true", "num_engines"),
])
def test_a_boolean_for_a_number_is_refused_naming_the_field(override, field):
    """YAML's true/false would otherwise become 1/0 in pydantic's lax mode (trainer.lr=true: lr 1.0)."""
    with pytest.raises(ConfigError, match=rf"{field}=(True|False) is a boolean; {field} takes a number"):
        load_config(CONFIGS / "cpu_smoke.yaml", [override])


def test_booleans_still_set_boolean_fields_and_numbers_numbers():
    cfg = load_config(CONFIGS / "cpu_smoke.yaml", ["eval_before=false", "weight_sync.check=true", "trainer.lr=1",
                                                    "rollout.eval_concurrency=3"])
    assert cfg.eval_before is False and cfg.weight_sync.check is True
    assert cfg.trainer.lr == 1.0 and cfg.rollout.eval_concurrency == 3


def test_unknown_agent_tool_is_refused_at_load():
    """An unknown rollout.agent.tools entry: refused naming the field and the known tools (it
    used to fail inside the rollout actor after the engines and trainer had started)."""
    from pathlib import Path

    import pytest

    from moe_async.config import ConfigError, load_config

    smoke = Path(__file__).resolve().parents[1] / "configs" / "cpu_smoke.yaml"
    base = ["rollout.agent.enabled=true", "rollout.agent.env_class=answer_retry"]
    with pytest.raises(ConfigError, match=r"rollout\.agent\.tools: 'nosuchtool' is neither a built-in tool \['calculator'\]"):
        load_config(smoke, base + ['rollout.agent.tools=["nosuchtool"]'])
    assert load_config(smoke, base + ['rollout.agent.tools=["calculator"]']).rollout.agent.tools == ["calculator"]


@pytest.mark.parametrize("text,word", [("yes", "true"), ("off", "false")])
def test_a_yaml_boolean_for_a_word_is_named_as_one(tmp_path, text, word):
    """``trainer.resume=yes`` (override or file): YAML 1.1 reads the unquoted word as a boolean;
    the error names the field and says so, instead of '(got True)'."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"trainer.resume={text}"])
    msg = str(e.value)
    assert "trainer.resume: Input should be 'never' or 'auto'" in msg and "(got True)" not in msg
    assert f"got the boolean {word}: YAML reads unquoted yes/no/on/off/true/false as booleans" in msg
    p = tmp_path / "c.yaml"
    p.write_text(f"trainer:\n  resume: {text}\n")
    with pytest.raises(ConfigError, match=f"trainer.resume: .*got the boolean {word}"):
        load_config(p)
    assert load_config(None, ["trainer.resume='auto'"]).trainer.resume == "auto"
