"""vLLM adapter without vLLM: the install error, the version check, request/output conversion, weight RPC.

vLLM is not installed here, so these tests check the adapter's own side: what it asks vLLM for
(constructor arguments, one request per sample, stop ids, logprobs_mode) and in which order it calls
vLLM's documented `LLM` methods (sleep / wake_up / collective_rpc / reset_prefix_cache). The fake
`vllm` module and `_FakeLLM` below only record calls; no numerics are taken from them. The adapter's
weight path is also exercised on the real stream in test_reshard.py
(test_vllm_worker_reads_back_its_own_layout).
"""
import json
import sys
import types

import pytest
import torch

from hybridrl.rollout import vllm as vllm_adapter
from hybridrl.rollout.base import SamplingParams, sample_seed


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install -r requirements-gpu\.txt"):
        vllm_adapter.VLLMEngine(spec=None)


@pytest.mark.parametrize("version", ["0.6.3", "0.10.2", "0.25.1", "0.32.1", "0.33.0rc1.dev5"])
def test_old_vllm_is_refused_with_the_version(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    with pytest.raises(ImportError, match=rf"vLLM {version} is older than 0\.33\.0"):
        vllm_adapter.VLLMEngine(spec=None)


@pytest.mark.parametrize("version, warns", [("0.33.0", False), ("0.33.2+cu128", False), ("0.34.0", True),
                                            ("1.0.0", True)])
def test_the_checked_range_passes_and_newer_versions_warn(monkeypatch, version, warns):
    import warnings

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert vllm_adapter.import_vllm().__version__ == version
    assert [str(w.message) for w in caught if "newer than the 0.33" in str(w.message)] != [] if warns else caught == []


def test_requirements_pin_the_range_the_adapter_accepts():
    import pathlib

    pins = [line for line in (pathlib.Path(__file__).parents[1] / "requirements-gpu.txt").read_text().splitlines()
            if line.startswith("vllm")]
    assert pins == ["vllm>=0.33,<0.34"]
    assert vllm_adapter.MIN_VLLM_VERSION[:2] == (0, 33) and vllm_adapter.CHECKED_BELOW[:2] == (0, 34)


class _FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _FakeLLM:
    """Answers every request with three tokens derived from its seed; records calls."""

    def __init__(self, stop=None, logprobs_mode="processed_logprobs"):
        self.requests, self.calls, self.stop = [], [], stop
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(logprobs_mode=logprobs_mode))

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        outs = []
        for prompt, p in zip(prompts, params):
            self.requests.append((prompt["prompt_token_ids"], p))
            ids = [p.seed % 97, len(prompt["prompt_token_ids"]), 5]
            if self.stop in ids:
                ids = ids[:ids.index(self.stop) + 1]
            logprobs = [{t: types.SimpleNamespace(logprob=-0.5 * (k + 1))} for k, t in enumerate(ids)]
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return outs

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "import_vllm", lambda: types.SimpleNamespace(SamplingParams=_FakeSamplingParams))
    return vllm_adapter.VLLMEngine(llm=_FakeLLM(stop=5), pad_id=0, eos_id=(2, 9))


def test_one_request_per_sample_with_its_own_seed(fake_engine):
    sampling = SamplingParams(n=2, temperature=1.0, top_p=0.9, top_k=-1, max_new_tokens=4, stop_token_ids=(7,), seed=3)
    with pytest.warns(UserWarning, match="truncated distribution"):  # top_p < 1
        out = fake_engine.generate([[1, 2, 3], [4]], sampling, prompt_seeds=[10, 20])
    reqs = fake_engine.llm.requests
    assert [r[0] for r in reqs] == [[1, 2, 3], [1, 2, 3], [4], [4]]
    assert [r[1].seed for r in reqs] == [sample_seed(10, 0), sample_seed(10, 1), sample_seed(20, 0), sample_seed(20, 1)]
    p = reqs[0][1]
    assert (p.n, p.logprobs, p.max_tokens, p.top_k, p.top_p, p.detokenize) == (1, 0, 4, 0, 0.9, False)
    assert p.stop_token_ids == [2, 7, 9]  # every eos of the engine joins the caller's stop tokens
    assert out.responses.shape == (4, 4)
    assert out.responses[0].tolist() == [sample_seed(10, 0) % 97, 3, 5, 0]
    assert out.response_mask[0].tolist() == [1, 1, 1, 0]
    assert out.log_probs[0].tolist() == [-0.5, -1.0, -1.5, 0.0]


