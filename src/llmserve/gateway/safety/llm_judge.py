"""LLM-judge check: ask a served model with a Llama-Guard-style prompt.

Sends the text inside the Llama Guard 3 prompt (categories S1-S14, as in Meta's
model card, https://huggingface.co/meta-llama/Llama-Guard-3-8B) to an
OpenAI-compatible ``POST {url}/chat/completions`` (httpx, temperature 0) and
parses the reply: first line ``safe`` or ``unsafe``, then a comma-separated list
of category codes (``S1,S10``). Verdict category ``judge.S1`` etc.; ``detail`` the
category names. No model is downloaded: the judge is whatever the URL serves.

Options (policy entry): ``url`` (base URL ending in ``/v1``; required), ``model``
(default ``"default"``), ``api_key``, ``timeout`` (seconds, default 10),
``max_tokens`` (default 16), ``on_error`` (``flag`` | ``block`` | ``allow``; what an
unreachable judge or an unparseable answer yields, default ``flag``),
``role`` (``User`` for prompts, ``Agent`` for responses).

Streaming: the judge is asked at :meth:`scan` ``final=True`` only; with
``hold: true`` the moderator holds the whole response until then, otherwise the
text flows and a late ``unsafe`` still ends the stream with ``content_filter``.
"""

from __future__ import annotations

import regex

from llmserve.gateway.safety.base import (
    CheckConfig,
    InputCheck,
    ScanResult,
    Verdict,
    register_check,
)

LLAMA_GUARD_CATEGORIES = {
    "S1": "Violent Crimes", "S2": "Non-Violent Crimes", "S3": "Sex-Related Crimes",
    "S4": "Child Sexual Exploitation", "S5": "Defamation", "S6": "Specialized Advice",
    "S7": "Privacy", "S8": "Intellectual Property", "S9": "Indiscriminate Weapons",
    "S10": "Hate", "S11": "Suicide & Self-Harm", "S12": "Sexual Content", "S13": "Elections",
    "S14": "Code Interpreter Abuse",
}

PROMPT = """Task: Check if there is unsafe content in '{role}' messages in conversations according our safety policy with the below categories.

<BEGIN UNSAFE CONTENT CATEGORIES>
{categories}
<END UNSAFE CONTENT CATEGORIES>

<BEGIN CONVERSATION>

{role}: {text}

<END CONVERSATION>

Provide your safety assessment for ONLY THE LAST {role} message in the above conversation:
 - First line must read 'safe' or 'unsafe'.
 - If unsafe, a second line must include a comma-separated list of violated categories."""


def build_prompt(text: str, role: str = "User") -> str:
    cats = "\n".join(f"{k}: {v}." for k, v in LLAMA_GUARD_CATEGORIES.items())
    return PROMPT.format(role=role, categories=cats, text=text)


def parse_judgement(reply: str) -> tuple[bool, list[str]] | None:
    """``'safe'`` -> (True, []); ``'unsafe\\nS1,S10'`` -> (False, ['S1', 'S10']); else None."""
    lines = [ln.strip() for ln in (reply or "").strip().splitlines() if ln.strip()]
    if not lines:
        return None
    first = lines[0].lower().rstrip(".")
    if first == "safe":
        return True, []
    if first == "unsafe":
        rest = " ".join(lines[1:])
        return False, list(dict.fromkeys(regex.findall(r"\bS(?:1[0-4]|[1-9])\b", rest)))
    return None


@register_check
class LLMJudgeCheck(InputCheck):
    """Asks a served model whether the text is safe (Llama Guard prompt and answer format)."""

    name = "llm_judge"

    def __init__(self, config: CheckConfig | None = None):
        super().__init__(config)
        o = self.config.options
        self.url = o.get("url")
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError("llm_judge check needs 'url', an http(s) base URL such as "
                             "http://127.0.0.1:8000/v1")
        self.url = self.url.rstrip("/")
        self.model = o.get("model", "default")
        self.api_key = o.get("api_key")
        self.timeout = float(o.get("timeout", 10.0))
        self.max_tokens = int(o.get("max_tokens", 16))
        self.role = o.get("role", "User")
        self.hold = bool(o.get("hold", False))
        self.on_error = o.get("on_error", "flag")
        if self.on_error not in ("flag", "block", "allow"):
            raise ValueError(f"llm_judge 'on_error' must be flag|block|allow, got {self.on_error!r}")

    def ask(self, text: str) -> str:
        """The judge model's raw reply. Raises httpx.HTTPError / KeyError on failure."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": build_prompt(text, self.role)}]}
        r = httpx.post(f"{self.url}/chat/completions", json=body, headers=headers,
                       timeout=self.timeout)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"] or ""

    def check(self, text: str) -> list[Verdict]:
        import httpx

        try:
            reply = self.ask(text)
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
            return self._error(f"judge request failed: {type(e).__name__}: {e}")
        parsed = parse_judgement(reply)
        if parsed is None:
            return self._error(f"unparseable judge reply {reply[:80]!r}")
        safe, codes = parsed
        if safe:
            return []
        codes = [c for c in codes or ["S0"] if self.config.wants(c)]
        return [self.verdict(f"judge.{c}", detail=LLAMA_GUARD_CATEGORIES.get(c, "unspecified"))
                for c in codes]

    def _error(self, detail: str) -> list[Verdict]:
        if self.on_error == "allow":
            return []
        return [Verdict(self.name, "judge.error", self.on_error, (), 0.0, detail)]

    def scan(self, text: str, pos: int = 0, final: bool = False) -> ScanResult:
        if not final:
            return ScanResult([], pos if self.hold else len(text))
        return ScanResult(self.check(text[pos:]), len(text))
