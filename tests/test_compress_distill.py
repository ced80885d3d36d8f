"""``llmserve distill`` on tiny random Llamas built in transformers (vocab 128, hidden 64).

Oracles: the KL formulas written out here (``F.kl_div`` / explicit sums over
probabilities), transformers forward passes for the held-out KL and greedy tokens, and
the teacher's own tensors for the layer-dropped student.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from llmserve import LLM, SamplingParams
from llmserve.compress.distill import (
    HiddenProjection,
    blackbox_samples,
    distill_loss,
    drop_every_other_layer,
    hidden_loss,
    token_divergence,
)
from llmserve.compress.distill_train import (
    DistillOptions,
    distill,
    mean_kl,
)
from llmserve.entrypoints.cli import main
from tests.quant_checkpoints import hf_greedy, save_tokenizer

VOCAB = 128
SEQ = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: OpenMP wake-ups dominate on 2 loaded cores
    yield
    torch.set_num_threads(threads)


def make_llama(layers: int = 4, vocab: int = VOCAB, seed: int = 0, **extra):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def _words(ids) -> str:
    return " ".join(f"t{int(t)}" for t in ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Teacher directory, the teacher, training / eval text files, held-out windows."""
    root = tmp_path_factory.mktemp("distill")
    teacher = make_llama()
    path = str(root / "teacher")
    teacher.save_pretrained(path)
    save_tokenizer(path, VOCAB)
    rng = np.random.default_rng(0)
    train = root / "train.txt"
    train.write_text(_words(rng.integers(0, VOCAB, SEQ * 400)))
    evaltext = root / "eval.txt"  # the report's text, apart from training and held-out
    evaltext.write_text(_words(rng.integers(0, VOCAB, 400)))
    held = [rng.integers(0, VOCAB, SEQ).tolist() for _ in range(8)]
    return {"root": root, "teacher_dir": path, "teacher": teacher, "data": str(train),
            "eval": str(evaltext), "held": held}


def _opts(tiny, out: str, **kw) -> DistillOptions:
    base = dict(teacher=tiny["teacher_dir"], output=str(tiny["root"] / out), steps=300,
                student_from_teacher="drop every other layer", data=tiny["data"],
                seq_len=SEQ, batch_size=8, lr=3e-3, evaluate=False, progress=False,
                eval_text=tiny["eval"])
    base.update(kw)
    return DistillOptions(**base)


# ---- losses against the formulas ----------------------------------------------------------