def test_sleep_wake_and_weight_update_order(fake_engine):
    fake_engine.llm.collective_rpc = lambda fn, args=(): fake_engine.llm.calls.append(("rpc", len(args[0]))) or [{}]
    fake_engine.sleep()
    fake_engine.sleep()  # already asleep: nothing more
    fake_engine.load_weights([("model.norm.weight", torch.ones(2))])  # wakes the weights only
    fake_engine.load_weights([("lm_head.weight", torch.ones(2))])
    fake_engine.wake_up()  # before generate: the rest
    fake_engine.wake_up()
    assert fake_engine.llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("rpc", 1), ("reset_prefix_cache",),
                                     ("rpc", 1), ("reset_prefix_cache",), ("wake_up", ["kv_cache"])]


def test_no_prompts_submits_nothing(fake_engine):
    out = fake_engine.generate([], SamplingParams(n=3, max_new_tokens=5), prompt_seeds=[])
    assert fake_engine.llm.calls == [] and out.responses.shape == (0, 5)


@pytest.mark.parametrize("mode, sampling, warns", [
    ("processed_logprobs", dict(temperature=0.7), None),
    ("processed_logprobs", dict(temperature=1.0, top_p=0.9), "truncated distribution"),
    ("raw_logprobs", dict(temperature=1.0), None),
    ("raw_logprobs", dict(temperature=0.7), "before temperature"),
])
def test_log_prob_semantics_are_stated(monkeypatch, mode, sampling, warns):
    import warnings

    monkeypatch.setattr(vllm_adapter, "import_vllm", lambda: types.SimpleNamespace(SamplingParams=_FakeSamplingParams))
    engine = vllm_adapter.VLLMEngine(llm=_FakeLLM(logprobs_mode=mode), eos_id=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=3, **sampling))
    messages = [str(w.message) for w in caught]
    assert (messages == []) if warns is None else (len(messages) == 1 and warns in messages[0]), messages


class _RecordingLLM:
    """Stands in for vllm.LLM's constructor: records its arguments and the model folder it was given."""
    built = []

    def __init__(self, **kwargs):
        with open(f"{kwargs['model']}/config.json") as f:
            kwargs["config_json"] = f.read()
        _RecordingLLM.built.append(kwargs)


def _build_through_fake_vllm(spec_kwargs, rollout_kwargs):
    import gc
    import os

    from hybridrl.config import RolloutConfig
    from hybridrl.models.gpt import GPTSpec

    sys.modules["vllm"] = types.SimpleNamespace(__version__="0.33.0", LLM=_RecordingLLM)
    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=96, vocab_size=251, **spec_kwargs)
    engine = vllm_adapter.VLLMEngine(spec=spec, cfg=RolloutConfig(name="vllm", gpu_memory_utilization=0.3,
                                                                  **rollout_kwargs))
    kwargs = _RecordingLLM.built[-1]
    folder_existed = os.path.isdir(kwargs["model"])
    del engine
    gc.collect()
    return kwargs, folder_existed, os.path.exists(kwargs["model"])


_MOE = dict(num_experts=4, moe_topk=2, moe_intermediate_size=32, qk_norm=True)


@pytest.mark.distributed
@pytest.mark.parametrize("spec_kwargs, rollout_kwargs", [(dict(qkv_bias=True), {}),
                                                         (_MOE, dict(dtype="float32"))])
def test_engine_arguments_and_temporary_folder(spec_kwargs, rollout_kwargs):
    from dist_helper import run_distributed

    kwargs, existed, exists_after = run_distributed(_build_through_fake_vllm, 1, spec_kwargs, rollout_kwargs)[0]
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert (kwargs["distributed_executor_backend"], kwargs["load_format"]) == ("external_launcher", "dummy")
    assert kwargs["enable_sleep_mode"] and kwargs["skip_tokenizer_init"] and kwargs["gpu_memory_utilization"] == 0.3
    assert existed and not exists_after  # the config-only folder goes with the engine
    # the engine holds rollout.dtype (bf16 by default), said in config.json too; MoE pins the Triton experts
    dtype = rollout_kwargs.get("dtype", "bfloat16")
    assert kwargs["dtype"] == dtype and json.loads(kwargs["config_json"])["dtype"] == dtype
    assert kwargs.get("moe_backend") == ("triton" if spec_kwargs is _MOE else None)


