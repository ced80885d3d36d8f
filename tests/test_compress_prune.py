"""``llmserve prune``: the masks counted in the written tensors, each method's output
error on one layer with known inputs (oracle: the dense layer's output), the written
checkpoint against transformers on the same directory, Wanda against magnitude in
perplexity on the default model, and the errors of bad input."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.compress.gptq import GPTQ
from llmserve.compress.pipeline import GROUPS
from llmserve.compress.prune import (
    PruneOptions,
    prune_magnitude,
    prune_model,
    prune_sparsegpt,
    prune_wanda,
)
from llmserve.compress.prune_cli import prune_checkpoint
from llmserve.entrypoints.cli import main
from tests.quant_checkpoints import hf_greedy, save_tokenizer
from tests.test_compress_distill import make_llama as _make_llama

VOCAB = 128


def make_llama():
    return _make_llama(layers=2, vocab=VOCAB)


def linears(model):
    for layer in model.model.layers:
        for names, _ in GROUPS:
            for name in names:
                yield name, layer.get_submodule(name).weight


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune")
    path = str(root / "dense")
    make_llama().save_pretrained(path)
    save_tokenizer(path, VOCAB)
    rng = np.random.default_rng(0)
    calib = root / "calib.txt"
    calib.write_text(" ".join(f"t{int(t)}" for t in rng.integers(0, VOCAB, 2000)))
    return root, path, str(calib)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_masks_two_of_four_and_unstructured_fraction(method):
    calib = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    for pattern in ("2:4", "unstructured"):
        model = make_llama()
        sparsity = 0.5 if pattern == "2:4" else 0.6
        prune_model(model, PruneOptions(method, pattern, sparsity), calib, progress=False)
        for name, w in linears(model):
            zeros = (w == 0).reshape(w.shape[0], -1, 4).sum(-1) if pattern == "2:4" else None
            if pattern == "2:4":  # along the input dimension, every group of 4
                assert torch.all(zeros == 2), (method, name)
            else:
                assert abs((w == 0).float().mean().item() - sparsity) < 0.01, (method, name)


def test_layer_output_error_sparsegpt_below_wanda_below_magnitude():
    """One linear, inputs with uneven channel scales: ``||X W^T - X W_pruned^T||``."""
    g = torch.Generator().manual_seed(0)
    n, k, m = 64, 256, 2048
    x = torch.randn(m, k, generator=g) * (torch.rand(k, generator=g) * 3 + 0.1)
    w = torch.randn(n, k, generator=g)
    h = GPTQ(k)
    h.add_batch(x)
    sq = (x.double() ** 2).sum(0).float()
    for pattern in ("2:4", "unstructured"):
        err = {name: ((x @ (p - w).T) ** 2).mean().item() for name, p in (
            ("magnitude", prune_magnitude(w, pattern, 0.5)),
            ("wanda", prune_wanda(w, sq, pattern, 0.5)),
            ("sparsegpt", prune_sparsegpt(w, h, pattern, 0.5)))}
        assert err["sparsegpt"] < err["wanda"] < 0.7 * err["magnitude"], (pattern, err)


def test_written_checkpoint_loads_in_transformers_and_llmserve(tiny_dir):
    root, dense, calib = tiny_dir
    out = str(root / "wanda24")
    report = prune_checkpoint(dense, PruneOptions("wanda", "2:4"), out, calib=calib,
                              num_samples=4, seq_len=32, progress=False, evaluate=False)
    assert report["sparsity"] == pytest.approx(0.5, abs=1e-3)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)["sparsity_config"]
    assert (cfg["format"], cfg["sparsity_structure"]) == ("dense", "2:4")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert all(torch.all((w == 0).reshape(w.shape[0], -1, 4).sum(-1) == 2)
               for _, w in linears(hf))
    prompts = [[5, 17, 99, 3, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    llm = LLM(model=out, dtype="float32", kv_cache_memory="8MiB", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)


@pytest.mark.model
def test_wanda_beats_magnitude_in_perplexity_on_the_default_model(tmp_path, gguf_parsed_once):
    """2:4 on SmolLM2-135M, 4 calibration windows of 128 tokens of the built-in
    calibration text; perplexity by ``llmserve eval --quick`` on the written checkpoints
    (the built-in evaluation text, apart from the calibration text)."""
    from llmserve.compress.evaluate import evaluate
    from llmserve.compress.hf_dir import save_hf_dir
    from llmserve.compress.quantize import calibration_ids, load_float_model

    net, tok, _ = load_float_model("smollm2-135m-instruct")
    calib = calibration_ids(tok, None, 4, 128)
    ppl = {"dense": evaluate("smollm2-135m-instruct", quick=True).perplexity}
    for method in ("magnitude", "wanda"):
        model = copy.deepcopy(net)
        prune_model(model, PruneOptions(method, "2:4"), calib, progress=False)
        out = save_hf_dir(model, tok, str(tmp_path / method))
        del model
        ppl[method] = evaluate(out, quick=True).perplexity
    print(f"[prune] 2:4 perplexity on the default model: {ppl}")
    assert ppl["dense"] < ppl["wanda"] < 0.5 * ppl["magnitude"], ppl


def test_bad_inputs_name_the_flag(tiny_dir, tmp_path, capsys):
    root, dense, _ = tiny_dir
    short = tmp_path / "short.txt"
    short.write_text("t1 t2 t3")
    for args, want in (
        (["--sparsity", "1.5", "--pattern", "unstructured"], "--sparsity must be in (0, 1)"),
        (["--sparsity", "0.6"], "--sparsity must be 0.5 with --pattern 2:4"),
        (["--method", "obs"], "--method must be one of"),
        (["--pattern", "4:8"], "--pattern must be one of"),
        (["--calib", str(short)], "--calib"),
    ):
        assert main(["prune", dense, "--output", str(tmp_path / "o"), "--no-eval",
                     "--no-progress", *args]) == 2, args
        assert want in capsys.readouterr().err, args


def test_sparse_fine_tuning_recovers_kl_and_keeps_the_mask(tiny_dir):
    """Prune (Wanda 2:4), then ``llmserve distill --keep-sparsity`` from the dense model:
    the zeros stay exactly where pruning put them, the KL to the dense teacher on
    held-out tokens drops, and without the flag the same run refills the zeros."""
    from llmserve.compress.distill_train import DistillOptions, distill, mean_kl

    root, dense, calib = tiny_dir
    pruned = str(root / "ft-pruned")
    prune_checkpoint(dense, PruneOptions("wanda", "2:4"), pruned, calib=calib,
                     num_samples=4, seq_len=32, evaluate=False, progress=False)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(dense).eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(pruned).eval()
    rng = np.random.default_rng(5)
    held = [rng.integers(0, VOCAB, 32).tolist() for _ in range(6)]
    before = mean_kl(start, teacher, held)
    runs = {}
    for keep in (True, False):
        o = DistillOptions(teacher=dense, student=pruned, output=str(root / f"ft-{keep}"),
                           steps=150, data=calib, seq_len=32, batch_size=8, lr=3e-3,
                           evaluate=False, progress=False, keep_sparsity=keep)
        distill(o)
        runs[keep] = transformers.AutoModelForCausalLM.from_pretrained(o.output).eval()
    after = mean_kl(runs[True], teacher, held)
    assert after < 0.8 * before, (before, after)
    for (name, w0), (_, w1), (_, w2) in zip(linears(start), linears(runs[True]),
                                            linears(runs[False]), strict=True):
        assert torch.equal(w1 == 0, w0 == 0), name  # the mask held
        assert (w2 == 0).float().mean() < 0.1, name  # without it: refilled
    with open(os.path.join(str(root / "ft-True"), "config.json")) as f:
        assert json.load(f)["sparsity_config"]["sparsity_structure"] == "2:4"
    with pytest.raises(ValueError, match="--keep-sparsity: the student's linears hold no"):
        distill(DistillOptions(teacher=dense, student=dense, output=str(root / "ft-dense"),
                               steps=1, data=calib, seq_len=32, evaluate=False,
                               progress=False, keep_sparsity=True))
    print(f"sparse fine-tuning (tiny, wanda 2:4, 150 steps): KL {before:.3f} -> {after:.3f}")
