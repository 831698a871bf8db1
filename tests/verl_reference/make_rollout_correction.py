"""Reference data for rollout correction (IS weights, rejection sampling, their metrics), from verl 0.9.1 itself.

Run in the side venv that has verl (never a hybridrl dependency; requirements-verl.txt):
    make verl-reference        # creates .venv-verl, then runs make_reference.py, make_gae_holes.py and this
It writes rollout_correction_verl_0_9_1.json beside this file, read by tests/test_rollout_correction.py:
- "inputs": float32 (old_log_prob, rollout_log_prob, response_mask) sets: random (mild and wide mismatch),
  and hard ones (several fully masked rows, log-ratios past the +-20 clamp and finite garbage under the
  mask, one-token responses, a batch with a single token, engine equal to trainer, multi-turn masks whose
  holes, tool output, hold garbage log-probs);
- "cases": `rollout_corr_helper.compute_rollout_correction_and_rejection_mask` on every input for every
  rollout_is level and threshold form (TIS, IcePop, batch normalisation), every rollout_rs option alone
  (k1 with "lower_upper" and with a bare upper), chained options (per-option and shared thresholds, a
  duplicate) and every preset; the weights, the rejected mask and every metric;
- "debug_metrics": `verl.utils.debug.metrics.calculate_debug_metrics` (training/rollout_probs_diff_*);
- "losses": compute_policy_loss_vanilla / _gspo with the weights, and _bypass_mode (ppo_clip and reinforce,
  with rejection): loss, metrics and the gradient with respect to log_prob;
- "presets": every factory preset of verl's RolloutCorrectionConfig, as its field values (configs/recipes/).
"""
import dataclasses
import json
import os

import torch
import verl
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.utils.debug.metrics import calculate_debug_metrics
from verl.workers.config import ActorConfig

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout_correction_verl_0_9_1.json")
RS_ALONE = [("token_k1", "0.5_2.0"), ("token_k1", 1.5), ("token_k2", 0.02), ("token_k3", 0.02),
            ("seq_sum_k1", "0.2_5.0"), ("seq_sum_k1", "3.0"), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1),
            ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k1", 1.05), ("seq_mean_k2", 0.01), ("seq_mean_k3", 0.01),
            ("seq_max_k2", 0.05), ("seq_max_k3", 0.05)]
RS_CHAINED = [("token_k1,seq_mean_k3", "0.5_2.0,0.01"), ("seq_max_k2,seq_sum_k3,token_k2", 0.05),
              ("seq_mean_k3, seq_mean_k3", "0.02"), ("token_k3,seq_mean_k1", "0.1,0.8_1.25")]
HOLE_MASKS = [[1, 1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
              [1, 0, 1, 0, 1, 0, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
"""1 = model token, 0 = tool output (a hole) or padding."""
IS_MODES = [(level, threshold, norm) for level in ("token", "sequence") for threshold in (2.0, 1.2, "0.5_5.0")
            for norm in (False, True)]


def _lists(t):
    """float32 values at 9 significant digits: exact for float32, a third of the text."""
    return [_lists(row) for row in t] if t.dim() else _num(t.item())


def _num(x):
    return float(f"{x:.9g}")


def _mask(t):
    return t.int().tolist()


def _lengths_mask(lengths, t):
    return (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).float()


def inputs():
    """name -> (old, rollout, mask), float32."""
    g = torch.Generator().manual_seed(41)
    out = {}
    b, t = 10, 12
    mask = _lengths_mask([12, 0, 7, 1, 12, 3, 9, 12, 5, 11], t)
    old = -2.0 + 0.7 * torch.randn(b, t, generator=g)
    out["random_mild"] = (old, old + 0.1 * torch.randn(b, t, generator=g), mask)
    out["random_wide"] = (old, old + 0.9 * torch.randn(b, t, generator=g), mask)
    # past the clamp: |log r| of 25 and 60 on real tokens, garbage (finite) under the mask
    old = -3.0 + torch.randn(6, 8, generator=g)
    rollout = old + 0.05 * torch.randn(6, 8, generator=g)
    rollout[0, :3] = old[0, :3] + torch.tensor([25.0, -25.0, 60.0])
    rollout[2, 0] = old[2, 0] - 60.0
    rollout[3, :] = old[3, :] + 21.0
    mask = _lengths_mask([6, 0, 1, 8, 0, 4], 8)
    old = torch.where(mask.bool(), old, torch.full_like(old, -80.0))
    rollout = torch.where(mask.bool(), rollout, torch.zeros_like(rollout))
    out["extreme_ratios"] = (old, rollout, mask)
    old = -1.5 + torch.randn(7, 5, generator=g)
    out["one_token_rows"] = (old, old + 0.4 * torch.randn(7, 5, generator=g), _lengths_mask([1, 1, 0, 1, 1, 1, 1], 5))
    old = -1.0 + torch.randn(3, 4, generator=g)
    out["single_token"] = (old, old + 0.3 * torch.randn(3, 4, generator=g), _lengths_mask([0, 1, 0], 4))
    old = -2.0 + torch.randn(4, 6, generator=g)
    out["engine_equals_trainer"] = (old, old.clone(), _lengths_mask([6, 2, 0, 5], 6))
    # multi-turn: tool output inside the response is masked out (holes), its log-probs meaningless
    mask = torch.tensor(HOLE_MASKS, dtype=torch.float32)
    old = -2.0 + torch.randn(mask.shape, generator=g)
    rollout = old + 0.3 * torch.randn(mask.shape, generator=g)
    garbage = torch.where(mask.bool(), torch.zeros_like(old), 40.0 * torch.randn(mask.shape, generator=g))
    out["multi_turn_holes"] = (old + garbage, rollout - garbage, mask)
    return out


def correction_settings():
    settings = [dict()]
    settings += [dict(rollout_is=level, rollout_is_threshold=thr, rollout_is_batch_normalize=norm)
                 for level, thr, norm in IS_MODES]
    settings += [dict(rollout_rs=rs, rollout_rs_threshold=thr) for rs, thr in RS_ALONE + RS_CHAINED]
    for name, fields in presets().items():
        fields = {k: v for k, v in fields.items() if k not in ("bypass_mode", "loss_type")}
        settings.append(dict(fields, preset=name))
    return settings


def presets():
    """Every factory classmethod of RolloutCorrectionConfig at its default arguments."""
    out = {}
    for name, member in vars(RolloutCorrectionConfig).items():
        if isinstance(member, classmethod):
            cfg = getattr(RolloutCorrectionConfig, name)()
            out[name] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if not f.name.startswith("_")}
    return out


def correction_cases(data):
    """One entry per setting: its metric names once, then per input the weights (None without IS), the
    mask after rejection (None when nothing was rejected) and the metric values in the names' order."""
    cases = []
    for setting in correction_settings():
        kwargs = {k: v for k, v in setting.items() if k != "preset"}
        case = {"kwargs": kwargs, "preset": setting.get("preset"), "metric_names": None, "by_input": {}}
        for name, (old, rollout, mask) in data.items():
            weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs)
            case["metric_names"] = case["metric_names"] or sorted(metrics)
            assert sorted(metrics) == case["metric_names"]
            case["by_input"][name] = {
                "weights": None if weights is None else _lists(weights.batch["rollout_is_weights"]),
                "response_mask": None if torch.equal(new_mask, mask) else _mask(new_mask),
                "metrics": [_num(metrics[k]) for k in case["metric_names"]]}
        cases.append(case)
    return cases


def debug_cases(data):
    out = []
    for name, (old, rollout, mask) in data.items():
        batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                             "responses": torch.zeros(mask.shape, dtype=torch.long)})
        out.append({"input": name, "metrics": {k: _num(v) for k, v in calculate_debug_metrics(batch).items()}})
    return out


