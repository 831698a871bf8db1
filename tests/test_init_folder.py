"""The random initial model folder (model.path empty) follows the config: a changed seed or size rebuilds it."""
import json
import os

from dist_helper import run_distributed


def _init_weights(root, overrides_list):
    """For each override list: the init folder's config.json and one weight tensor, built in turn."""
    from safetensors.torch import load_file

    from hybridrl.config.io import load_config
    from hybridrl.trainer.roles import init_model_folder

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.yaml")
    out = []
    for overrides in overrides_list:
        cfg = load_config(config, [f"trainer.default_local_dir={root}", *overrides])
        folder = init_model_folder(cfg, 64)
        with open(os.path.join(folder, "config.json")) as f:
            hidden = json.load(f)["hidden_size"]
        weights = load_file(os.path.join(folder, "model.safetensors"))
        out.append((hidden, weights["model.embed_tokens.weight"].clone()))
    return out


def test_init_folder_is_rebuilt_when_seed_or_size_changes(tmp_path):
    (runs,) = run_distributed(_init_weights, 1, str(tmp_path),
                              [["model.seed=1"], ["model.seed=1"], ["model.seed=2"], ["model.seed=2", "model.hidden_size=32"]])
    (h1, w1), (h1b, w1b), (h2, w2), (h3, _) = runs
    assert (w1 == w1b).all()  # same config: the folder is reused as written
    assert not (w1 == w2).all()  # another seed: another init, not the stale folder
    assert (h1, h2, h3) == (64, 64, 32)  # another size: the folder follows the config


def _qwen3_init(root):
    """The init folder of a Qwen3-MoE config with its own head width, and the planner's reading of it."""
    import dataclasses

    from hybridrl.config.io import load_config
    from hybridrl.planner.memory import arch_from_model_config
    from hybridrl.trainer.roles import init_model_folder

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu_moe.yaml")
    cfg = load_config(config, [f"trainer.default_local_dir={root}", "model.head_dim=24", "model.vocab_size=64"])
    folder = init_model_folder(cfg, 64)
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    from_folder = arch_from_model_config(dataclasses.replace(cfg.model, path=folder))
    experts = hf.get("num_experts") or hf["num_local_experts"]  # transformers 5 writes the latter
    return hf["head_dim"], experts, from_folder == arch_from_model_config(cfg.model)


def test_qwen3_head_dim_reaches_the_init_folder(tmp_path):
    """model.head_dim (hidden 64 / 4 heads would be 16) is the folder's, and the planner plans the same model
    from the fields as from the folder."""
    (got,) = run_distributed(_qwen3_init, 1, str(tmp_path))
    assert got == (24, 8, True)


def _built_with_cache(root, cache):
    """Three runs' init folders of one config: the first builds and keeps its build in `cache`, the second copies
    the kept one (a marker file added to it comes along), the third has no cache and builds its own."""
    from hybridrl.config.io import load_config
    from hybridrl.trainer.roles import INIT_CACHE_ENV, init_model_folder

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.yaml")
    folders = []
    for name, env in (("first", cache), ("second", cache), ("alone", "")):
        if name == "second":
            (kept,) = [d for d in os.listdir(cache)]
            open(os.path.join(cache, kept, "marker"), "w").close()
        os.environ[INIT_CACHE_ENV] = env
        folders.append(init_model_folder(load_config(config, [f"trainer.default_local_dir={root}/{name}"]), 64))
    return [{n: open(os.path.join(f, n), "rb").read() for n in sorted(os.listdir(f))} for f in folders]


def test_kept_init_folders_are_copied_and_equal_a_fresh_build(tmp_path):
    first, second, alone = run_distributed(_built_with_cache, 1, str(tmp_path), str(tmp_path / "cache"))[0]
    assert "marker" in second and "marker" not in first  # the second run copied the kept build
    second.pop("marker")
    assert first == second == alone and "model.safetensors" in alone  # byte for byte what a build writes
