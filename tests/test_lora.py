"""Multi-LoRA against peft on transformers (fp32, same base weights).

A small random Llama is saved as a safetensors directory (with the default model's
tokenizer); two random PEFT adapters are made with peft and saved: A on all seven
projections (r=8), B on q/v/down only with rsLoRA (r=4). The engine runs the base and
both adapters in ONE batch (small token budget: chunked prefills and decodes share
steps) and must give, request by request, peft's greedy tokens. The prefix cache
never serves a prefix across adapters.
"""

from __future__ import annotations

import pytest
import torch
import transformers

peft = pytest.importorskip("peft")

VOCAB = 4096
NEW_TOKENS = 8
TEXTS = ["The capital of France is",
         "Once upon a time, in a small village at the edge of a dark forest, there lived",
         "def fibonacci(n):\n    a, b ="]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_adapter(base, path, seed: int, **lora_kw) -> None:
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(init_lora_weights=False, **lora_kw)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # large enough to change greedy tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    model.unload()  # restore the base modules in place


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gguf_path):
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(gguf_path))
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=None, bos_token_id=None, eos_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.copy_((1 if "norm" in name else 0) + 0.2 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("lora")
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    _make_adapter(base, root / "A", 1, r=8, lora_alpha=16, target_modules=ALL)
    _make_adapter(base, root / "B", 2, r=4, lora_alpha=8, use_rslora=True,
                  target_modules=["q_proj", "v_proj", "down_proj"])
    prompts = [[t % VOCAB for t in tok.encode(text)] for text in TEXTS]
    base.generation_config.eos_token_id = None

    def greedy(model) -> list[list[int]]:
        outs = []
        with torch.no_grad():
            for ids in prompts:
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False)
                outs.append(out[0, len(ids):].tolist())
        return outs

    ref = {None: greedy(base)}
    for name in "AB":
        adapted = peft.PeftModel.from_pretrained(base, str(root / name)).eval()
        ref[name] = greedy(adapted)
        adapted.unload()
    return root, prompts, ref, tok


def _run(llm, prompts, loras):
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    return outs


def test_base_and_two_adapters_in_one_batch_match_peft(setup):
    from llmserve import LLM
    from llmserve.lora import LoRARequest

    root, prompts, ref, _ = setup
    assert ref["A"] != ref[None] and ref["B"] != ref[None] and ref["A"] != ref["B"]
    reqs = {None: None, "A": LoRARequest("A", 1, str(root / "A")),
            "B": LoRARequest("B", 2, str(root / "B"))}
    # a 16-token budget: prompt chunks and decodes of all three share steps
    llm = LLM(str(root / "base"), dtype="float32", kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=16, enable_lora=True, max_loras=2, max_lora_rank=8)
    order = [(k, i) for i in range(len(prompts)) for k in (None, "A", "B")]
    outs = _run(llm, [prompts[i] for _, i in order], [reqs[k] for k, _ in order])
    got = {(k, i): list(o.outputs[0].token_ids) for (k, i), o in zip(order, outs)}
    for k, i in order:
        assert got[(k, i)] == ref[k][i], (k, i)
    # the same again: every prompt is now in the prefix cache of its own adapter only
    outs = _run(llm, [prompts[i] for _, i in order], [reqs[k] for k, _ in order])
    for (k, i), o in zip(order, outs):
        assert list(o.outputs[0].token_ids) == ref[k][i], ("cached", k, i)
        assert o.num_cached_tokens > 0


