"""Supervised fine-tuning on chat trajectories (scripts/train_sft.py): the warm-up before RL."""