def test_a_weight_dtype_other_than_the_engines_is_refused_at_the_first_bucket(monkeypatch):
    """fp32 weights (model.params_dtype) into a bf16 engine: their fingerprints could never match what vLLM
    stores, so the first bucket stops with the keys to change; with verify off vLLM's loader casts them."""
    from hybridrl.config import ConfigError

    llm = _FakeLLM()
    llm.llm_engine.model_config.dtype = torch.bfloat16
    llm.collective_rpc = lambda fn, args=(): llm.calls.append(("rpc", args[0][0][1].dtype)) or [{}]
    engine = vllm_adapter.VLLMEngine(llm=llm)
    with pytest.raises(ConfigError, match=r"sends float32 .*holding bfloat16 \(rollout.dtype\).*"
                                          r"rollout.dtype=float32 or model.params_dtype=bfloat16"):
        engine.load_weights([("model.norm.weight", torch.ones(2)), ("lm_head.weight", torch.ones(2, 2))],
                            "fingerprint")
    assert llm.calls == []  # refused before anything reached vLLM
    engine.load_weights([("lm_head.weight", torch.ones(2, 2, dtype=torch.bfloat16))], "fingerprint")
    engine.load_weights([("lm_head.weight", torch.ones(2, 2))], "off")
    # a bf16 model of the local spec keeps its norms in fp32: they pass, and are checked as vLLM stores them
    engine.load_weights([("model.norm.weight", torch.ones(2)), ("lm_head.weight", torch.ones(2, 2, dtype=torch.bfloat16))],
                        "fingerprint")
    assert [c for c in llm.calls if c[0] == "rpc"] == [("rpc", torch.bfloat16), ("rpc", torch.float32),
                                                       ("rpc", torch.float32)]


def test_rollout_dtype_is_one_vllm_runs():
    from hybridrl.config import ConfigError, RolloutConfig

    assert RolloutConfig().dtype == "bfloat16"
    with pytest.raises(ConfigError, match="rollout.dtype='fp8' is not one of bfloat16, float16, float32"):
        RolloutConfig(dtype="fp8")


@pytest.mark.parametrize("factor", [0.0, 8.0])
def test_engine_config_carries_both_rope_keys(factor):
    """transformers 5 reads rope_parameters (a non-empty rope_scaling wins over it), transformers 4 reads
    rope_theta + rope_scaling: Llama-3.1 scaling must reach either, equal."""
    import transformers

    from hybridrl.models.gpt import GPTSpec

    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   vocab_size=251, rope_theta=500000.0, rope_scaling_factor=factor)
    folder = vllm_adapter.dummy_model_folder(spec)
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    if factor:
        assert cfg["rope_scaling"] == {k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"}
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == factor
        assert cfg["rope_theta"] == 500000.0  # where transformers 4 takes the base from
    else:
        assert "rope_scaling" in cfg and cfg["rope_scaling"] is None  # transformers 4's "no scaling"
    loaded = transformers.AutoConfig.from_pretrained(folder)
    assert loaded.rope_parameters == cfg["rope_parameters"]


def test_worker_reads_back_its_parameters_not_what_arrived():
    """The worker digests what its model stored (read from its parameters), not the tensors it was given."""
    from hybridrl.models.gpt import GPTSpec
    from hybridrl.placement.fingerprint import weight_checksum, weight_fingerprint

    spec = GPTSpec(num_layers=1, hidden_size=4, num_attention_heads=2, num_key_value_heads=2,
                   intermediate_size=6, vocab_size=3, tie_word_embeddings=False)
    # vLLM holds the norm in bf16 (a local-spec trainer sends it in fp32): the read-back says so
    params = {"model.norm.weight": torch.zeros(4, dtype=torch.bfloat16), "lm_head.weight": torch.zeros(64, 4)}

    def load_weights(weights):  # stores the norm, and the head's rows one too low (a broken loader)
        for name, t in weights:
            if name == "lm_head.weight":
                params[name][1:4].copy_(t)
            else:
                params[name].copy_(t)

    model = types.SimpleNamespace(load_weights=load_weights, named_parameters=lambda: iter(params.items()))
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
    bucket = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.arange(12.0).reshape(3, 4))]
    got = vllm_adapter.load_weights_on_worker(worker, bucket, spec, 1, 0, "fingerprint")
    assert got["model.norm.weight"].region is None and got["model.norm.weight"].dtype == torch.bfloat16
    assert got["model.norm.weight"].digest == weight_fingerprint(torch.arange(4.0).bfloat16())
    assert got["lm_head.weight"].region == (0, 0, 3)  # vocab rows of this rank, padding excluded
    assert got["lm_head.weight"].digest != weight_fingerprint(bucket[1][1])  # what it stored, not what came
    exact = vllm_adapter.load_weights_on_worker(worker, bucket, spec, 1, 0, "exact")
    assert exact["model.norm.weight"].digest == weight_checksum(torch.arange(4.0).bfloat16())
    assert vllm_adapter.load_weights_on_worker(worker, bucket, spec, 1, 0, "off") == {}


