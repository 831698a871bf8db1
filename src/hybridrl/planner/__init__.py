"""The planner: process groups and per-GPU memory of a layout, before anything is built.

plan.py    the groups of a TP x PP x DP layout and each phase's per-GPU memory (`scripts/plan_layout.py`,
           `--dry-run`), hybrid engine against two copies
memory.py  the byte counts of weights, gradients, optimizer state, activations and the loss side (MoE:
           experts per EP rank, routed activations, dispatch buffers)
report.py  the plan's text (layout, groups, phases, verdict) and the fix for what does not fit
placement.py  which devices each role gets (split placement): every split beside colocated, with
           predicted step time and per-group utilisation (`scripts/plan_layout.py --placement auto`)

The planner reads the config, the workers' micro-batching and the offload rules; it must not import the
trainer, build models or touch torch.distributed.
"""
