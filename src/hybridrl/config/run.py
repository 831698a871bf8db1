"""Sections trainer and sft: steps, logging, checkpoints, validation schedule; the supervised warm-up."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

from hybridrl.config.checks import check, one_of
from hybridrl.config.training import OptimConfig


LOGGERS = ("console", "tensorboard", "wandb", "file")


@dataclass(frozen=True)
class TrainerConfig:
    total_training_steps: Optional[int] = 0
    """Training steps to run (and the LR schedule's length); 0 or null (the default, verl's null): total_epochs
    over the data. As verl, the run also ends when total_epochs passes over the data are done, whichever comes
    first."""
    total_epochs: int = 30
    """Passes over the data, at most (verl's default, 30)."""
    critic_warmup: int = 0
    """The first step whose actor update runs, as verl counts it: steps 1 .. critic_warmup - 1 update only the
    critic (0 and 1: the actor from the first step)."""
    test_freq: int = 10
    """Validate every this many steps and at the last; 0 or below (verl's -1) never during training (verl's
    default is -1; this one validates every 10 steps unless told not to)."""
    val_only: bool = False
    """verl's evaluation run: validate before training (val_before_train) and end there: no step, no checkpoint."""
    val_before_train: bool = True
    """Validate once before training: at step 0, or at the step a resumed run goes on from (as verl)."""
    balance_batch: Optional[bool] = None
    """verl's: after scoring, move whole prompt groups between DP ranks so each rank's passes see about the same
    number of tokens (`trainer/balance.py`; global_seqlen/* metrics). null (the default): on, as verl's default,
    except with async_training.stream_prompts (the passes run per chunk as it arrives: nothing left to move);
    true there is refused."""
    save_freq: int = 0
    """Checkpoint every this many steps; 0 disables."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep the actor of the newest K complete checkpoints, delete older ones after each save; null or 0: keep all."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """Keep the critic of the newest K complete checkpoints, delete older ones after each save; null or 0: keep all."""
    rollout_data_dir: Optional[str] = None
    """verl's: each training step's responses as <step>.jsonl here (input, output, gts, score, step and the reward's
    extra values per response); null: none."""
    log_val_generations: int = 0
    """verl's: this many validation responses (prompt, response, score) to TensorBoard (text) and W&B (a table
    growing a row per validation) at every validation."""
    validation_data_dir: Optional[str] = None
    """verl's: each validation's responses as <step>.jsonl here (step 0 before training); null: none."""
    default_local_dir: str = ""
    """Where checkpoints go; empty: outputs/checkpoints/<project_name>/<experiment_name> (one folder per experiment,
    as verl's checkpoints/${project_name}/${experiment_name}, so resume_mode=auto never finds another's)."""
    resume_mode: str = "auto"
    """auto (latest in default_local_dir), disable, a checkpoint path, or verl's resume_path (resume_from_path)."""
    resume_from_path: Optional[str] = None
    """verl's: the checkpoint folder resume_mode=resume_path resumes from (read only in that mode, as verl)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on (published when complete)."""
    verify_checkpoint_digests: bool = True
    """Before resuming, compare every checkpoint file's crc32 with the one saved (sizes are always compared)."""
    export_hf_dir: str = ""
    """Write the final actor as an HF folder here; empty disables."""
    log_dir: str = "outputs/tensorboard"
    """TensorBoard event files."""
    logger: List[str] = field(default_factory=lambda: ["console", "tensorboard"])
    """Metric sinks (verl's trainer.logger): console, tensorboard, wandb (offline until `wandb login`), file (JSON lines)."""
    project_name: str = "hybridrl"
    """Project name (folder under log_dir; the W&B project)."""
    experiment_name: str = "tiny_cpu"
    """Run name (folder under log_dir/project_name; the W&B run name)."""
    seed: int = 1
    """Global seed of torch RNGs."""
    progress_bar: bool = True
    """Show a progress bar over steps (rank 0)."""
    log_freq: int = 1
    """Print a console line every this many steps (and at validations and the last step)."""
    max_runtime: str = ""
    """"HH:MM:SS" (or "D-HH:MM:SS"): save and stop (exit code 75) at the first step boundary this long after the
    process started (set-up and checkpoint load included)."""
    stop_margin_s: int = 300
    """Under SLURM, save and stop this many seconds before the job's end time (SLURM_JOB_END_TIME)."""
    timeline_dir: str = ""
    """Write a Chrome-trace JSON (timeline.json: one track per rank, a span per phase) here; empty disables."""
    dist_timeout_s: int = 600
    """Process-group timeout: a collective waiting this long for a rank that stopped fails the job."""
    hang_timeout_s: float = 1800
    """A phase running this long ends the run with one line naming rank and phase, stacks under log_dir; 0: off."""

    @property
    def checkpoint_dir(self) -> str:
        """default_local_dir, or where empty outputs/checkpoints/<project_name>/<experiment_name>."""
        return self.default_local_dir or os.path.join("outputs", "checkpoints", self.project_name, self.experiment_name)

    def __post_init__(self):
        if self.total_training_steps is None:  # verl's null: the epochs decide
            object.__setattr__(self, "total_training_steps", 0)
        if self.resume_mode == "resume_path":  # verl's spelling of "resume from this folder"
            check(bool(self.resume_from_path), "trainer.resume_mode=resume_path needs trainer.resume_from_path=<a "
                                               "global_step_N folder>")
            object.__setattr__(self, "resume_mode", self.resume_from_path)
        check(self.total_training_steps >= 0, "trainer.total_training_steps must be >= 0")
        check(not self.val_only or self.val_before_train, "trainer.val_only=true validates before training and "
                                                          "stops: it needs trainer.val_before_train=true")
        check(self.test_freq >= -1, "trainer.test_freq must be >= 1, or 0 / -1 (never during training)")
        check(self.log_freq >= 1, "trainer.log_freq must be >= 1")
        check(self.dist_timeout_s > 0, "trainer.dist_timeout_s must be > 0 (seconds)")
        check(self.hang_timeout_s >= 0, "trainer.hang_timeout_s must be >= 0 (seconds; 0 turns the watchdog off)")
        check(not self.max_runtime or bool(re.fullmatch(r"(\d+-)?(\d+:)?\d+:\d+", self.max_runtime.strip())),
              f"trainer.max_runtime={self.max_runtime!r} is not HH:MM:SS (or D-HH:MM:SS); e.g. 23:50:00")
        for role in ("actor", "critic"):
            keep = getattr(self, f"max_{role}_ckpt_to_keep")
            check(keep is None or keep >= 0, f"trainer.max_{role}_ckpt_to_keep={keep}: pass K >= 1 to keep the "
                                             f"newest K {role} checkpoints, or null (or 0) to keep all")
        for sink in self.logger:
            one_of("trainer.logger", sink, LOGGERS)


