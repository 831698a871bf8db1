"""Training a reward model (Bradley-Terry on preference pairs) for use as `reward_model` in RL.

training.py          the reward-model trainer run by `scripts/train_rm.py`
preference_pairs.py  chosen/rejected pairs built from scored responses

It sits on top of the trainer's run helpers (roles, loop, entry); nothing else in hybridrl imports it.
"""
