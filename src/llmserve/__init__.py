"""llmserve: an LLM inference engine with a paged KV cache and continuous batching."""

from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `import llmserve` stays light
    if name == "LLM":
        from llmserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "__version__"]
