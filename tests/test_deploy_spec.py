"""The deployment spec alone (no processes but the CLI's): pydantic validation with
errors that name the field and its line, cross-field checks, the serving-plane
import rule, and `llmserve up` refusing a bad spec before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from llmserve.deploy.spec import SpecError, parse_spec

HASH = "sha256$00$" + "0" * 64
GOOD = textwrap.dedent(f"""\
    name: demo
    models:
      - name: smollm2
        worker: {{max_num_seqs: 8, kv_cache_memory: 128MiB}}
        replicas: {{min: 1, max: 2}}
    gateway:
      teams: {{research: {{rpm: 600}}}}
      keys:
        - {{id: ci, team: research, role: member, key_hash: "{HASH}"}}
    """)


def errors(text: str) -> list[tuple[str, int, str]]:
    with pytest.raises(SpecError) as e:
        parse_spec(text, "llmserve.yaml")
    from llmserve.deploy.spec import dotted

    return [(dotted(loc), line, msg) for loc, line, msg in e.value.errors]


def test_good_spec_and_defaults():
    spec = parse_spec(GOOD)
    m = spec.models[0]
    assert (m.name, m.source, m.worker.tp, m.worker.max_num_seqs) == \
        ("smollm2", "smollm2-135m-instruct", 1, 8)
    assert (m.replicas.min, m.replicas.max) == (1, 2)
    assert spec.router.policy == "cache_aware" and spec.redis.url is None
    assert spec.gateway.keys[0].role == "member"
    assert spec.autoscaling.stable_window_s == 60 and spec.autoscaling.panic_window_s == 6
    gw = spec.gateway.gateway_yaml()
    assert gw["keys"][0]["key_hash"] == HASH and gw["teams"]["research"]["rpm"] == 600


def test_unknown_field_names_field_and_line():
    text = GOOD.replace("max_num_seqs: 8,", "max_num_seqs: 8, max_num_sqes: 4,")
    assert errors(text) == [("models[0].worker.max_num_sqes", 4, "unknown field")]
    top = GOOD + "replica: 3\n"
    assert errors(top) == [("replica", 10, "unknown field")]


def test_tp_must_divide_heads():
    # the default model has 9 attention heads and 3 KV heads
    text = GOOD.replace("max_num_seqs: 8,", "tp: 2, max_num_seqs: 8,")
    (loc, line, msg), = errors(text)
    assert (loc, line) == ("models[0].worker.tp", 4) and "9 attention heads" in msg
    parse_spec(GOOD.replace("max_num_seqs: 8,", "tp: 3, max_num_seqs: 8,"))  # 3 divides 9
    # a registry source cannot tell; the spec may say
    reg = GOOD.replace("worker: {", "source: registry://big@1\n    num_attention_heads: 64\n"
                                    "    num_key_value_heads: 8\n    worker: {tp: 12, ")
    (loc, line, msg), = errors(reg)
    assert loc == "models[0].worker.tp" and line == 7 and "64 attention heads" in msg


def test_key_with_unknown_role_or_team():
    text = GOOD.replace("role: member", "role: superuser")
    (loc, line, msg), = errors(text)
    assert (loc, line) == ("gateway.keys[0].role", 9) and "'admin', 'member' or 'viewer'" in msg
    (loc, line, msg), = errors(GOOD.replace("team: research,", "team: nope,"))
    assert (loc, line) == ("gateway.keys[0].team", 9) and "unknown team 'nope'" in msg


def test_min_replicas_above_max_and_several_errors_at_once():
    text = GOOD.replace("{min: 1, max: 2}", "{min: 3, max: 2}").replace(
        "max_num_seqs: 8", "max_num_seqs: 0")
    got = errors(text)
    assert [(loc, line) for loc, line, _ in got] == [("models[0].worker.max_num_seqs", 4)]
    (loc, line, msg), = errors(GOOD.replace("{min: 1, max: 2}", "{min: 3, max: 2}"))
    assert (loc, line) == ("models[0].replicas.min", 5) and "min (3) is larger than max (2)" \
        in msg


def test_bad_values_and_yaml():
    (loc, _, msg), = errors(GOOD.replace("kv_cache_memory: 128MiB", "kv_cache_memory: lots"))
    assert loc == "models[0].worker.kv_cache_memory" and "4GiB" in msg
    (loc, _, _), = errors(GOOD.replace("name: demo", "name: Demo_1"))
    assert loc == "name"
    (loc, line, _), = errors(GOOD + "autoscaling: {interval_s: -1}\n")
    assert (loc, line) == ("autoscaling.interval_s", 10)
    (loc, _, msg), = errors(GOOD.replace("max_num_seqs: 8,", "max_num_batched_tokens: -5,"))
    assert loc == "models[0].worker.max_num_batched_tokens" and "greater than 0" in msg
    with pytest.raises(ValueError, match=r"llmserve.yaml:4: not valid YAML"):
        parse_spec("name: a\nmodels:\n  - [\n", "llmserve.yaml")
    with pytest.raises(ValueError, match="duplicate key 'name'"):
        parse_spec("name: a\nname: b\n", "llmserve.yaml")


def test_deploy_and_registry_import_neither_torch_nor_engine():
    code = ("import sys\nimport llmserve.deploy.cli, llmserve.deploy.spec, "
            "llmserve.deploy.local\nimport llmserve.entrypoints.cli as c\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
            "       or m.startswith('llmserve.engine')]\nassert not bad, bad\n")
    for extra in ("llmserve.deploy.kubernetes", "llmserve.deploy.autoscaler",
                  "llmserve.registry.store", "llmserve.registry.cli"):
        try:
            __import__(extra)
        except ModuleNotFoundError:
            continue
        code = f"import {extra}\n" + code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def test_up_refuses_bad_spec_before_starting(tmp_path):
    bad = tmp_path / "llmserve.yaml"
    bad.write_text(GOOD.replace("role: member", "role: root"))
    state = tmp_path / "state"
    out = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "up", str(bad),
                          "--state-dir", str(state)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"{bad}:9: gateway.keys[0].role" in out.stderr
    assert not os.path.exists(state)  # nothing started, nothing written


TWO = textwrap.dedent(f"""\
    name: duo
    models:
      - name: chat
        worker: {{max_num_seqs: 8, kv_cache_memory: 128MiB, kv_store: true}}
      - name: chat-small
        speculative: {{method: ngram, num_speculative_tokens: 3, prompt_lookup_min: 1}}
        worker: {{max_num_seqs: 4}}
        replicas: {{min: 1, max: 3}}
    gateway:
      teams: {{research: {{models: [chat]}}}}
      keys:
        - {{id: ci, team: research, role: member, key_hash: "{HASH}", models: [chat]}}
    """)


def test_two_models_and_what_must_agree():
    spec = parse_spec(TWO)
    assert [m.name for m in spec.models] == ["chat", "chat-small"]
    assert spec.model_named("chat-small").replicas.max == 3 and spec.block_size == 16
    dup = TWO.replace("name: chat-small", "name: chat")
    (loc, line, msg), = errors(dup)
    assert (loc, line) == ("models[1].name", 5) and "repeats models[0].name" in msg
    bs = TWO.replace("max_num_seqs: 4}", "max_num_seqs: 4, block_size: 32}")
    (loc, line, msg), = errors(bs)
    assert (loc, line) == ("models[1].worker.block_size", 7) and "--block-size" in msg
    got = errors(TWO.replace("{research: {models: [chat]}}", "{research: {models: [chat-big]}}")
                 .replace('models: [chat]}', 'models: [chat, nope]}'))
    assert [(loc, line) for loc, line, _ in got] == [("gateway.teams.research.models", 10),
                                                     ("gateway.keys[0].models", 12)]
    assert "unknown model(s) ['chat-big']" in got[0][2] and "['nope']" in got[1][2]
    draft = TWO.replace("method: ngram, num_speculative_tokens: 3, prompt_lookup_min: 1",
                        "method: draft_model, draft_model: /m.gguf").replace(
        "max_num_seqs: 4}", "max_num_seqs: 4, kv_store: true}")
    (loc, _, msg), = errors(draft)
    assert loc == "models[1].worker.kv_store" and "draft model" in msg
    (loc, _, _), = errors(TWO.replace("prompt_lookup_min: 1", "draft_model: x"))
    assert loc == "models[1].speculative.draft_model"


TIERS = """\
    router:
      tiers:
        auto:
          levels: [{model: chat-small, max_score: 0.35}, {model: chat}]
    """


def test_router_tiers_are_checked_against_the_models():
    spec = parse_spec(TWO + textwrap.dedent(TIERS))
    assert spec.router.router_yaml() == {"tiers": {"auto": {"levels": [
        {"model": "chat-small", "max_score": 0.35}, {"model": "chat"}]}}}
    assert "--config" not in parse_spec(TWO).router.cli_args(16, "h", 1, None)
    (loc, line, msg), = errors(TWO + textwrap.dedent(TIERS).replace("model: chat}", "model: big}"))
    assert (loc, line) == ("router.tiers.auto.levels[1].model", 16) and "'big'" in msg
    (loc, _, msg), = errors(TWO + textwrap.dedent(TIERS).replace("auto:", "chat:"))
    assert loc == "router.tiers.chat" and "also a model name" in msg
    (loc, _, msg), = errors(TWO + textwrap.dedent(TIERS).replace("max_score: 0.35", "max_score: 2"))
    assert loc == "router.tiers" and "max_score" in msg
    limited = (TWO + textwrap.dedent(TIERS)).replace("{research: {models: [chat]}}", "{research: {models: [auto]}}")
    assert parse_spec(limited).gateway.teams["research"].models == ["auto"]  # an alias is ok


def test_worker_args_pass_speculative_config_and_kv_store():
    """The flags parse with the real `llmserve serve` parser, and the JSON is what the
    engine's own SpeculativeConfig accepts (the oracle: its validation)."""
    from llmserve.deploy.worker_args import worker_args
    from llmserve.entrypoints.cli import build_parser
    from llmserve.spec_decode.config import SpeculativeConfig

    spec = parse_spec(TWO)
    chat, small = spec.models
    parser = build_parser()
    a = parser.parse_args(["serve", *worker_args(chat, None, "unix:///tmp/r.sock")])
    assert (a.kv_store, a.speculative_config, a.served_model_name) == \
        ("unix:///tmp/r.sock", None, ["chat"])
    assert "--kv-store" not in worker_args(chat)  # no Redis URL: nothing to pass
    b = parser.parse_args(["serve", *worker_args(small, None, "unix:///tmp/r.sock")])
    assert b.kv_store is None and b.served_model_name == ["chat-small"]
    cfg = SpeculativeConfig.from_value(b.speculative_config)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
            cfg.prompt_lookup_max) == ("ngram", 3, 1, 1)


