"""xgrammar vs llguidance on the default model's vocabulary (SmolLM2, 49152 tokens):
tokenizer setup, grammar compile time, and the per-token costs along a valid output:
filling the allowed-token bitmask, and advancing the matcher by the token (the engine
applies the mask with its own torch code, ``llmserve.layers.sampler.apply_token_bitmask``,
the same for both, so it is timed once). Both libraries run their Rust / C++ code on the
CPU. Needs ``pip install llguidance`` (not a dependency of llmserve).

    PYTHONPATH=src python benchmarks/grammar_libs.py

Prints one table; the choice made in ``llmserve/structured_output`` cites it.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
    "additionalProperties": False,
}
SAMPLE = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org",
          "tags": ["math", "poetry"], "address": {"street": "1 St James Sq",
                                                 "city": "London", "zip": "12345"},
          "status": "active"}


def load_tokenizer():
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer as load

    return load(resolve_model(None))


def bench_xgrammar(tok, vocab_size, ids, schema_str):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema_str, any_whitespace=False, separators=(",", ":"))
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_builtin_json_grammar()
    t_json = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    fill, advance = [], []
    for tid in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        t1 = time.perf_counter()
        assert matcher.accept_token(tid), tid
        fill.append(t1 - t0)
        advance.append(time.perf_counter() - t1)
    return t_setup, t_compile, t_json, fill, advance


def bench_llguidance(tok, vocab_size, ids, schema_str):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema_str, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}'))
    t_json = time.perf_counter() - t0
    bitmask = lltorch.allocate_token_bitmask(1, vocab_size)
    fill, advance = [], []
    for tid in ids:
        t0 = time.perf_counter()
        lltorch.fill_next_token_bitmask(matcher, bitmask, 0)
        t1 = time.perf_counter()
        assert matcher.consume_token(tid), (tid, matcher.get_error())
        fill.append(t1 - t0)
        advance.append(time.perf_counter() - t1)
    return t_setup, t_compile, t_json, fill, advance


def main() -> None:
    tok = load_tokenizer()
    vocab_size = 49152
    ids = tok.encode(json.dumps(SAMPLE, separators=(",", ":")), add_special_tokens=False)
    schema_str = json.dumps(SCHEMA)
    print(f"vocab {vocab_size}, {len(ids)} output tokens, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'library':<12} {'setup ms':>9} {'schema compile ms':>18} {'json_object ms':>15} "
          f"{'fill us p50':>12} {'fill us p90':>12} {'advance us p50':>15}")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        setup, comp, js, fill, advance = fn(tok, vocab_size, ids, schema_str)
        fill_us = sorted(p * 1e6 for p in fill)
        print(f"{name:<12} {setup * 1e3:9.1f} {comp * 1e3:18.1f} {js * 1e3:15.1f} "
              f"{statistics.median(fill_us):12.1f} {fill_us[int(0.9 * len(fill_us))]:12.1f} "
              f"{statistics.median(advance) * 1e6:15.1f}")
    from llmserve.layers.sampler import apply_token_bitmask

    logits = torch.randn(1, vocab_size)
    mask = torch.full((1, (vocab_size + 31) // 32), 0x0F0F0F0F, dtype=torch.int32)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        apply_token_bitmask(logits, mask)
        times.append(time.perf_counter() - t0)
    print(f"apply (llmserve's torch code, either library's mask): "
          f"{statistics.median(times) * 1e6:.1f} us per row")


if __name__ == "__main__":
    main()
