"""Offline compression tools: ``llmserve eval`` and ``llmserve quantize``.

::

    texts.py       built-in evaluation / calibration texts (English, Chinese, code), token windows
    evaluate.py    perplexity, KL divergence and top-1 agreement through llmserve's own model
    quantizer.py   group-wise integer quantization (RTN) and the per-module result type
    gptq.py        GPTQ (Frantar et al. 2022): Hessian-compensated rounding
    awq.py         AWQ (Lin et al. 2023): activation-aware channel scales and clipping
    smoothquant.py SmoothQuant (Xiao et al. 2022): W8A8 with migrated activation outliers
    pipeline.py    the layer-by-layer calibration loop over a transformers model
    export.py      writers: GPTQ, AWQ (GEMM) and compressed-tensors checkpoints
    cli.py         the ``eval`` and ``quantize`` subcommands

Nothing in the engine imports this package; it imports ``loader``, ``models`` and
``layers`` (to run checkpoints exactly as the engine does) and transformers (to hold
the float model being quantized).
"""
