"""Config loading, overrides and every validation message."""
import json
import os
import subprocess
import sys

import pytest

from hybridrl.config import ConfigError
from hybridrl.config.io import all_keys, load_config, nearest_key
from hybridrl.config.layout import derive_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def _error(overrides, path=""):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_yaml_and_overrides_are_typed_and_frozen():
    cfg = load_config(TINY, ["actor.optim.lr=1e-6", "rollout.n=8", "trainer.logger=[console]"])
    assert cfg.actor.optim.lr == 1e-6 and cfg.rollout.n == 8 and cfg.trainer.logger == ["console"]
    assert cfg.model.hidden_size == 64  # from the YAML
    with pytest.raises(Exception):
        cfg.rollout.n = 2


def test_every_key_has_a_doc():
    import ast
    import inspect

    from hybridrl import config

    tree = ast.parse(inspect.getsource(config))
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")]:
        if cls.name == "Config":
            continue
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{cls.name}.{node.target.id} has no docstring"


@pytest.mark.parametrize("override,bad,nearest", [
    ("actor.optim.lrr=1", "actor.optim.lrr", "actor.optim.lr"),
    ("lr=1", "lr", "actor.optim.lr"),
    ("rollout.temprature=0.5", "rollout.temprature", "rollout.temperature"),
    ("trainer.save_frq=3", "trainer.save_frq", "trainer.save_freq"),
])
def test_unknown_key_names_nearest(override, bad, nearest):
    msg = _error([override])
    assert f"'{bad}'" in msg and f"'{nearest}'" in msg


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  ppo_epoch: 2\n")
    msg = _error([], str(path))
    assert "'actor.ppo_epoch'" in msg and "'actor.ppo_epochs'" in msg


def test_nested_unknown_section_names_full_path():
    msg = _error(["foo.bar=1"])
    assert "'foo.bar'" in msg and "did you mean" in msg
    assert nearest_key("foo.bar") in all_keys()


@pytest.mark.parametrize("override,key,expected", [
    ("actor.optim.lr=abc", "actor.optim.lr", "float"),
    ("rollout.n=many", "rollout.n", "int"),
    ("data.shuffle=maybe", "data.shuffle", "bool"),
])
def test_wrong_type_names_key_and_type(override, key, expected):
    msg = _error([override])
    assert f"'{key}'" in msg and f"expects {expected}" in msg


