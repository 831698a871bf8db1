"""hybridrl: PPO and GRPO post-training of LLMs on megatron-core in one torchrun program."""
from hybridrl._startup import defer_compile_at_megatron_import, defer_optional_imports

defer_optional_imports()
defer_compile_at_megatron_import()
