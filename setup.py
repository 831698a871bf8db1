from setuptools import find_packages, setup

setup(
    name="hybridrl",
    version="0.1.0",
    description="PPO/GRPO post-training of LLMs on megatron-core, one torchrun program",
    package_dir={"": "src"},
    packages=find_packages("src"),
    python_requires=">=3.10",
    install_requires=[line.strip() for line in open("requirements.txt")
                      if line.strip() and not line.startswith("#") and not line.startswith("pytest")],
    extras_require={"gpu": ["vllm", "transformer-engine[pytorch]"], "wandb": ["wandb==0.30.0"],
                    # tests/test_lora_export.py loads the exported adapter in peft (peft needs accelerate)
                    "test": ["peft==0.21.0", "accelerate"]},
)
