"""Built-in texts (written for this project, Apache-2.0 like the code) and token windows.

``data/eval_*.txt`` and ``data/calib_*.txt`` share no passage: evaluation never sees
calibration text. Sets: ``en`` (English prose), ``zh`` (Chinese prose), ``code``
(Python, C, JavaScript, SQL) and ``all`` (the three, concatenated in that order).
"""

from __future__ import annotations

import os

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
DATASETS = ("all", "en", "zh", "code")


def builtin_text(kind: str, name: str = "all") -> str:
    """The built-in ``kind`` (``"eval"`` or ``"calib"``) text of set ``name``.

    Raises:
        ValueError: an unknown kind or set name.
    """
    if kind not in ("eval", "calib"):
        raise ValueError(f"text kind must be 'eval' or 'calib', got {kind!r}")
    if name not in DATASETS:
        raise ValueError(f"--dataset must be one of {list(DATASETS)}, got {name!r}")
    parts = ("en", "zh", "code") if name == "all" else (name,)
    texts = []
    for part in parts:
        with open(os.path.join(DATA_DIR, f"{kind}_{part}.txt"), encoding="utf-8") as f:
            texts.append(f.read())
    return "\n\n".join(texts)


def read_text_file(path: str, field: str = "--text") -> str:
    """The UTF-8 text of ``path``.

    Raises:
        ValueError: the file is missing, unreadable, not UTF-8 or empty (naming ``field``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{field} {path!r}: cannot read a UTF-8 text file: {e}") from None
    if not text.strip():
        raise ValueError(f"{field} {path!r} is empty")
    return text


def token_windows(token_ids: list[int], seq_len: int, num_windows: int | None = None,
                  field: str = "text", bos_token_id: int | None = None) -> list[list[int]]:
    """Cut ``token_ids`` into consecutive non-overlapping windows of ``seq_len`` tokens.

    With ``bos_token_id`` each window starts with it (then ``seq_len - 1`` text tokens),
    as a model sees a fresh document. ``num_windows`` None takes every full window (at
    least one; a shorter text gives one short window of all its tokens).

    Raises:
        ValueError: ``seq_len < 2``; fewer than ``num_windows * seq_len`` tokens (the
            message says how many there are and how many are needed).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    step = seq_len - (bos_token_id is not None)
    if num_windows is None:
        n = max(1, len(token_ids) // step)
    else:
        if num_windows < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_windows}")
        n = num_windows
        if len(token_ids) < n * step:
            raise ValueError(f"{field} has {len(token_ids)} tokens, too few for {n} samples "
                             f"of {seq_len} tokens (needs {n * step}); pass a longer file, "
                             "fewer --num-samples or a shorter --seq-len")
    if len(token_ids) < 2:
        raise ValueError(f"{field} has {len(token_ids)} tokens; at least 2 are needed")
    prefix = [] if bos_token_id is None else [bos_token_id]
    return [prefix + token_ids[i * step:(i + 1) * step] for i in range(n)]
