"""The RL run: the PPO step as a short sequence of named calls, and the loop around it.

ppo.py              the step: rollout, reward, log-probs and values, advantages, updates, weight sync
loop.py             the run: set-up, steps, metrics, checkpoints, validation, export
roles.py            building the actor, critic, reference, reward model and rollout engine of a run
step_batch.py       one step's batch and its DP scatter/gather
validation.py       verl's val-core / val-aux metrics over sampled or greedy responses
dynamic_sampling.py DAPO's filter_groups: keep generating until enough groups carry signal
entry.py            the command line: config, overrides, one `error:` line for a user's mistake
split.py            split placement: the trainers' RolloutClient / Pipeline and the rollout ranks' loop
split_critic.py     split placement: a critic on ranks of its own (RemoteCritic and its serving loop)
streamed.py         a streamed step: chunks of prompt groups scored and passed forward as they arrive

The trainer may import every part below it (planner, workers, data, rollout, placement, checkpoint,
models, ...); only sft, reward_model and the scripts import the trainer.
"""
