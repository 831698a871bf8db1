"""verl 0.9.1 config spellings a migrated job uses, read as verl reads them (each was refused before)."""
import pytest

from hybridrl.config import ConfigError
from hybridrl.config.io import load_config


def test_clip_ratio_is_the_fallback_of_null_clip_bounds():
    """verl's core_algos: `clip_ratio_low if clip_ratio_low is not None else clip_ratio` (and high alike); with the
    bounds at their 0.2 defaults, clip_ratio alone changes nothing, as in verl."""
    a = load_config("", ["actor.clip_ratio=0.3", "actor.clip_ratio_low=null", "actor.clip_ratio_high=0.28"]).actor
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.3, 0.28)
    a = load_config("", ["actor.clip_ratio=0.3"]).actor
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.2, 0.2)


def test_null_steps_and_val_batch_and_vectorized_estimators():
    cfg = load_config("", ["trainer.total_training_steps=null", "data.val_batch_size=null",
                           "algorithm.adv_estimator=grpo_vectorized"])
    assert cfg.trainer.total_training_steps == 0 and cfg.data.val_batch_size is None
    assert cfg.algorithm.adv_estimator == "grpo"  # the same advantages, another implementation in verl
    assert load_config("", ["algorithm.adv_estimator=rloo_vectorized"]).algorithm.adv_estimator == "rloo"


def test_val_batch_size_null_is_the_whole_set(tmp_path):
    from hybridrl.data.prompts import make_val_loader
    from hybridrl.data.synthetic import write_synthetic_arith
    from hybridrl.tokenizer import load_tokenizer

    _, test = write_synthetic_arith(str(tmp_path), n_train=4, n_test=37, seed=0)
    cfg = load_config("", [f"data.val_files=[{test}]", "data.val_batch_size=null", "data.tokenizer=builtin:tiny"])
    batches = list(make_val_loader(cfg.data, load_tokenizer("builtin:tiny")))
    assert [len(b) for b in batches] == [37]


def test_resume_path_mode_reads_resume_from_path(tmp_path):
    """verl: resume_mode=resume_path resumes from trainer.resume_from_path (read in that mode only)."""
    folder = str(tmp_path / "global_step_3")
    assert load_config("", ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={folder}"]
                       ).trainer.resume_mode == folder
    assert load_config("", [f"trainer.resume_from_path={folder}"]).trainer.resume_mode == "auto"
    with pytest.raises(ConfigError, match="needs trainer.resume_from_path"):
        load_config("", ["trainer.resume_mode=resume_path"])


def test_checkpoints_default_to_a_folder_per_experiment():
    """verl: checkpoints/${project_name}/${experiment_name}; one shared folder let resume_mode=auto pick up another
    experiment's checkpoint."""
    import os

    cfg = load_config("", ["trainer.project_name=p", "trainer.experiment_name=e"]).trainer
    assert cfg.checkpoint_dir == os.path.join("outputs", "checkpoints", "p", "e")
    assert load_config("", ["trainer.default_local_dir=/x/ck"]).trainer.checkpoint_dir == "/x/ck"


def test_verls_section_layout_is_read(tmp_path):
    """A verl YAML (actor_rollout_ref.{actor,rollout,ref,model}, custom_reward_function) and verl-style overrides
    land in hybridrl's sections, merged with what the file sets there itself; keys with another home here
    (verl's megatron parallel sizes, the rollout's log-prob batch sizes, hybrid_engine) are named by the error."""
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  model: {path: /m}\n  actor: {optim: {lr: 2.0e-6}, ppo_mini_batch_size: 16}\n"
                    "  rollout: {n: 4, temperature: 0.7}\n  ref: {log_prob_micro_batch_size_per_gpu: 3}\n"
                    "actor: {ppo_epochs: 2}\ncustom_reward_function: {path: /r.py, name: score}\n")
    cfg = load_config(str(path), ["actor_rollout_ref.rollout.n=6"])
    assert (cfg.model.path, cfg.actor.optim.lr, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs) == ("/m", 2e-6, 16, 2)
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.ref.log_prob_micro_batch_size_per_gpu) == (6, 0.7, 3)
    assert (cfg.reward.custom_function.path, cfg.reward.custom_function.name) == ("/r.py", "score")
    for key, home in (("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "parallel.tensor_model_parallel_size"),
                      ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                       "actor.log_prob_micro_batch_size_per_gpu"),
                      ("actor_rollout_ref.hybrid_engine=true", "placement.mode")):
        with pytest.raises(ConfigError, match=f"is now '{home}"):
            load_config("", [key])


