"""hybridrl: PPO and GRPO post-training of LLMs on megatron-core in one torchrun program."""
from hybridrl._startup import defer_optional_imports

defer_optional_imports()