def test_dummy_folder_describes_the_spec(tmp_path):
    import json

    from hybridrl.models.gpt import GPTSpec
    from hybridrl.models.hf_config import spec_from_hf_config

    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=96, vocab_size=251, qkv_bias=True)
    folder = vllm_adapter.dummy_model_folder(spec)
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen2" and spec_from_hf_config(cfg) == spec


def test_dummy_folder_names_the_tokenizers_eos_not_the_classes_default():
    """vLLM takes its stop ids from generation_config.json, else from config.json through transformers, whose
    Llama class defaults eos_token_id to 2 (`#` in Llama 3's vocabulary): the folder must name the real ones."""
    from transformers import GenerationConfig

    from hybridrl.models.gpt import GPTSpec

    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   vocab_size=300)
    folder = vllm_adapter.dummy_model_folder(spec, eos_ids=(128001, 128009))
    with open(f"{folder}/config.json") as f:
        assert json.load(f)["model_type"] == "llama"
    assert GenerationConfig.from_pretrained(folder).eos_token_id == [128001, 128009]
    assert GenerationConfig.from_pretrained(vllm_adapter.dummy_model_folder(spec)).eos_token_id is None


# ---- vLLM 0.33's own names and shapes (tests/data/vllm_0_33_names.json, from tests/vllm_033_names.py) --------

def _fixture() -> dict:
    import pathlib

    with open(pathlib.Path(__file__).parent / "data" / "vllm_0_33_names.json") as f:
        return json.load(f)


def _narrow(t, span):
    return t if span is None else t.narrow(span[0], span[1], span[2] - span[1])


class _FixtureModel:
    """One fixture model on one TP rank: the parameters vLLM 0.33 registers (NaN until written) and the copies
    its weight loaders make, as the fixture records them."""

    def __init__(self, case: dict, rank: int):
        self.case, self.rank = case, rank
        self.params = {n: torch.full(shape, float("nan")) for n, shape in case["params"].items()}

    def named_parameters(self):
        return iter(self.params.items())

    def load_weights(self, weights):
        for name, t in weights:
            entry = self.case["loads"][name][self.rank]
            dst = self.params[entry["param"]]
            dst = dst if entry["index"] is None else dst[entry["index"]]
            if entry["zero_rest"]:
                dim, _, stop = entry["into"]
                dst.narrow(dim, stop, dst.shape[dim] - stop).zero_()
            _narrow(dst, entry["into"]).copy_(_narrow(t, entry["src"]))


def _hf_bucket(spec, seed=0):
    from hybridrl.models import hf_convert as hc

    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(shape, generator=g)) for n, shape in hc.hf_shapes(spec).items()]


def _worker(model):
    return types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))


