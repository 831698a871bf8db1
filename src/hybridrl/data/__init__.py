"""Prompt data for RL and the data sets the demos and recipes generate.

prompts.py     parquet prompts in verl's layout -> tokenized, left-padded, DP-sharded batches (`DataError`)
gsm8k.py       GSM8k in verl's parquet layout from a local copy of the data set
synthetic.py   the generated arithmetic task of the CPU demo (plain and tool-calling variants)
tool_demos.py  tool-use demonstrations for the SFT warm-up and the tool-calling prompts

Data stands on config, tokenizer and rollout.tools (the calculator the demonstrations call); it must not
import workers, the planner, the trainer or anything that builds a model or a process group.
"""
