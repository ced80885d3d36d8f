"""``llmserve quantize advise`` on the default model, quick mode, two levels.

Real measurements (our quantizer, ``llmserve eval``'s metrics, our engine), checked
against each other and the SLA: a loose SLA picks the level with the least memory, a
bound between the two levels' perplexity increases picks the one under it, an
impossible one reports that nothing meets it (exit 1); the second run reads the cache.
"""

from __future__ import annotations

import json
import os

import pytest

from llmserve.compress.advise import SCHEMA
from llmserve.entrypoints.cli import main

pytestmark = pytest.mark.model
LEVELS = "source,rtn-w4-g64,rtn-w4-g128"  # g128 does not divide 576: a skipped row


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("advise-cache"))
    old = os.environ.get("LLMSERVE_ADVISE_CACHE")
    os.environ["LLMSERVE_ADVISE_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("LLMSERVE_ADVISE_CACHE")
    else:
        os.environ["LLMSERVE_ADVISE_CACHE"] = old


def _advise(gguf_path, capsys, *extra):
    rc = main(["quantize", "advise", gguf_path, "--quick", "--levels", LEVELS, "--json",
               *extra])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err  # stdout: the JSON only


def test_advise_quick_picks_by_sla_and_caches(gguf_path, cache, capsys, tmp_path):
    rc, first, err = _advise(gguf_path, capsys, "--max-kl", "10")
    assert rc == 0, err
    rows = {r["level"]: r for r in first["rows"]}
    assert "does not divide" in rows["rtn-w4-g128"]["skipped"]
    src, rtn = rows["source"], rows["rtn-w4-g64"]
    assert not src["cached"] and not rtn["cached"] and "measuring rtn-w4-g64" in err
    assert src["kl_mean"] == 0 and src["top1_agreement"] == 1  # the reference itself
    assert 0 < rtn["kl_mean"] < 10 and rtn["perplexity"] > 0
    assert rtn["reference_perplexity"] == pytest.approx(src["perplexity"], rel=1e-6)
    for r in (src, rtn):
        assert r["decode_tok_s"] > 0 and r["batch_tok_s"] > 0 and r["disk_bytes"] > 0
    # loose SLA: the least memory wins
    smallest = min((src, rtn), key=lambda r: r["memory_bytes"])["level"]
    assert first["chosen"] == smallest

    # a bound between the two: only the source (ppl +0 %) meets it; cached, no measuring
    bound = rtn["ppl_increase"] / 2
    rc, second, err = _advise(gguf_path, capsys, "--max-ppl-increase", str(bound))
    assert rc == 0 and "measuring" not in err
    assert all(r["cached"] for r in second["rows"] if not r.get("skipped"))
    assert second["chosen"] == "source"
    assert [r["perplexity"] for r in second["rows"] if "perplexity" in r] == \
        [src["perplexity"], rtn["perplexity"]]
    files = [f for _, _, fs in os.walk(cache) for f in fs]
    assert sorted(files) == [f"rtn-w4-g64.quick.v{SCHEMA}.json", f"source.quick.v{SCHEMA}.json"]

    # --kv-dtypes measures the chosen level (cached: quantized again), not the source
    rc, third, err = _advise(gguf_path, capsys, "--max-kl", "10", "--kv-dtypes", "auto,int8")
    assert rc == 0 and third["chosen"] == smallest and "chosen:" in err
    kv = {r["kv_cache_dtype"]: r for r in third["kv_dtypes"]}
    chosen_row = rows[smallest]
    assert all(r["memory_bytes"] == chosen_row["memory_bytes"] for r in kv.values())
    assert kv["int8"]["kv_bytes_per_token"] < kv["auto"]["kv_bytes_per_token"]

    # impossible: nothing meets it, exit code 1, the table still printed
    rc = main(["quantize", "advise", gguf_path, "--quick", "--levels", LEVELS,
               "--min-tokens-per-s", "1e12"])
    out = capsys.readouterr()
    assert rc == 1 and "no level meets the SLA" in out.err
    assert "rtn-w4-g64" in out.out and "tok/s < 1e+12" in out.out

    # the chosen checkpoint is written where asked (the only level: cached, made anew)
    rc = main(["quantize", "advise", gguf_path, "--quick", "--levels", "rtn-w4-g64",
               "--output", str(tmp_path / "chosen")])
    out = capsys.readouterr()
    assert rc == 0 and "wrote" in out.out, out.err
    assert os.path.isfile(tmp_path / "chosen" / "config.json")


@pytest.mark.parametrize("extra,message", [
    (["--max-kl", "0.1", "--max-ppl-increase", "5"], "not allowed with argument"),
    (["--max-kl", "-1"], "--max-kl must be a non-negative number"),
    (["--max-ppl-increase", "nan"], "--max-ppl-increase must be a non-negative number"),
    (["--min-tokens-per-s", "-3"], "--min-tokens-per-s must be a non-negative"),
    (["--max-memory", "lots"], "--max-memory must be a size"),
    (["--levels", "rtn-w3-g64"], "unknown level 'rtn-w3-g64'"),
    (["--levels", "awq-w8-g64"], "--bits 8 is not supported by --method awq"),
])
def test_advise_bad_input_is_a_clear_error(gguf_path, capsys, extra, message):
    argv = ["quantize", "advise", gguf_path, "--quick", *extra]
    if "not allowed" in message:  # argparse's mutually exclusive group
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    else:
        assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_calibration_windows_fit_the_builtin_text(gguf_path):
    """Asking for more calibration windows than the built-in text holds under the
    model's tokenizer gives as many as it holds (logged); the quantizer then finds them
    all, and one more is the quantizer's own clear error."""
    from llmserve.compress.advise import Settings, fit_calibration
    from llmserve.compress.quantize import calibration_ids
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    source = resolve_model(gguf_path)
    lines: list[str] = []
    full = Settings.of(False)
    assert fit_calibration(full, source, lines.append) == full and not lines  # 16 x 256 fit
    fitted = fit_calibration(Settings("full", 10_000, 256, 512, 3, 64, 16), source,
                             lines.append)
    assert 16 <= fitted.calib_samples < 10_000 and len(lines) == 1
    assert f"{fitted.calib_samples} calibration windows of 256" in lines[0]
    tokenizer = load_tokenizer(source)
    assert calibration_ids(tokenizer, None, fitted.calib_samples, 256).shape == (
        fitted.calib_samples, 256)
    with pytest.raises(ValueError, match="too few for"):
        calibration_ids(tokenizer, None, fitted.calib_samples + 1, 256)