def test_worker_args_pass_parallel_sizes():
    """tp/pp/dp/ep reach `llmserve serve` with vLLM's flag names (parsed by the real CLI,
    and the engine's ParallelConfig accepts them for the default model's 9 heads); a
    pp spec with what pipeline stages cannot run is refused naming the field."""
    from llmserve.config import ParallelConfig
    from llmserve.deploy.worker_args import worker_args
    from llmserve.entrypoints.cli import build_parser

    spec = parse_spec(GOOD.replace("max_num_seqs: 8,", "tp: 3, pp: 2, dp: 2, ep: 2, "
                                                      "max_num_seqs: 8,"))
    a = build_parser().parse_args(["serve", *worker_args(spec.models[0])])
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.data_parallel_size,
            a.enable_expert_parallel) == (3, 2, 2, True)
    ParallelConfig(tensor_parallel_size=3, pipeline_parallel_size=2)
    one = build_parser().parse_args(["serve", *worker_args(parse_spec(GOOD).models[0])])
    assert (one.tensor_parallel_size, one.pipeline_parallel_size, one.data_parallel_size,
            one.enable_expert_parallel) == (1, 1, 1, False)
    [(loc, line, msg)] = errors(GOOD.replace("max_num_seqs: 8,",
                                             "pp: 2, kv_store: true, max_num_seqs: 8,"))
    assert loc == "models[0].worker.kv_store" and line == 4 and "worker.pp 2" in msg