def test_prefix_cache_never_crosses_adapters(setup):
    from llmserve import LLM
    from llmserve.lora import LoRARequest

    root, prompts, ref, _ = setup
    a, b = LoRARequest("A", 1, str(root / "A")), LoRARequest("B", 2, str(root / "B"))
    llm = LLM(str(root / "base"), dtype="float32", kv_cache_memory="16MiB", block_size=4,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    long = prompts[1]
    seen = []
    for lora, key in [(None, None), (a, "A"), (b, "B"), (a, "A"), (None, None)]:
        out = _run(llm, [long], [lora])[0]
        assert list(out.outputs[0].token_ids) == ref[key][1], key
        seen.append(out.num_cached_tokens)
    # base, A and B each start cold; A and the base again hit their own prefix
    assert seen[:3] == [0, 0, 0] and seen[3] > 0 and seen[4] > 0


def test_extra_keys_one_function_for_router_and_scheduler():
    from llmserve.kv_cache.prefix_cache import extend_block_hashes, request_extra_keys
    from llmserve.lora import LoRARequest
    from llmserve.router.prefix import prompt_block_hashes
    from llmserve.sampling_params import SamplingParams
    from llmserve.scheduler.request import Request

    ids = list(range(40))
    keys = {request_extra_keys(s, i) for s in (None, "t") for i in (None, 1, 2)}
    assert len(keys) == 6 and request_extra_keys() == b""
    req = Request("r", ids, SamplingParams(), 4, cache_salt="t",
                  lora_request=LoRARequest("x", 2, "/nowhere"))
    assert extend_block_hashes([], ids, 16, req.extra_keys) == \
        prompt_block_hashes(ids, 16, "t", lora_int_id=2)
    assert prompt_block_hashes(ids, 16, "t", 2) != prompt_block_hashes(ids, 16, "t")


def test_scheduler_admits_at_most_max_loras_adapters():
    from llmserve.config import SchedulerConfig
    from llmserve.kv_cache import KVCacheManager
    from llmserve.lora import LoRARequest
    from llmserve.sampling_params import SamplingParams
    from llmserve.scheduler import Request, RequestStatus, Scheduler

    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(cfg, KVCacheManager(64, 4), max_loras=2)
    a, b, c = (LoRARequest(n, i, "/x") for i, n in enumerate("abc", 1))
    for rid, lora in [("1", a), ("2", None), ("3", b), ("4", a), ("5", c), ("6", None)]:
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(), 4, lora_request=lora))
    out = sched.schedule()
    # a and b fill the two slots; c waits (and, FCFS, so does the request behind it)
    assert list(out.num_scheduled_tokens) == ["1", "2", "3", "4"]
    assert [r.lora_request for r in out.scheduled_new_reqs] == [a, None, b, a]
    sched.finish_requests(["3"], RequestStatus.FINISHED_ABORTED)
    assert "5" in sched.schedule().num_scheduled_tokens  # b's slot is free now


def test_bad_adapters_are_clear_errors(setup, tmp_path):
    from llmserve import LLM
    from llmserve.lora import LoRARequest

    root, prompts, _, _ = setup
    with pytest.raises(ValueError, match="enable_lora"):
        base_llm = LLM(str(root / "base"), dtype="float32", kv_cache_memory="8MiB")
        _run(base_llm, prompts[:1], [LoRARequest("A", 1, str(root / "A"))])
    llm = LLM(str(root / "base"), dtype="float32", kv_cache_memory="8MiB",
              enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="max_lora_rank"):
        _run(llm, prompts[:1], [LoRARequest("A", 1, str(root / "A"))])
    with pytest.raises(ValueError, match="not a directory"):
        _run(llm, prompts[:1], [LoRARequest("C", 3, str(tmp_path / "missing"))])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        _run(llm, prompts[:1], [LoRARequest("D", 4, str(tmp_path / "bad"))])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("E", 0, "x")
    # the engine is still fine
    assert len(_run(llm, prompts[:1], [LoRARequest("B", 2, str(root / "B"))])) == 1