def _read_back_problems(key: str, case: dict) -> list:
    from hybridrl.models.hf_config import spec_from_hf_config
    from hybridrl.placement.fingerprint import hf_region, weight_digest
    from hybridrl.rollout.vllm_layout import stored_slice

    spec, tp, problems = spec_from_hf_config(case["hf_config"]), case["tp"], []
    for rank in range(tp):
        model, bucket = _FixtureModel(case, rank), _hf_bucket(spec, rank)
        if {n for n, _ in bucket} != set(case["loads"]):
            return [f"{key}: the stream's names differ from those vLLM loads"]
        try:
            got = vllm_adapter.load_weights_on_worker(_worker(model), bucket, spec, tp, rank, "exact")
            for name, t in bucket:
                src = case["loads"][name][rank]["src"]
                view, region = stored_slice(name, model.params, spec, tp, rank)
                if region != (None if src is None else tuple(src)) or got[name].region != region:
                    problems.append(f"{key} rank {rank} {name}: region {region}, vLLM loads {src}")
                elif view.shape != _narrow(t, src).shape or not torch.equal(view, _narrow(t, src)):
                    problems.append(f"{key} rank {rank} {name}: read back {tuple(view.shape)} other than it stored")
                elif got[name].digest != weight_digest(hf_region(t, region), "exact"):
                    problems.append(f"{key} rank {rank} {name}: digest of another slice")
        except (KeyError, ValueError) as e:
            problems.append(f"{key} rank {rank}: {type(e).__name__}: {e}")
        unwritten = [n for n, p in model.params.items() if p.isnan().any()]
        if unwritten:  # sleep level 2 discards every parameter: one stream must rewrite all of them
            problems.append(f"{key} rank {rank}: the stream leaves {unwritten[:2]} unwritten")
    return problems


def test_every_name_the_adapter_writes_and_reads_back_resolves_in_vllm_0_33():
    """Qwen2, Qwen3, Llama, Qwen3-MoE, Mixtral (and a tied Qwen2 with one KV head) at TP 1 and 2, on every rank:
    each HF tensor of the stream is read back from the parameter vLLM 0.33 loads it into, at the slice and size
    its loader wrote, and together they rewrite every parameter. The fixture is what its generator derives."""
    import vllm_033_names

    fixture = _fixture()
    assert "0.33.0" in fixture["vllm"] and "Derived by hand from vLLM 0.33.0's source" in fixture["derivation"]
    assert set(fixture["models"]) == {f"{c}/tp{tp}" for c in vllm_033_names.CASES for tp in vllm_033_names.TPS}
    for key, case in fixture["models"].items():
        assert vllm_033_names.derive(case["hf_config"], case["tp"]) == {k: case[k] for k in ("params", "loads")}, key
    problems = [p for key, case in sorted(fixture["models"].items()) for p in _read_back_problems(key, case)]
    assert problems == [], "\n".join(problems[:20])


def test_a_padded_or_reordered_expert_layout_is_refused_not_misread():
    """FlashInfer's TRT-LLM MoE pads each expert's intermediate rows to 128: reading at the spec's offsets would
    digest the wrong rows, so the read-back names the backend to pin instead."""
    from hybridrl.models.hf_config import spec_from_hf_config
    from hybridrl.rollout.vllm_layout import stored_slice

    case = _fixture()["models"]["qwen3_moe/tp1"]
    spec = spec_from_hf_config(case["hf_config"])
    params = {n: torch.zeros(shape) for n, shape in case["params"].items()}
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    params[w13] = torch.zeros(spec.num_experts, 2 * 128, spec.hidden_size)
    with pytest.raises(ValueError, match=r"w13_weight.*\(4, 256, 64\), not \(4, 64, 64\).*moe_backend=triton"):
        stored_slice("model.layers.0.mlp.experts.1.up_proj.weight", params, spec, 1, 0)


def test_the_worker_refuses_expert_weights_of_a_non_triton_backend():
    """The fused parameter's loader belongs to the MoE layer whose quant method names its backend (as NeMo-RL
    reads it); FlashInfer CUTLASS keeps w13 as [up; gate], so streamed weights would land swapped."""
    from hybridrl.models.hf_config import spec_from_hf_config

    case = _fixture()["models"]["mixtral/tp1"]
    spec = spec_from_hf_config(case["hf_config"])
    for backend, refused in (("TRITON", False), ("FLASHINFER_CUTLASS", True)):
        model = _FixtureModel(case, 0)
        owner = types.SimpleNamespace(quant_method=types.SimpleNamespace(
            unquantized_backend=types.SimpleNamespace(name=backend)), load=lambda *a: None)
        model.params["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"].weight_loader = \
            types.MethodType(lambda self, *a: None, owner)
        if refused:
            with pytest.raises(RuntimeError, match="FLASHINFER_CUTLASS MoE backend.*moe_backend='triton'"):
                vllm_adapter.load_weights_on_worker(_worker(model), _hf_bucket(spec), spec, 1, 0, "fingerprint")
        else:
            vllm_adapter.load_weights_on_worker(_worker(model), _hf_bucket(spec), spec, 1, 0, "fingerprint")