def test_verl_keys_with_nothing_to_set_are_named_and_dropped(capsys):
    """A verl config keeps keys that mean nothing here (the Ray world, the data loader's workers, the strategy):
    they are accepted and named once with why, not refused one run at a time; anything else still is."""
    cfg = load_config("", ["trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                           "actor_rollout_ref.actor.strategy=megatron", "data.return_raw_chat=true",
                           "data.dataloader_num_workers=8", "critic.strategy=megatron"])
    out = capsys.readouterr().out
    assert cfg.trainer.project_name == "hybridrl"
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node: the world is the launcher's", "actor.strategy",
                "data.dataloader_num_workers", "critic.strategy"):
        assert key in out, key
    with pytest.raises(ConfigError, match="unknown config key 'data.return_everything'"):
        load_config("", ["data.return_everything=true"])


def test_references_into_verls_sections_follow_them(tmp_path):
    """verl's YAML repeats values by reference (${actor_rollout_ref.actor.ppo_mini_batch_size}): the references move
    with the sections (they raised an uncaught InterpolationKeyError); one that names nothing is a ConfigError;
    verl's null custom_reward_function is the built-in reward."""
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor: {ppo_mini_batch_size: 16, optim: {lr: 2.0e-6}}\n"
                    "critic:\n  ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}\n"
                    "  optim: {lr: '${oc.select:actor_rollout_ref.actor.optim.lr,1e-5}'}\n"
                    "custom_reward_function: {path: null, name: null}\n")
    cfg = load_config(str(path))
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.optim.lr) == (16, 2e-6)
    assert (cfg.reward.custom_function.path, cfg.reward.custom_function.name) == ("", "compute_score")
    bad = tmp_path / "bad.yaml"
    bad.write_text("critic:\n  ppo_mini_batch_size: ${nowhere.x}\n")
    with pytest.raises(ConfigError, match="nowhere.x"):
        load_config(str(bad))


def test_planned_moe_dispatch_is_per_gpu_under_context_parallelism():
    """With a token budget, CP 2 puts twice the rows in a micro-batch and half of each row on a GPU: the update's
    dispatch buffers per GPU are CP 1's (they were counted twice)."""
    from hybridrl.planner.plan import estimate

    def dispatch(cp):
        cfg = load_config("configs/tiny_cpu_moe.yaml", [f"parallel.context_parallel_size={cp}", "actor.use_dynamic_bsz=true",
                                                        "actor.ppo_max_token_len_per_gpu=64", "data.max_prompt_length=32",
                                                        "data.max_response_length=32",
                                                        "parallel.expert_model_parallel_size=1"])
        phase = estimate(cfg, cp, vocab_size=64).phase("actor update")
        return dict(phase.items)["actor/dispatch"]
    assert dispatch(2) == pytest.approx(dispatch(1))


def test_ignore_eos_reaches_validation_too():
    """verl's vLLM server sets ignore_eos on every request: validation ran to the eos here."""
    from types import SimpleNamespace

    from hybridrl.tokenizer import load_tokenizer
    from hybridrl.trainer.ppo import PPOTrainer

    trainer = SimpleNamespace(cfg=load_config("", ["rollout.ignore_eos=true"]), tok=load_tokenizer("builtin:tiny"))
    assert PPOTrainer.val_sampling(trainer).ignore_eos and PPOTrainer.train_sampling(trainer).ignore_eos