def _actor_config(loss_mode, correction=None, agg="token-mean"):
    policy_loss = {"loss_mode": loss_mode}
    if correction is not None:
        policy_loss["rollout_correction"] = RolloutCorrectionConfig(**correction)
    low, high = (3e-4, 4e-4) if loss_mode == "gspo" else (0.2, 0.28)
    return ActorConfig(strategy="megatron", clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0,
                       loss_agg_mode=agg, ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1,
                       policy_loss=policy_loss)


LOSS_SETTINGS = [
    ("vanilla", dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05)),
    ("vanilla", dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0")),
    ("gspo", dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")),
    ("bypass_mode", dict(rollout_is=None, rollout_rs=None, bypass_mode=True, loss_type="ppo_clip")),
    ("bypass_mode", dict(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.12, bypass_mode=True,
                         loss_type="ppo_clip")),
    ("bypass_mode", dict(rollout_is="sequence", rollout_is_threshold=2.0, bypass_mode=True, loss_type="reinforce")),
    ("bypass_mode", dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                         rollout_rs_threshold="0.85_1.2", bypass_mode=True, loss_type="reinforce")),
]


def loss_cases():
    """Decoupled: the trainer's old log-probs against the engine's give weights and a mask, the loss uses them.
    Bypass: old = rollout, the correction is made inside the loss from the current log-probs."""
    g = torch.Generator().manual_seed(42)
    cases = []
    for loss_mode, correction in LOSS_SETTINGS:
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            b, t = 6, 9
            mask = _lengths_mask([9, 4, 0, 1, 7, 9], t)
            rollout = -2.0 + 0.5 * torch.randn(b, t, generator=g)
            old = rollout + 0.3 * torch.randn(b, t, generator=g)
            spread = 1e-3 if loss_mode == "gspo" else 0.3
            new = (old + spread * torch.randn(b, t, generator=g)).requires_grad_(True)
            adv = torch.randn(b, 1, generator=g) * mask
            cfg = _actor_config(loss_mode, correction if loss_mode == "bypass_mode" else None, agg)
            loss_mask, weights = mask, None
            if loss_mode != "bypass_mode":
                kwargs = {k: v for k, v in correction.items() if k not in ("bypass_mode", "loss_type")}
                proto, loss_mask, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs)
                weights = None if proto is None else proto.batch["rollout_is_weights"]
            first = rollout if loss_mode == "bypass_mode" else old
            loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(first, new, adv, loss_mask, loss_agg_mode=agg,
                                                                     config=cfg, rollout_is_weights=weights)
            (grad,) = torch.autograd.grad(loss, new)
            cases.append({"loss_mode": loss_mode, "correction": correction, "agg_mode": agg, "mask": _mask(mask),
                          "rollout_log_prob": _lists(rollout), "old_log_prob": _lists(old), "log_prob": _lists(new),
                          "advantages": _lists(adv), "loss": _num(loss.item()), "grad": _lists(grad),
                          "metrics": {k: _num(v) for k, v in metrics.items()}})
    return cases


def main():
    data = inputs()
    ref = {"verl_version": verl.__version__, "torch_version": torch.__version__,
           "inputs": {k: {"old_log_prob": _lists(old), "rollout_log_prob": _lists(rollout), "response_mask": _mask(mask)}
                      for k, (old, rollout, mask) in data.items()},
           "cases": correction_cases(data), "debug_metrics": debug_cases(data), "losses": loss_cases(),
           "presets": presets()}
    with open(OUT, "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    count = sum(len(c["by_input"]) for c in ref["cases"])
    print(f"wrote {OUT} ({count} correction cases, verl {verl.__version__})")


if __name__ == "__main__":
    main()