# ---------------------------------------------------------------- server, real clients
def test_server_selects_lists_loads_and_unloads_adapters(setup):
    import asyncio

    import httpx
    import openai

    from tests.test_server import start_server, stop_server

    root, prompts, ref, tok = setup
    base = str(root / "base")
    server = start_server("--model", base, "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "8", "--lora-modules", f"A={root / 'A'}",
                          "--allow-runtime-lora-updating", "--block-size", "4")
    try:
        api = server.url + "/v1"
        models = httpx.get(api + "/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(base, None), ("A", base)]
        r = httpx.post(api + "/load_lora_adapter",
                       json={"lora_name": "B", "lora_path": str(root / "B")})
        assert r.status_code == 200, r.text
        assert [m.id for m in openai.OpenAI(base_url=api, api_key="x").models.list()] \
            == [base, "A", "B"]
        greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})

        async def batch():  # base and both adapters at once: they share engine steps
            async with openai.AsyncOpenAI(base_url=api, api_key="x") as client:
                async def one(model, ids):
                    c = await client.completions.create(model=model, prompt=ids, **greedy)
                    return c.model, c.choices[0].text

                jobs = [(m, i) for i in range(len(prompts)) for m in (base, "A", "B")]
                outs = await asyncio.gather(*(one(m, prompts[i]) for m, i in jobs))
            return dict(zip(jobs, outs))

        got = asyncio.run(batch())
        for (m, i), (reported, text) in got.items():
            key = None if m == base else m
            assert reported == m
            assert text == tok.decode(ref[key][i], skip_special_tokens=True), (m, i)

        sync = openai.OpenAI(base_url=api, api_key="x")
        with pytest.raises(openai.NotFoundError) as e:
            sync.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        stream = sync.completions.create(model="B", prompt=prompts[2], stream=True, **greedy)
        assert "".join(c.choices[0].text for c in stream if c.choices) == \
            tok.decode(ref["B"][2], skip_special_tokens=True)
        # loading a taken name or a bad directory is a 400; nothing changes
        assert httpx.post(api + "/load_lora_adapter", json={
            "lora_name": "B", "lora_path": str(root / "A")}).status_code == 400
        bad = httpx.post(api + "/load_lora_adapter", json={
            "lora_name": "C", "lora_path": str(root / "missing")})
        assert bad.status_code == 400 and "not a directory" in bad.json()["error"]["message"]
        # unload A: a 404 for it afterwards, B still served
        assert httpx.post(api + "/unload_lora_adapter",
                          json={"lora_name": "A"}).status_code == 200
        assert httpx.post(api + "/unload_lora_adapter",
                          json={"lora_name": "A"}).status_code == 404
        assert [m["id"] for m in httpx.get(api + "/models").json()["data"]] == [base, "B"]
        with pytest.raises(openai.NotFoundError):
            sync.completions.create(model="A", prompt=prompts[0], max_tokens=2)
        # A again under its name, from B's files: B's tokens, not A's cached prefix
        assert httpx.post(api + "/load_lora_adapter", json={
            "lora_name": "A", "lora_path": str(root / "B")}).status_code == 200
        text = sync.completions.create(model="A", prompt=prompts[1], **greedy).choices[0].text
        assert text == tok.decode(ref["B"][1], skip_special_tokens=True)
    finally:
        assert stop_server(server) == 0


