"""Validation sampling as verl 0.9.1's: the val temperature decides (0: greedy); do_sample is not read."""
from types import SimpleNamespace

import pytest

from hybridrl.config import ConfigError
from hybridrl.config.rollout import ValKwargsConfig
from hybridrl.trainer.ppo import PPOTrainer


def _sampling(**val_kwargs):
    cfg = SimpleNamespace(rollout=SimpleNamespace(val_kwargs=ValKwargsConfig(**val_kwargs), seed=0, ignore_eos=False),
                          data=SimpleNamespace(max_response_length=8))
    return PPOTrainer.val_sampling(SimpleNamespace(cfg=cfg, tok=SimpleNamespace(eos_token_ids=[1])))


def test_the_temperature_decides_as_in_verl():
    """verl's agent loop applies val_kwargs.temperature / top_p / top_k whatever do_sample says (a verl config with
    temperature 0.6 and do_sample false samples there); temperature 0 is greedy."""
    sampled = _sampling(temperature=0.6, top_p=0.9, top_k=5)  # do_sample left false
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.6, 0.9, 5)
    greedy = _sampling(temperature=0.0, do_sample=True, top_p=0.9)
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 1.0, -1)
    with pytest.raises(ConfigError, match="n=4 at temperature 0 gives 4 identical greedy responses"):
        ValKwargsConfig(n=4, do_sample=True)
    assert _sampling(n=4, temperature=1.0).n == 4