def _logits(seed: int, shape=(2, 5, 11)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(shape, generator=g), 3 * torch.randn(shape, generator=g)


@pytest.mark.parametrize("tau", [1.0, 2.0, 0.5])
def test_losses_equal_formulas(tau):
    s, t = _logits(1)
    ls, lt = F.log_softmax(s / tau, -1), F.log_softmax(t / tau, -1)
    n = s.shape[0] * s.shape[1]
    fkl = tau ** 2 * F.kl_div(ls.reshape(n, -1), lt.reshape(n, -1), log_target=True,
                              reduction="batchmean")
    rkl = tau ** 2 * F.kl_div(lt.reshape(n, -1), ls.reshape(n, -1), log_target=True,
                              reduction="batchmean")
    assert torch.allclose(distill_loss(s, t, "fkl", tau), fkl, rtol=1e-5)
    assert torch.allclose(distill_loss(s, t, "rkl", tau), rkl, rtol=1e-5)
    ps, pt = ls.exp().double(), lt.exp().double()
    assert math.isclose(float(distill_loss(s, t, "fkl", tau)),
                        tau ** 2 * float((pt * (pt.log() - ps.log())).sum(-1).mean()),
                        rel_tol=1e-5)
    for beta in (0.1, 0.5, 0.9):  # GKD generalized JSD, from probabilities
        m = beta * pt + (1 - beta) * ps
        jsd = beta * (pt * (pt / m).log()).sum(-1) + (1 - beta) * (ps * (ps / m).log()).sum(-1)
        assert math.isclose(float(distill_loss(s, t, "jsd", tau, beta)),
                            tau ** 2 * float(jsd.mean()), rel_tol=1e-5)
    sym = distill_loss(s, t, "jsd", tau, 0.5)  # beta 0.5: symmetric in student / teacher
    assert torch.allclose(sym, distill_loss(t, s, "jsd", tau, 0.5), rtol=1e-5)
    mask = torch.tensor([[True, False, True, True, False], [False] * 4 + [True]])
    div = token_divergence(s, t, "fkl", tau)
    assert torch.allclose(distill_loss(s, t, "fkl", tau, mask=mask), tau ** 2 * div[mask].mean())


def test_jsd_limits():
    s, t = (x.double() for x in _logits(2))
    fkl, rkl = token_divergence(s, t, "fkl"), token_divergence(s, t, "rkl")
    assert torch.equal(token_divergence(s, t, "jsd", beta=0.0), fkl)
    assert torch.equal(token_divergence(s, t, "jsd", beta=1.0), rkl)
    eps = 1e-9  # JSD_b / b -> KL(T || S) as b -> 0, JSD_b / (1 - b) -> KL(S || T) as b -> 1
    assert torch.allclose(token_divergence(s, t, "jsd", beta=eps) / eps, fkl, rtol=1e-3)
    assert torch.allclose(token_divergence(s, t, "jsd", beta=1 - eps) / eps, rkl, rtol=1e-3)
    assert float(token_divergence(s, s, "jsd").abs().max()) < 1e-6


def test_hidden_loss_and_projection():
    g = torch.Generator().manual_seed(3)
    hs = tuple(torch.randn(2, 4, 8, generator=g) for _ in range(3))   # 2 student layers
    ht = tuple(torch.randn(2, 4, 16, generator=g) for _ in range(5))  # 4 teacher layers
    proj = HiddenProjection(8, 16)
    want = ((proj(hs[1]) - ht[2]).pow(2).mean() + (proj(hs[2]) - ht[4]).pow(2).mean()) / 2
    assert torch.allclose(hidden_loss(hs, ht, proj), want)


# ---- training -----------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd"])
def test_distillation_lowers_kl_on_held_out_tokens(tiny, loss):
    o = _opts(tiny, f"out-{loss}", loss=loss, temperature=2.0 if loss == "fkl" else 1.0,
              evaluate=loss == "fkl")
    student0 = drop_every_other_layer(tiny["teacher"])
    before = mean_kl(student0, tiny["teacher"], tiny["held"])
    result = distill(o)
    student = transformers.AutoModelForCausalLM.from_pretrained(o.output).eval()
    after = mean_kl(student, tiny["teacher"], tiny["held"])
    assert after < 0.75 * before, (loss, before, after)  # measured: 2.54 -> 1.4-1.6 nats
    assert len(result.loss_history) == 300
    assert np.mean(result.loss_history[-20:]) < 0.7 * np.mean(result.loss_history[:20])
    if o.evaluate:  # the report: llmserve eval of the student against the teacher
        assert result.after["kl_mean"] < 0.8 * result.before["kl_mean"]
        assert result.after["perplexity"] < result.before["perplexity"]
        with open(os.path.join(o.output, "distill.json")) as f:
            assert json.load(f)["after"]["kl_mean"] == result.after["kl_mean"]


def test_resume_reproduces_the_loss_curve(tiny, monkeypatch):
    import llmserve.compress.distill_train as train_mod

    kw = dict(steps=12, save_every=5, grad_accum=2, batch_size=3, hidden_loss_weight=0.5,
              loss="jsd", jsd_beta=0.3)
    full = distill(_opts(tiny, "resume-full", **kw))
    calls = []
    real = train_mod.micro_loss

    def killed_in_step_9(*args):
        calls.append(1)
        if len(calls) == 17:
            raise KeyboardInterrupt  # as Ctrl-C in step 9: the checkpoint is from step 5
        return real(*args)

    monkeypatch.setattr(train_mod, "micro_loss", killed_in_step_9)
    with pytest.raises(KeyboardInterrupt):
        distill(_opts(tiny, "resume-part", **kw))
    calls.clear()
    monkeypatch.setattr(train_mod, "micro_loss", lambda *a: calls.append(1) or real(*a))
    resumed = distill(_opts(tiny, "resume-part", **kw, resume=True))
    assert len(calls) == (12 - 5) * 2  # it did continue: 7 steps of 2 micro-batches
    assert resumed.loss_history == full.loss_history  # bitwise
    a = transformers.AutoModelForCausalLM.from_pretrained(full.output).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(resumed.output).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    calls.clear()  # a finished run of as many steps is reused; more steps extend it
    assert distill(_opts(tiny, "resume-part", **kw, resume=True)).loss_history == \
        full.loss_history and not calls
    longer = distill(_opts(tiny, "resume-part", **{**kw, "steps": 14}, resume=True))
    assert longer.loss_history[:12] == full.loss_history and len(calls) == 2 * 2
    with pytest.raises(ValueError, match="--lr"):
        distill(_opts(tiny, "resume-part", **{**kw, "steps": 20, "lr": 1e-3}, resume=True))


def test_drop_every_other_layer_copies_the_teacher():
    for layers, tied in ((4, False), (5, True)):
        teacher = make_llama(layers, tie_word_embeddings=tied)
        student = drop_every_other_layer(teacher)
        kept = list(range(0, layers, 2))
        assert student.config.num_hidden_layers == len(student.model.layers) == len(kept)
        assert teacher.config.num_hidden_layers == len(teacher.model.layers) == layers
        t, s = teacher.state_dict(), student.state_dict()
        for new, old in enumerate(kept):
            for name, w in student.model.layers[new].state_dict().items():
                assert torch.equal(w, t[f"model.layers.{old}.{name}"])
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            assert torch.equal(s[name], t[name])
            assert s[name].data_ptr() != t[name].data_ptr()  # a copy, not shared
        assert (student.lm_head.weight is student.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("tied", [False, True])
def test_written_student_loads_in_llmserve(tiny, tied):
    teacher = tiny["teacher_dir"]
    if tied:  # as SmolLM2: the LM head is the embedding (not written twice)
        teacher = str(tiny["root"] / "teacher-tied")
        make_llama(4, tie_word_embeddings=True).save_pretrained(teacher)
        save_tokenizer(teacher, VOCAB)
    o = _opts(tiny, f"loads-{tied}", steps=5, teacher=teacher)
    distill(o)
    with open(os.path.join(o.output, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 2
    assert any(n.endswith(".safetensors") for n in os.listdir(o.output))
    hf = transformers.AutoModelForCausalLM.from_pretrained(o.output, dtype=torch.float32).eval()
    if tied:
        assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    prompts = [[5, 17, 99, 3, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [64]]
    llm = LLM(model=o.output, dtype="float32", kv_cache_memory="8MiB", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(x.outputs[0].token_ids) for x in outs] == hf_greedy(hf, prompts, 10)


def test_blackbox_trains_on_teacher_text(tiny, tmp_path):
    prompts = tmp_path / "prompts.txt"
    rng = np.random.default_rng(5)
    prompts.write_text("\n".join(_words(rng.integers(0, VOCAB, 6)) for _ in range(24)))
    o = _opts(tiny, "blackbox", mode="blackbox", data=str(prompts), steps=60, seq_len=16)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["teacher_dir"])
    samples = blackbox_samples(tiny["teacher"], tok, o)
    assert len(samples) == 24 and all(len(ids) == 16 and start == 6 for ids, start in samples)
    ids, start = samples[0]
    assert ids[start:] == hf_greedy(tiny["teacher"], [ids[:start]], 16 - start)[0]
    result = distill(o)
    assert np.mean(result.loss_history[-10:]) < 0.7 * np.mean(result.loss_history[:10])


def test_step_by_step_chain_and_cli(tiny, capsys):
    out = str(tiny["root"] / "chain")
    rc = main(["distill", "--teacher", tiny["teacher_dir"], "--via", "drop every other layer",
               "--student-from-teacher", "drop every other layer", "--data", tiny["data"],
               "--steps", "3", "--seq-len", str(SEQ), "--output", out, "--no-progress",
               "--eval-text", tiny["eval"], "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["output"] for s in result["stages"]] == [os.path.join(out, "stage-1"), out]
    assert result["stages"][1]["teacher"] == os.path.join(out, "stage-1")
    for path, layers in ((os.path.join(out, "stage-1"), 2), (out, 1)):
        with open(os.path.join(path, "config.json")) as f:
            assert json.load(f)["num_hidden_layers"] == layers
    assert result["after"]["vs_teacher"]["kl_mean"] > 0
    assert result["before"]["kl_mean"] > 0


# ---- bad input ----------------------------------------------------------------------------

def test_bad_inputs(tiny, capsys):
    bad = [(dict(steps=0), "--steps"), (dict(loss="kl"), "--loss"),
           (dict(temperature=0.0), "--temperature"), (dict(teacher=None), "--teacher"),
           (dict(jsd_beta=1.5), "--jsd-beta"), (dict(mode="greybox"), "--mode"),
           (dict(teacher=str(tiny["root"] / "missing")), "--teacher"),
           (dict(student_from_teacher="keep every layer"), "--student-from-teacher"),
           (dict(via=("keep every layer",)), "--via"), (dict(batch_size=0), "--batch-size")]
    small_vocab = str(tiny["root"] / "vocab96")
    make_llama(2, vocab=96).save_pretrained(small_vocab)
    save_tokenizer(small_vocab, 96)
    bad.append((dict(student=small_vocab, student_from_teacher=None), "--student"))
    for kw, flag in bad:
        with pytest.raises(ValueError, match=flag):
            distill(_opts(tiny, "bad", **kw))
    assert not os.path.exists(tiny["root"] / "bad" / "config.json")
    base = ["distill", "--teacher", tiny["teacher_dir"], "--output", str(tiny["root"] / "bad"),
            "--student-from-teacher", "drop every other layer", "--no-progress"]
    for extra, flag in ((["--steps", "0"], "--steps"), (["--steps", "2", "--loss", "x"], "--loss"),
                        (["--steps", "2", "--temperature", "-1"], "--temperature"),
                        (["--steps", "2", "--student", small_vocab], "not allowed with")):
        rc = main(base + extra) if flag != "not allowed with" else None
        if rc is None:
            with pytest.raises(SystemExit) as e:  # argparse: mutually exclusive flags
                main(base + extra)
            assert e.value.code == 2
        else:
            assert rc == 2
        assert flag in capsys.readouterr().err
    rc = main(["distill", "--output", "x", "--steps", "2", "--student-from-teacher",
               "drop every other layer"])
    assert rc == 2 and "--teacher" in capsys.readouterr().err
