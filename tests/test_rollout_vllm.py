"""vLLM adapter without vLLM: the install error, the version check, request/output conversion, weight RPC.

vLLM is not installed here, so these tests check the adapter's own side: what it asks vLLM for
(constructor arguments, one request per sample, stop ids, logprobs_mode) and in which order it calls
vLLM's documented `LLM` methods (sleep / wake_up / collective_rpc / reset_prefix_cache). The fake
`vllm` module and `_FakeLLM` below only record calls; no numerics are taken from them. The adapter's
weight path is also exercised on the real stream in test_reshard.py
(test_vllm_worker_reads_back_its_own_layout).
"""
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


@pytest.mark.parametrize("version", ["0.6.3", "0.9.2", "0.10.0rc1.dev5"])
def test_old_vllm_is_refused_with_the_version(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    with pytest.raises(ImportError, match=rf"vLLM {version} is older than 0\.10\.0"):
        vllm_adapter.VLLMEngine(spec=None)


@pytest.mark.parametrize("version", ["0.10.0", "0.10.2+cu128", "0.11.1", "1.0.0"])
def test_supported_versions_pass_the_check(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    assert vllm_adapter.import_vllm().__version__ == version


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
    assert (p.n, p.logprobs, p.max_tokens, p.top_k, p.top_p, p.detokenize) == (1, 0, 4, -1, 0.9, False)
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
    assert fake_engine.llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("rpc", 1), ("reset_prefix_cache",),
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


def _build_through_fake_vllm(version):
    import gc
    import os

    from hybridrl.config import RolloutConfig
    from hybridrl.models.gpt import GPTSpec

    sys.modules["vllm"] = types.SimpleNamespace(__version__=version, LLM=_RecordingLLM)
    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=96, vocab_size=251, qkv_bias=True)
    engine = vllm_adapter.VLLMEngine(spec=spec, cfg=RolloutConfig(name="vllm", gpu_memory_utilization=0.3))
    kwargs = _RecordingLLM.built[-1]
    folder_existed = os.path.isdir(kwargs["model"])
    del engine
    gc.collect()
    return {k: v for k, v in kwargs.items() if k != "config_json"}, folder_existed, os.path.exists(kwargs["model"])


@pytest.mark.distributed
@pytest.mark.parametrize("version, mode", [("0.10.2", "processed_logprobs"), ("0.10.1", None)])
def test_engine_arguments_and_temporary_folder(version, mode):
    from dist_helper import run_distributed

    kwargs, existed, exists_after = run_distributed(_build_through_fake_vllm, 1, version)[0]
    assert kwargs.get("logprobs_mode") == mode
    assert (kwargs["distributed_executor_backend"], kwargs["load_format"]) == ("external_launcher", "dummy")
    assert kwargs["enable_sleep_mode"] and kwargs["skip_tokenizer_init"] and kwargs["gpu_memory_utilization"] == 0.3
    assert existed and not exists_after  # the config-only folder goes with the engine


def test_worker_reads_back_its_parameters_not_what_arrived():
    """The worker digests what its model stored (read from its parameters), not the tensors it was given."""
    from hybridrl.models.gpt import GPTSpec
    from hybridrl.placement.fingerprint import weight_checksum, weight_fingerprint

    spec = GPTSpec(num_layers=1, hidden_size=4, num_attention_heads=2, num_key_value_heads=2,
                   intermediate_size=6, vocab_size=3, tie_word_embeddings=False)
    params = {"model.norm.weight": torch.zeros(4), "lm_head.weight": torch.zeros(64, 4)}

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
    assert got["model.norm.weight"].region is None
    assert got["model.norm.weight"].digest == weight_fingerprint(torch.arange(4.0))
    assert got["lm_head.weight"].region == (0, 0, 3)  # vocab rows of this rank, padding excluded
    assert got["lm_head.weight"].digest != weight_fingerprint(bucket[1][1])  # what it stored, not what came
    exact = vllm_adapter.load_weights_on_worker(worker, bucket, spec, 1, 0, "exact")
    assert exact["model.norm.weight"].digest == weight_checksum(torch.arange(4.0))
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
