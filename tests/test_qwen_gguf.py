"""The real Qwen2.5-Coder GGUFs from PyPI (0.5B: Q5_0/Q8_0/Q4_K/Q6_K/F32; 1.5B Q4_K_M:
Q4_K/Q6_K/F32) against transformers on the same file (dequantized, float32) as the oracle.

Our engine runs float32 with ``quantization="none"`` (dense, dequantized), the prompts
batched. Greedy tokens must be identical; the log-probabilities of the top-5 tokens at
every step agree within LOGPROB_ATOL = 1e-4 (natural log; measured max |diff| 1.3e-5
on the 0.5B, 4 prompts x 16 tokens, and 1.6e-5 on the 1.5B, 3 prompts x 6 tokens: float32
summation order). The transformers reference runs
first (the prompts left-padded in one batch) and its model is freed before ours loads,
so one float32 copy is in memory at a time. Tokenizers: the same ids as transformers' GGUF tokenizer, the same text after
``skip_special_tokens``, and every control token dropped.
"""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.real_model

LOGPROB_ATOL = 1e-4
TOP_N = 5
TEXT_PROMPTS = {
    "english": "The three most important inventions of the last century are",
    "chinese": "请用中文介绍一下长城的历史。长城",
    "code": "def quicksort(arr):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
}
CHAT = [{"role": "user", "content": "写一个Python函数计算阶乘。"}]
# (fixture name, new tokens per prompt, prompt names): fewer for the slow 1.5B.
MODELS = {"qwen05": ("qwen05_gguf", 16, ("english", "chinese", "code", "chat")),
          "qwen15": ("qwen15_gguf", 6, ("chinese", "code", "chat"))}


def _hf_dir_file(path):
    return os.path.dirname(path), os.path.basename(path)


def _prompt_ids(tokenizer, names):
    from llmserve.tokenizer import apply_chat_template

    ids = {n: tokenizer.encode(t) for n, t in TEXT_PROMPTS.items()}
    ids["chat"] = apply_chat_template(tokenizer, CHAT)
    return {n: ids[n] for n in names}


@pytest.fixture(scope="module")
def hf_tokenizer(qwen05_gguf, gguf_parsed_once):
    from transformers import AutoTokenizer

    d, f = _hf_dir_file(qwen05_gguf)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="module", params=list(MODELS))
def run(request, hf_tokenizer):
    """transformers' greedy reference (tokens, top-N logprobs per step), then our engine's
    batched outputs, for one model; each float32 model lives only while it is used."""
    from transformers import AutoModelForCausalLM

    from llmserve import LLM, SamplingParams

    fixture, new_tokens, names = MODELS[request.param]
    path = request.getfixturevalue(fixture)
    prompts = _prompt_ids(hf_tokenizer, names)
    d, f = _hf_dir_file(path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    width = max(len(ids) for ids in prompts.values())  # one batched call, left-padded
    pad = hf_tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts.values()])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts.values()])
    with torch.inference_mode():
        out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    reference = {
        name: (out.sequences[i, width:].tolist(),
               [torch.log_softmax(step[i].float(), -1) for step in out.logits])
        for i, name in enumerate(prompts)}
    hf_config = hf.config
    del hf, out
    gc.collect()
    llm = LLM(model=path, dtype="float32", quantization="none", kv_cache_memory="128MiB")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=TOP_N)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts.values()], params,
                        use_tqdm=False)
    result = {"name": request.param, "path": path, "prompts": prompts, "reference": reference,
              "outputs": dict(zip(prompts, outs, strict=True)), "hf_config": hf_config,
              "llm": llm}
    yield result
    result.clear()
    gc.collect()


def test_greedy_tokens_and_logprobs_match_transformers(run):
    worst = 0.0
    for name, out in run["outputs"].items():
        ref_tokens, ref_logprobs = run["reference"][name]
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, f"{run['name']} {name}: greedy tokens differ"
        assert len(comp.logprobs) == len(ref_tokens)
        for step, entry in enumerate(comp.logprobs):
            assert len(entry) >= TOP_N and entry[comp.token_ids[step]].rank == 1
            for tid, lp in entry.items():
                diff = abs(lp.logprob - ref_logprobs[step][tid].item())
                worst = max(worst, diff)
                assert diff < LOGPROB_ATOL, (run["name"], name, step, tid, lp.logprob)
        assert "\ufffd" not in comp.text
    print(f"{run['name']}: max |logprob diff| vs transformers {worst:.2e}")


def test_config_matches_transformers(run):
    """Qwen2 mapping: head counts, qkv bias, rope theta and eps from the metadata, untied
    output, vocabulary; EOS from tokenizer.ggml.eos_token_id and the chat template."""
    config, hf = run["llm"].engine.config.model_config, run["hf_config"]
    assert config.architecture == "Qwen2ForCausalLM" and hf.model_type == "qwen2"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings"):
        assert getattr(config, field) == getattr(hf, field), field
    theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert config.rope_theta == theta == 1e6
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps) and config.rms_norm_eps == 1e-6
    assert config.attention_bias and not config.tie_word_embeddings
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.eos_token_ids == (151645,)  # <|im_end|>: eos and the template's end of turn
    assert 151645 in run["llm"].engine.eos_token_ids


@pytest.fixture(scope="module")
def our_tokenizer(qwen05_gguf):
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(qwen05_gguf))


def test_tokenizer_matches_transformers(our_tokenizer, hf_tokenizer):
    ours, hf = our_tokenizer, hf_tokenizer
    texts = [*TEXT_PROMPTS.values(), "混合 mixed 文本 😀 and `code()`\n\tindent",
             "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>"]
    for text in texts:
        assert ours.encode(text) == hf.encode(text), text
    msgs = [{"role": "system", "content": "You are helpful."}, *CHAT]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token == hf.eos_token == "<|im_end|>"


def test_skip_special_tokens_matches_transformers(our_tokenizer, hf_tokenizer):
    """Every token the GGUF marks CONTROL (the 20 of 151643..151664 other than the two
    <tool_call> tags, which are USER_DEFINED) is dropped, on ours as on transformers'."""
    ours, hf = our_tokenizer, hf_tokenizer
    added = list(range(151643, 151665))
    words = ours.encode(" 长城 wall")
    ids = [t for tid in added for t in (tid, *words)]
    kept = ours.decode(ids, skip_special_tokens=True)
    assert kept == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == hf.decode(ids)
    control = [tid for tid in added if tid not in (151657, 151658)]
    for tid in added:
        text = ours.convert_ids_to_tokens(tid)
        assert (text in kept) == (tid not in control), text
    assert {"<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>", "<|im_end|>"} <= {
        ours.convert_ids_to_tokens(t) for t in control}
    assert "<tool_call>" in kept and "长城" in kept
