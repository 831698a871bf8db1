"""MoE routing statistics of a training pass, read from the routers as they run.

`RouterStats(model)` hooks every megatron TopKRouter of the model while it is entered and records, per
layer, the tokens each expert received and the terms of the switch load-balancing loss. `metrics()`
gives `actor/moe_aux_loss` (the loss before its coefficient, as megatron logs it: E / (k T^2) *
sum_e P_e f_e, P_e the summed router probabilities and f_e the tokens sent to expert e; mean over
layers) and `actor/moe_load_imbalance` (max over mean tokens per expert, mean over layers). Every token
the router saw counts, padding included (it is dispatched and computed like the rest). A rank's routers see
only its rows and, under context parallelism, its chunk of them, and under sequence parallelism its TP share
of the tokens: `pass_sums` adds the raw counts over those ranks before the ratios, as megatron's aux loss sums
its counts over TP x CP.
"""
from __future__ import annotations

import torch


class RouterStats:
    def __init__(self, model):
        self.routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
        self.tokens: dict[int, torch.Tensor] = {}
        self.probs: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}
        self.sequence_parallel = bool(self.routers) and self.routers[0].config.sequence_parallel
        """Each TP rank routes its own share of the tokens (else every TP rank routes all of them)."""
        self._hooks = []

    def __enter__(self):
        for router in self.routers:
            self._hooks.append(router.register_forward_hook(self._record))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _record(self, router, args, output):
        _, routing_map = output
        with torch.no_grad():
            hidden = args[0].reshape(-1, args[0].shape[-1])
            logits = torch.nn.functional.linear(hidden.float(), router.weight.float())
            layer = router.layer_number
            tokens = routing_map.sum(0).double()
            probs = torch.softmax(logits, -1).sum(0).double()
            self.tokens[layer] = self.tokens.get(layer, 0) + tokens
            self.probs[layer] = self.probs.get(layer, 0) + probs
            self.count[layer] = self.count.get(layer, 0) + hidden.shape[0]

    def sums(self) -> torch.Tensor | None:
        """[layers, 2E + 1]: tokens per expert, summed probabilities, tokens (for a sum over DP ranks)."""
        if not self.tokens:
            return None
        layers = sorted(self.tokens)
        return torch.stack([torch.cat([self.tokens[i], self.probs[i], self.tokens[i].new_tensor([self.count[i]])])
                            for i in layers])

    @staticmethod
    def metrics(sums: torch.Tensor | None, topk: int, prefix: str = "actor") -> dict:
        if sums is None:
            return {}
        e = (sums.shape[1] - 1) // 2
        tokens, probs, total = sums[:, :e], sums[:, e:2 * e], sums[:, -1:]
        aux = (e / (topk * total.squeeze(1) ** 2) * (probs * tokens).sum(1)).mean()
        imbalance = (tokens.max(1).values / tokens.mean(1).clamp(min=1e-9)).mean()
        return {f"{prefix}/moe_aux_loss": aux.item(), f"{prefix}/moe_load_imbalance": imbalance.item()}


def pass_sums(stats: RouterStats, groups) -> torch.Tensor | None:
    """`stats.sums()` added over every rank whose routers saw other tokens of the pass: DP, CP, and TP under
    sequence parallelism (one all-reduce each, on the run's device)."""
    import torch.distributed as dist

    sums = stats.sums()
    if sums is None:
        return None
    spread = [(groups.dp, groups.dp_group), (groups.cp, groups.cp_group),
              (groups.tp if stats.sequence_parallel else 1, groups.tp_group)]
    for size, group in spread:
        if size > 1:
            sums = sums.to(groups.device)
            dist.all_reduce(sums, group=group)
    return sums


def pass_metrics(stats: RouterStats, groups, topk: int, prefix: str = "actor") -> dict:
    """The metrics of a pass on every rank: counts summed over the ranks that split its tokens (`pass_sums`),
    layer means averaged over PP stages."""
    import torch.distributed as dist

    sums = pass_sums(stats, groups)
    if sums is None:
        return {}
    metrics = RouterStats.metrics(sums, topk, prefix)
    if groups.pp > 1:
        t = torch.tensor(list(metrics.values()), dtype=torch.float64, device=groups.device)
        dist.all_reduce(t, group=groups.pp_group)
        metrics = dict(zip(metrics, (t / groups.pp).tolist()))
    return metrics