class _FixtureLLM(_FakeLLM):
    """_FakeLLM whose worker holds a fixture model: collective_rpc runs the adapter's functions on it."""

    def __init__(self, case):
        super().__init__()
        self.model = _FixtureModel(case, 0)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method.__name__))
        if method is vllm_adapter.process_weights_on_worker:
            return [None]
        return [method(_worker(self.model), *args, **(kwargs or {}))]


def test_sleep_discards_the_weights_and_generate_waits_for_all_of_them_then_processes_once(monkeypatch):
    """Level 2: no host copy of weights the next sync overwrites; a generate before every weight is back is
    refused (it would sample from freed memory); vLLM's post-load step runs once, after the last bucket."""
    from hybridrl.models.hf_config import spec_from_hf_config

    monkeypatch.setattr(vllm_adapter, "import_vllm", lambda: types.SimpleNamespace(SamplingParams=_FakeSamplingParams))
    case = _fixture()["models"]["qwen3_moe/tp1"]
    spec = spec_from_hf_config(case["hf_config"])
    llm = _FixtureLLM(case)
    engine = vllm_adapter.VLLMEngine(spec, llm=llm, eos_id=2)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3)
    assert not engine.needs_weights
    engine.sleep()
    bucket = _hf_bucket(spec)
    engine.load_weights(bucket[:10])
    engine.load_weights(bucket[10:-1])
    engine.wake_up()
    assert engine.needs_weights  # the trainer syncs before generating (tests/test_engine_resync.py)
    with pytest.raises(RuntimeError, match=r"discarded its weights at sleep \(level 2\) and 1 were not streamed in"):
        engine.generate([[1, 2]], sampling)
    engine.load_weights(bucket[-1:])
    assert not engine.needs_weights
    engine.generate([[1, 2]], sampling)
    engine.generate([[3]], sampling)
    rpcs = [c[1] for c in llm.calls if c[0] == "rpc"]
    assert rpcs == ["load_weights_on_worker"] * 3 + ["process_weights_on_worker"]
    assert llm.calls[0] == ("sleep", 2) and [c for c in llm.calls if c[0] == "generate"] == [("generate", 1)] * 2


def test_process_weights_on_worker_calls_vllms_post_load_step(monkeypatch):
    seen = []
    utils = types.SimpleNamespace(process_weights_after_loading=lambda *a: seen.append(a))
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.utils", utils)
    model = torch.nn.Linear(2, 2)
    runner = types.SimpleNamespace(get_model=lambda: model, model="a CUDA-graph wrapper", model_config="cfg")
    vllm_adapter.process_weights_on_worker(types.SimpleNamespace(model_runner=runner))
    assert seen == [(model, "cfg", model.weight.device)]


def test_prompt_and_response_longer_than_the_model_are_refused_before_vllm_starts():
    """vLLM runs at max_model_len = max_prompt_length + max_response_length (verl's), which the model must hold."""
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config
    from hybridrl.models.gpt import GPTSpec
    from hybridrl.trainer.roles import build_rollout

    cfg = load_config("", ["rollout.name=vllm", "data.max_prompt_length=1500", "data.max_response_length=1000"])
    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   vocab_size=251, max_position_embeddings=2048)
    with pytest.raises(ConfigError, match=r"= 2500 is more than the model's max_position_embeddings \(2048\)"):
        build_rollout(cfg, spec, None, types.SimpleNamespace(pad_token_id=0, eos_token_ids=(1,)))


@pytest.mark.parametrize("key", ["rollout.temperature", "rollout.val_kwargs.temperature"])
def test_a_temperature_vllm_would_raise_is_refused(key):
    """vLLM's SamplingParams raises 0 < T < 0.01 to 0.01: the engine would sample (and report log-probs) at
    another temperature than the trainer recomputes them at."""
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config

    with pytest.raises(ConfigError, match=rf"{key}=0.005: vLLM raises temperatures below 0.01"):
        load_config("", ["rollout.name=vllm", f"{key}=0.005", "rollout.val_kwargs.do_sample=true"])
    load_config("", ["rollout.name=native", f"{key}=0.005", "rollout.val_kwargs.do_sample=true"])