# ---------------------------------------------------------------- quantized base layers
def test_adapter_around_native_gguf_int4_layers(tmp_path):
    """A tiny GGUF (Q4_0/Q4_1/Q8_0) run natively by the int4 kernels, with a peft adapter:
    float32 native + adapter equals dequantized dense + adapter (the dense path is
    peft's above) in a prefill and in decode steps (the CPU decode fast path);
    bfloat16 native (the default format) within its rounding."""
    from llmserve.layers.quantization.gguf_native import GGUFNativeConfig, GGUFNativeLinearMethod
    from llmserve.loader.source import ModelSource
    from llmserve.lora import LoRARequest
    from llmserve.lora.manager import LoRAModelManager
    from tests.test_quant_gguf_models import load_model, sequence_logits, write_tiny_gguf

    source = ModelSource("gguf", write_tiny_gguf(tmp_path / "tiny.gguf"), "tiny")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2)
    _make_adapter(transformers.LlamaForCausalLM(cfg), tmp_path / "ad", 5, r=4, lora_alpha=8,
                  target_modules=ALL)
    lora = LoRARequest("ad", 1, str(tmp_path / "ad"))
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(model, chunk: int, manager=None) -> torch.Tensor:
        if manager is None:
            return sequence_logits(model, ids, chunk)
        orig = model.forward

        def forward(input_ids, positions, kv, md):  # each step: all rows use the adapter
            manager.prepare_step([(lora, input_ids.shape[0])], md.num_decodes)
            return orig(input_ids, positions, kv, md)

        model.forward = forward
        try:
            return sequence_logits(model, ids, chunk)
        finally:
            model.forward = orig

    dense = load_model(source, None, torch.float32)
    base_ref = run(dense, 20)
    ref = run(dense, 20, LoRAModelManager(dense, 1, 4))
    assert (ref - base_ref).abs().max() > 0.1  # the adapter matters
    native = load_model(source, GGUFNativeConfig(torch.float32), torch.float32)
    manager = LoRAModelManager(native, 1, 4)
    assert isinstance(native.model.layers[0].self_attn.qkv_proj.quant_method,
                      GGUFNativeLinearMethod)
    for chunk in (20, 1):
        torch.testing.assert_close(run(native, chunk, manager), ref, rtol=0, atol=1e-4)
    bf16 = load_model(source, GGUFNativeConfig(torch.bfloat16), torch.bfloat16)
    got = run(bf16, 1, LoRAModelManager(bf16, 1, 4, dtype=torch.bfloat16))
    # bf16 activations: a few percent off in norm, the same next token almost everywhere
    assert (got - ref).norm() < 0.05 * ref.norm()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_data_parallel_front_loads_adapters_on_every_replica_and_pins_batches(
        setup, tmp_path):
    """`--data-parallel-size 2`: a load through the front reaches both replicas (each
    answers peft's tokens for the adapter when asked directly), a refused load leaves
    none behind, unload removes it everywhere; the Batch API through the front runs on
    replica 0, the only one with --batch-dir."""
    import io
    import json
    import time

    import httpx
    import openai

    from tests.test_server import start_server, stop_server

    root, prompts, ref, tok = setup
    base = str(root / "base")
    batch_dir = tmp_path / "batches"
    server = start_server("--model", base, "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "8", "--allow-runtime-lora-updating",
                          "--block-size", "4", "--data-parallel-size", "2",
                          "--batch-dir", str(batch_dir))
    try:
        api = server.url + "/v1"
        replicas = [w["url"] for w in httpx.get(server.url + "/workers").json()["workers"]]
        assert len(replicas) == 2

        def served(url: str) -> list[str]:
            return [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]

        r = httpx.post(api + "/load_lora_adapter",
                       json={"lora_name": "B", "lora_path": str(root / "B")})
        assert r.status_code == 200, r.text
        greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
        for url in replicas:  # each replica itself serves B with peft's tokens
            assert served(url) == [base, "B"]
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            text = c.completions.create(model="B", prompt=prompts[0], **greedy).choices[0].text
            assert text == tok.decode(ref["B"][0], skip_special_tokens=True), url
        front = openai.OpenAI(base_url=api, api_key="x", max_retries=0)  # routed by model
        assert [m.id for m in front.models.list()] == [base, "B"]
        text = front.completions.create(model="B", prompt=prompts[1], **greedy).choices[0].text
        assert text == tok.decode(ref["B"][1], skip_special_tokens=True)
        bad = httpx.post(api + "/load_lora_adapter",
                         json={"lora_name": "C", "lora_path": str(root / "missing")})
        assert bad.status_code == 400, bad.text
        assert "replica dp0" in bad.json()["error"]["message"]
        assert "not a directory" in bad.json()["error"]["message"]
        assert all("C" not in served(url) for url in replicas)
        assert httpx.post(api + "/unload_lora_adapter",
                          json={"lora_name": "B"}).status_code == 200
        assert all(served(url) == [base] for url in replicas)
        assert httpx.post(api + "/unload_lora_adapter",
                          json={"lora_name": "B"}).status_code == 404

        c = openai.OpenAI(base_url=api, api_key="x", timeout=120, max_retries=0)
        body = [json.dumps({"custom_id": f"t{i}", "method": "POST", "url": "/v1/completions",
                            "body": {"model": base, "prompt": prompts[i], "ignore_eos": True,
                                     "max_tokens": NEW_TOKENS, "temperature": 0}})
                for i in range(2)]
        f = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(body).encode()),
                                 "application/jsonl"), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")
        deadline = time.monotonic() + 120
        while (b := c.batches.retrieve(b.id)).status != "completed":
            assert b.status in ("validating", "in_progress", "finalizing"), b
            assert time.monotonic() < deadline, b
            time.sleep(0.2)
        out = {x["custom_id"]: x["response"]["body"]["choices"][0]["text"]
               for x in map(json.loads, c.files.content(b.output_file_id).text.splitlines())}
        assert out == {f"t{i}": tok.decode(ref[None][i], skip_special_tokens=True)
                       for i in range(2)}
        assert f.id in [x.id for x in c.files.list()]
        assert any(f.id in p.name for p in batch_dir.rglob("*"))  # replica 0's store
    finally:
        assert stop_server(server) == 0