@pytest.mark.parametrize("override,fragment", [
    ("actor.clip_ratio_c=0.9", "actor.clip_ratio_c must be > 1"),
    ("actor.tau_neg=0", "actor.tau_neg=0.0 (SAPO's gate temperatures) must be > 0"),
    ("algorithm.adv_estimator=gdpo", "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys"),
    ("algorithm.gdpo_reward_keys=[a] algorithm.gdpo_reward_weights=[1,2]", "has 2 weights for 1"),
    ("algorithm.adv_estimator=optimal_token_baseline algorithm.rollout_correction.bypass_mode=true",
     "bypass_mode=true skips: set bypass_mode=false"),
    ("rollout.name=sglang", "rollout.name='sglang' is not one of native, vllm"),
    ("algorithm.adv_estimator=ppo2", "algorithm.adv_estimator='ppo2'"),
    ("data.truncation=middle", "data.truncation='middle'"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.max_num_seqs=0", "rollout.max_num_seqs must be >= 1"),
    ("actor.policy_loss.loss_mode=gpo", "actor.policy_loss.loss_mode='gpo' is not one of vanilla, gspo"),
    ("actor.loss_scale_factor=0", "actor.loss_scale_factor must be > 0"),
    ("rollout.val_kwargs.n=4", "set rollout.val_kwargs.temperature > 0, or n=1"),
    ("trainer.test_freq=-2", "trainer.test_freq must be >= 1, or 0 / -1 (never during training)"),
    ("trainer.log_freq=0", "trainer.log_freq must be >= 1"),
    ("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len must be > 0"),
    ("reward.gsm8k_method=lenient", "'lenient' is not one of strict, flexible, flexible_lenient"),
    ("algorithm.filter_groups.metric=''", "algorithm.filter_groups.metric must name a value"),
    ("algorithm.rollout_correction.rollout_is=seq", "rollout_is='seq' is not one of null, token, sequence"),
    ("algorithm.rollout_correction.rollout_is_threshold=0.5_x", "must be a positive number or 'lower_upper'"),
    ("algorithm.rollout_correction.rollout_rs=seq_max_k1", "unknown option(s) ['seq_max_k1']"),
    ("algorithm.rollout_correction.rollout_rs=token_k3", "needs algorithm.rollout_correction.rollout_rs_threshold"),
    ("algorithm.rollout_correction.loss_type=ppo", "loss_type='ppo' is not one of ppo_clip, reinforce"),
])
def test_section_rules(override, fragment):
    assert fragment in _error(override.split())


@pytest.mark.parametrize("old,new", [("rollout.val_n", "rollout.val_kwargs.n"),
                                     ("rollout.val_temperature", "rollout.val_kwargs.temperature"),
                                     ("actor.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold")])
def test_moved_keys_name_their_verl_replacement(old, new):
    msg = _error([f"{old}=2"])
    assert f"'{old}' is now '{new}" in msg and "rename it" in msg


SPLIT = ["placement.mode=split", "placement.rollout_world_size=1"]


@pytest.mark.parametrize("extra,expect", [
    ([], None),  # synchronous: the engine runs the trained policy, metrics only (verl's default)
    (SPLIT + ["async_training.staleness_threshold=1"], "token"),
    (SPLIT + ["async_training.staleness_threshold=1", "async_training.partial_rollout=true"], "token"),
    (SPLIT + ["async_training.staleness_threshold=1", "algorithm.rollout_correction.rollout_is=null"], None),
    (SPLIT + ["async_training.staleness_threshold=1", "algorithm.rollout_correction.rollout_is=sequence"], "sequence"),
])
def test_async_training_defaults_to_token_is_and_the_resolved_config_shows_it(extra, expect):
    """verl's advice: the engine lags the trainer with staleness >= 1 or partial rollout, so token-level IS
    truncated at 2 is on unless the user says otherwise (null included)."""
    from hybridrl.config.io import to_yaml

    cfg = load_config(TINY, extra)
    correction = cfg.algorithm.rollout_correction
    assert correction.rollout_is == expect and correction.rollout_is_threshold == 2.0
    assert f"rollout_is: {expect or 'null'}" in to_yaml(cfg)


def test_config_files_layer_left_to_right(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("algorithm:\n  rollout_correction:\n    rollout_rs: seq_mean_k3\n    rollout_rs_threshold: 0.01\n"
                      "data:\n  train_batch_size: 8\n")
    cfg = load_config(f"{TINY},{recipe}", ["data.train_batch_size=16"])
    assert cfg.algorithm.rollout_correction.rollout_rs == "seq_mean_k3" and cfg.data.train_batch_size == 16
    assert cfg.model == load_config(TINY).model
    assert load_config(f"{TINY},{recipe}").data.train_batch_size == 8


def test_overlong_buffer_must_fit_in_the_response_length():
    overrides = ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9", "data.max_response_length=8"]
    assert "reward.overlong_buffer.len=9 is longer than data.max_response_length=8" in _layout_error(overrides, 1)
    cfg = load_config(TINY, overrides[:1] + ["reward.overlong_buffer.len=8", "data.max_response_length=8"])
    derive_layout(cfg, 1)


def test_missing_file_and_bad_yaml(tmp_path):
    assert "does not exist" in _error([], str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    assert "not valid YAML" in _error([], str(bad))
    assert "not of the form key=value" in _error(["actor.optim.lr"])


def _layout_error(overrides, world):
    with pytest.raises(ConfigError) as info:
        derive_layout(load_config(TINY, overrides), world)
    return str(info.value)


def test_world_size_must_be_tp_pp_dp():
    msg = _layout_error(["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], 6)
    assert "world size 6 is not divisible by tp (2) * cp (1) * pp (2)" in msg


def test_heads_and_groups_divisible_by_tp():
    msg = _layout_error(["parallel.tensor_model_parallel_size=4", "model.num_key_value_heads=2"], 4)
    assert "num_key_value_heads (query groups)=2 is not divisible by parallel.tensor_model_parallel_size=4" in msg
    msg = _layout_error(["parallel.tensor_model_parallel_size=3", "model.num_attention_heads=4",
                         "model.num_key_value_heads=1"], 3)
    assert "num_attention_heads=4 is not divisible" in msg


def test_layers_divisible_by_pp():
    msg = _layout_error(["parallel.pipeline_model_parallel_size=3", "model.num_layers=2"], 3)
    assert "num_layers=2 is not divisible by parallel.pipeline_model_parallel_size=3" in msg


def test_heads_read_from_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 4,
         "hidden_size": 96, "vocab_size": 100}))
    msg = _layout_error([f"model.path={tmp_path}", "parallel.tensor_model_parallel_size=2"], 2)
    assert "num_key_value_heads (query groups)=3" in msg


def test_batch_divisible_by_dp_and_micro():
    msg = _layout_error(["data.train_batch_size=3", "rollout.n=1", "actor.ppo_mini_batch_size=3"], 2)
    assert "data.train_batch_size * rollout.n = 3 is not divisible by dp=2" in msg
    msg = _layout_error(["data.train_batch_size=16", "actor.ppo_mini_batch_size=5"], 1)
    assert "not divisible by actor.ppo_mini_batch_size=5" in msg
    msg = _layout_error(["actor.ppo_mini_batch_size=4", "rollout.n=3", "actor.ppo_micro_batch_size_per_gpu=8"], 1)
    assert "actor.ppo_mini_batch_size * rollout.n = 12 is not divisible by dp (1) * " \
           "actor.ppo_micro_batch_size_per_gpu (8)" in msg
    msg = _layout_error(["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=5"], 1)
    assert "critic.ppo_micro_batch_size_per_gpu (5)" in msg
    # a micro batch above a rank's share is one micro batch, not an error
    derive_layout(load_config(TINY, ["actor.ppo_micro_batch_size_per_gpu=1000"]), 2)


def test_valid_layout_derives_sizes():
    layout = derive_layout(load_config(TINY, ["parallel.tensor_model_parallel_size=2"]), 4)
    assert (layout.tp, layout.pp, layout.dp) == (2, 1, 2)
    assert layout.samples_per_step == 32 * 8 and layout.samples_per_step_per_dp == 128


def test_cli_bad_key_is_one_clean_message():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY,
                           "foo.bar=1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "'foo.bar'" in proc.stderr and "did you mean" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_bad_data_file_is_one_clean_message(tmp_path):
    bad = tmp_path / "train.parquet"
    bad.write_text("not parquet")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY,
                           f"data.train_files=[{bad}]", f"trainer.default_local_dir={tmp_path}/ckpt"],
                          capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 2
    assert "is not a parquet file" in proc.stderr and str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_yaml_boolean_words_stay_words_for_string_keys(tmp_path):
    """YAML 1.1 reads `off` as false: a string key that takes "off" gets the word back, in a file and an override."""
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  verify_weights: off\n")
    cfg = load_config(str(path), ["actor.router_replay=off"])
    assert cfg.rollout.verify_weights == "off" and cfg.actor.router_replay == "off"
    assert load_config("", ["trainer.val_before_train=off"]).trainer.val_before_train is False  # bool keys stay bools


def test_long_sequence_layout_rules():
    """CP enters the world size; CP runs colocated, on padded or packed rows; MoE at TP 2 needs sequence
    parallelism."""
    moe = ["model.architecture=qwen3_moe", "parallel.tensor_model_parallel_size=2"]
    assert derive_layout(load_config(TINY, moe), 2).tp == 2  # sequence parallel by default at TP > 1
    assert "needs sequence parallelism" in _layout_error(moe + ["parallel.sequence_parallel=false"], 2)
    layout = derive_layout(load_config(TINY, ["parallel.context_parallel_size=2"]), 4)
    assert (layout.cp, layout.dp) == (2, 2) and "cp=2" in layout.describe()
    assert "tp (1) * cp (2) * pp (1)" in _layout_error(["parallel.context_parallel_size=2"], 3)
    derive_layout(load_config(TINY, ["parallel.context_parallel_size=2", "model.use_remove_padding=false"]), 2)
    assert "placement.mode=split" in _layout_error(["parallel.context_parallel_size=2", "placement.mode=split",
                                                     "placement.rollout_world_size=1"], 3)
    with pytest.raises(ConfigError, match="parallel.context_parallel_size must be >= 1"):
        load_config(TINY, ["parallel.context_parallel_size=0"])


def test_vllm_engine_dtype_must_match_a_verified_handoff():
    """Refused at start, not at the first weight bucket (the engine is built in rollout.dtype)."""
    vllm = ["rollout.name=vllm", "model.params_dtype=float32"]
    assert "set rollout.dtype=float32" in _layout_error(vllm, 1)
    derive_layout(load_config(TINY, vllm + ["rollout.dtype=float32"]), 1)
    derive_layout(load_config(TINY, vllm + ["rollout.verify_weights=off"]), 1)


@pytest.mark.parametrize("override,key,value", [
    ("actor.optim.lr=inf", "actor.optim.lr", "inf"),
    ("algorithm.kl_ctrl.kl_coef=nan", "algorithm.kl_ctrl.kl_coef", "nan"),
    ("critic.optim.clip_grad=-inf", "critic.optim.clip_grad", "-inf"),
    ("actor.optim.betas=[0.9,nan]", "actor.optim.betas[1]", "nan"),
])
def test_floats_must_be_finite(override, key, value):
    assert _error([override]) == f"config key '{key}' is {value}; set it to a finite number"


def test_non_finite_float_in_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  temperature: .nan\n")
    assert "config key 'rollout.temperature' is nan" in _error([], str(path))


def test_a_plain_string_file_is_a_one_element_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_files: gsm8k/train.parquet\n")
    cfg = load_config(str(path), ["data.val_files=gsm8k/test.parquet", "sft.train_files=sft.parquet"])
    assert (cfg.data.train_files, cfg.data.val_files, cfg.sft.train_files) == \
        (["gsm8k/train.parquet"], ["gsm8k/test.parquet"], ["sft.parquet"])
    assert load_config("", ["data.train_files=[a.parquet,b.parquet]"]).data.train_files == ["a.parquet", "b.parquet"]


def test_epochs_decide_the_rl_run_length_unless_steps_are_set():
    """As verl's trainer (total_training_steps null): a config that sets only trainer.total_epochs runs that many
    passes over the data (the default of 40 steps ran instead); a set total_training_steps decides alone."""
    from hybridrl.config.io import load_config
    from hybridrl.trainer.loop import _total_steps

    batches = [None] * 7  # what _total_steps reads of a loader: its batches per epoch
    assert _total_steps(load_config("", ["trainer.total_epochs=3"]), batches) == 21
    assert _total_steps(load_config("", ["trainer.total_epochs=3", "trainer.total_training_steps=5"]), batches) == 5
    assert _total_steps(load_config(""), batches) == 7 * 30  # verl's default total_epochs


def test_the_run_ends_when_its_epochs_do_as_verls_loop():
    """verl's fit loops `for epoch in range(total_epochs): for batch in dataloader` and returns at
    total_training_steps: whichever comes first ends the run (hybridrl reused the data past its epochs); the LR
    schedule still spans total_training_steps. test_freq -1 (verl's default) validates never during training
    (hybridrl validated at the last step)."""
    from hybridrl.config.io import load_config
    from hybridrl.trainer.loop import _run_steps, _total_steps, _validates_at

    batches = [None] * 7
    cfg = load_config("", ["trainer.total_epochs=1", "trainer.total_training_steps=10"])
    assert (_run_steps(cfg, batches), _total_steps(cfg, batches)) == (7, 10)
    assert _run_steps(load_config("", ["trainer.total_epochs=2", "trainer.total_training_steps=10"]), batches) == 10
    assert [s for s in range(1, 11) if _validates_at(s, 10, 4)] == [4, 8, 10]
    assert not any(_validates_at(s, 10, f) for s in range(1, 11) for f in (0, -1))


def test_the_critic_takes_the_actors_batch_and_loss_settings_it_leaves_unset():
    """As verl's config (critic.ppo_mini_batch_size: ${actor...} and so on): a verl PPO job that sets only the
    actor's mini-batch size, epochs, loss aggregation or scale factor trains its critic with them too (the
    critic kept 8 prompts, 1 epoch and token-mean of its own); a critic value set explicitly stands."""
    from hybridrl.config import Config, CriticConfig
    from hybridrl.config.io import load_config

    actor = ["actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2", "actor.loss_agg_mode=seq-mean-token-sum-norm",
             "actor.loss_scale_factor=100"]
    critic = load_config("", actor).critic
    assert (critic.ppo_mini_batch_size, critic.ppo_epochs, critic.loss_agg_mode, critic.loss_scale_factor) == (
        4, 2, "seq-mean-token-sum-norm", 100)
    own = load_config("", actor + ["critic.ppo_mini_batch_size=2", "critic.loss_agg_mode=token-mean"]).critic
    assert (own.ppo_mini_batch_size, own.ppo_epochs, own.loss_agg_mode) == (2, 2, "token-mean")
    assert Config(critic=CriticConfig(ppo_epochs=3)).critic.ppo_epochs == 3 and Config().critic.ppo_epochs == 1


def test_algorithm_defaults_are_verls():
    """A verl config that leaves adv_estimator and rollout.n unset runs PPO with one response per prompt (verl's
    defaults), not GRPO with four."""
    from hybridrl.config import Config

    assert (Config().algorithm.adv_estimator, Config().rollout.n) == ("gae", 1)
