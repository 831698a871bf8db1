"""Role workers over megatron-core models: actor, critic, reference and reward model; optimizers; micro-batches.

actor.py / critic.py / reward_model.py  one small class per role (compute_log_prob, compute_values, update)
engine.py        forward/backward of a role over megatron-core's pipeline schedules at any TP x PP
update.py        mini-batch and micro-batch updates with the loss normalised over the whole mini-batch
optim.py         megatron's optimizer (or a CPU AdamW) with LR schedule and gradient clipping
micro_batches.py splitting rows by count or token budget, trimming padding, putting results back

Workers stand on data, models, parallel, algos and config; they must not import the planner or the
trainer, and they never build a rollout engine.
"""
