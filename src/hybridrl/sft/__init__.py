"""Supervised fine-tuning on chat trajectories (scripts/train_sft.py): the warm-up before RL.

data.py     trajectories from parquet (or generated tool demonstrations) into masked token batches
trainer.py  the SFT loop over the actor's megatron-core model, optimizer and checkpoint helpers
entry.py    the command line

SFT reuses the trainer's role builders and the workers' optimizer; nothing else imports sft.
"""