@dataclass(frozen=True)
class SFTConfig:
    train_files: List[str] = field(default_factory=lambda: ["data/tiny_tools_sft/train.parquet"])
    """Parquet files of chat trajectories for scripts/train_sft.py (loss on assistant tokens only)."""
    val_files: List[str] = field(default_factory=list)
    """Parquet files of held-out trajectories (same column): their loss, `val/loss` (the token mean over all of
    them), after every test_freq steps and after the last one, as verl's SFT trainer; empty: no validation."""
    test_freq: int = 0
    """Steps between validations (with val_files); 0: after the last step only."""
    messages_key: str = "messages"
    """Column holding each trajectory: a list of {role, content} messages (user, assistant, tool)."""
    max_length: int = 256
    """Longest trajectory in tokens; longer ones are dropped (and counted)."""
    train_batch_size: int = 32
    """Trajectories per optimizer step, over all DP ranks."""
    micro_batch_size_per_gpu: int = 8
    """Trajectories per forward/backward on one DP rank."""
    total_training_steps: Optional[int] = 0
    """Optimizer steps (and the LR schedule's length); 0 or null (the default, as verl's null): total_epochs over
    the data. As verl's SFT loop, the run also ends when total_epochs passes are done, whichever comes first."""
    total_epochs: int = 4
    """Passes over the data, at most (verl's SFT default, 4)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule of the SFT run."""
    output_dir: str = "outputs/sft/hf"
    """HF folder (model + tokenizer) written at the end; the RL run loads it with model.path=..."""
    shuffle: bool = True
    """Reshuffle the trajectories every epoch (seeded by data.seed)."""
    synthetic_task: str = ""
    """When the train files are missing and this is set (arith, arith_tools), generate demonstrations there."""
    default_local_dir: str = "outputs/sft/checkpoints"
    """Where SFT checkpoints go (global_step_K: model, optimizer and LR schedule, data position, RNG streams), apart
    from trainer.default_local_dir so that an RL run resuming there never finds them. A file STOP here saves and
    stops the run at the next step (as trainer.default_local_dir/STOP does for RL)."""
    save_freq: int = 0
    """Steps between checkpoints, and one at the last step; 0: none (the HF folder is still written at the end). A
    stop signal (SIGTERM, SIGUSR1, SIGINT), the stop file or trainer.max_runtime saves one whatever this is."""
    resume_mode: str = "auto"
    """auto: from the newest intact checkpoint under default_local_dir (a fresh start where there is none);
    disable: from model.path; or the path of one global_step_K folder."""
    max_ckpt_to_keep: Optional[int] = None
    """Keep the newest K checkpoints (null or 0: all)."""

    def __post_init__(self):
        check(self.max_length > 1, "sft.max_length must be > 1")
        check(self.train_batch_size > 0, "sft.train_batch_size must be > 0")
        check(self.micro_batch_size_per_gpu > 0, "sft.micro_batch_size_per_gpu must be > 0")
        if self.total_training_steps is None:  # verl's null: the epochs decide
            object.__setattr__(self, "total_training_steps", 0)
        check(self.total_training_steps >= 0, "sft.total_training_steps must be >= 0")
        check(self.total_epochs >= 1, "sft.total_epochs must be >= 1")
        check(self.test_freq >= 0, "sft.test_freq must be >= 0 (0: validate after the last step only)")
        check(bool(self.messages_key), "sft.messages_key must name the column of the trajectories")
        check(bool(self.output_dir), "sft.output_dir must name the folder the model is written to")
        one_of("sft.synthetic_task", self.synthetic_task, ("", "arith", "arith_tools"))
        check(self.save_freq >= 0, "sft.save_freq must be >= 0 (0: no periodic checkpoints)")
        check(bool(self.default_local_dir), "sft.default_local_dir must name the folder of the SFT checkpoints")
        check(bool(self.resume_mode), "sft.resume_mode must be auto, disable or a global_step_* folder")
        check(self.max_ckpt_to_keep is None or self.max_ckpt_to_keep >= 0,
              f"sft.max_ckpt_to_keep={self.max_ckpt_to_keep}: pass K >= 1 to keep the newest K checkpoints, or null "
              "(or 0) to keep all")
