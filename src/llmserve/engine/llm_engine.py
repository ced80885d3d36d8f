"""LLMEngine: tokenizer + scheduler + model runner + output processor, stepped
synchronously. ``LLM`` (offline) and the async server wrap it."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from llmserve.config import EngineConfig
from llmserve.distributed.multiproc import RankFailedError
from llmserve.engine.arg_utils import EngineArgs
from llmserve.engine.kv_store_io import build_kv_store, write_new_blocks
from llmserve.engine.output_processor import OutputProcessor, ParentRequest, RequestOutputKind
from llmserve.engine.request_checks import check_params_for_engine
from llmserve.kv_cache import KVCacheManager
from llmserve.kv_cache.window_blocks import WindowBlocks
from llmserve.loader import (
    load_model_config,
    resolve_model,
)
from llmserve.lora import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.planner.ledger import kv_cache_bytes_per_token, num_kv_cache_blocks
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import Request, RequestStatus, Scheduler
from llmserve.scheduler.kv_limits import kv_limiter_for
from llmserve.structured_output import GrammarCompilerCache
from llmserve.tokenizer import encode_text, load_tokenizer
from llmserve.utils import format_size
from llmserve.worker.model_loading import load_model
from llmserve.worker.model_runner import TORCH_DTYPES, ModelRunner
from llmserve.worker.window_kv import split_kv_memory

logger = logging.getLogger("llmserve")

PromptType = str | dict[str, Any]


class LLMEngine:
    """A synchronous engine: ``add_request`` then ``step`` until done.

    Build it with :meth:`from_engine_args`.
    """

    def __init__(self, config: EngineConfig, tokenizer, model: torch.nn.Module,
                 draft_model: torch.nn.Module | None = None, executor=None) -> None:
        self.config = config
        self.executor = executor  # a worker.tp_worker.TPExecutor under tensor parallelism
        self.tokenizer = tokenizer
        mc = config.model_config
        eos = set(mc.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        cc = config.cache_config
        # per rank (a tensor-parallel shard holds its KV heads); int8 / fp8 pages: one
        # byte per element + a fp16 scale per token and KV head
        tp = config.parallel_config.tensor_parallel_size
        self.kv_bytes_per_token = kv_cache_bytes_per_token(
            mc, config.kv_cache_dtype, tp, kv_key_quant=cc.kv_key_quant,
            block_size=cc.block_size)
        if config.parallel_config.pipeline_parallel_size > 1:  # stage 0's layers only
            from llmserve.models.pipeline_parallel import stage_kv_bytes_per_token

            self.kv_bytes_per_token = stage_kv_bytes_per_token(self.kv_bytes_per_token, mc, model)
        if draft_model is not None:  # the draft's KV cache shares the target's block tables
            self.kv_bytes_per_token += kv_cache_bytes_per_token(draft_model.config, config.dtype)
        # a mixed model's local layers in a window pool (kv_cache/window_blocks.py)
        self.window_kv, kv_memory, self.kv_bytes_per_token = split_kv_memory(
            config, self.kv_bytes_per_token)
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            num_blocks = num_kv_cache_blocks(kv_memory, cc.block_size, self.kv_bytes_per_token)
        self.num_blocks = num_blocks
        max_len = config.scheduler_config.max_model_len
        capacity = (num_blocks - 1) * cc.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens (%s at %d B/token, %s); %d tokens; "
            "max concurrency at max_model_len=%d: %.2fx",
            num_blocks, cc.block_size, format_size(num_blocks * cc.block_size *
                                                   self.kv_bytes_per_token),
            self.kv_bytes_per_token, config.kv_cache_dtype, capacity, max_len,
            capacity / max_len)
        if capacity < max_len:
            logger.warning("the KV cache (%d tokens) holds less than max_model_len (%d): "
                           "long requests will be refused or cut", capacity, max_len)
        num_host_blocks = 0
        if config.scheduler_config.preemption_mode == "swap":
            num_host_blocks = cc.num_cpu_blocks_override or num_kv_cache_blocks(
                cc.swap_space, cc.block_size, self.kv_bytes_per_token)
            logger.info("swap space: %d host blocks (%s)", num_host_blocks,
                        format_size(num_host_blocks * cc.block_size * self.kv_bytes_per_token))
        self.num_host_blocks = num_host_blocks
        if executor is not None:  # every rank allocates the smallest count of all ranks
            from llmserve.worker.pp_worker import make_driver_runner
            from llmserve.worker.tp_worker import log_rank_memory

            self.num_blocks = num_blocks = executor.agree_kv_blocks(num_blocks, num_host_blocks)
            self.runner = make_driver_runner(config, model, num_blocks, num_host_blocks, executor)
            self.rank_memory = log_rank_memory(0, self.runner)  # bytes this rank allocated
        else:
            self.runner = ModelRunner(config, model, num_blocks, num_host_blocks)
        self.lora_manager = None
        if config.lora_config is not None:  # wraps the projections (llmserve/lora/)
            from llmserve.lora.manager import LoRAModelManager

            lc = config.lora_config
            self.lora_manager = LoRAModelManager(model, lc.max_loras, lc.max_lora_rank,
                                                 lc.max_cpu_loras, TORCH_DTYPES[config.dtype],
                                                 config.device)
            self.runner.lora_manager = self.lora_manager
        self.spec_decoding_stats = None
        if config.speculative_config is not None:
            from llmserve.spec_decode.builder import build_spec_decoder
            from llmserve.spec_decode.metrics import SpecDecodingStats

            self.runner.spec_decoder = build_spec_decoder(config, self.runner, draft_model)
            self.spec_decoding_stats = SpecDecodingStats(
                num_spec_tokens=config.speculative_config.num_speculative_tokens)
        self._spec_logged_at = time.monotonic()
        self.kv_store = build_kv_store(config)  # the shared KV store (--kv-store), or None
        kv_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                    kv_store=self.kv_store, window_blocks=None if
                                    self.window_kv is None else WindowBlocks(
                                        self.window_kv.num_blocks, cc.block_size,
                                        self.window_kv.window))
        self.scheduler = Scheduler(
            config.scheduler_config, kv_manager,
            num_host_blocks, num_lookahead_tokens=(
                self.runner.spec_decoder.num_lookahead_tokens if self.runner.spec_decoder
                else 0),
            max_loras=config.lora_config.max_loras if config.lora_config else 0,
            kv_limits=kv_limiter_for(config, kv_manager))
        self.output_processor = OutputProcessor(tokenizer)
        # structured outputs: grammars compiled once per spec (the server compiles them
        # in a worker thread before adding the request, so a step never waits on one)
        self.structured_output = GrammarCompilerCache(tokenizer, mc.vocab_size,
                                                      list(self.eos_token_ids))
        self._counter = itertools.count()
        self._parents: dict[str, list[str]] = {}  # n > 1: parent id -> child ids
        # pipeline parallelism: micro-batches in flight (engine/batch_queue.py)
        self.batch_queue = None
        if config.parallel_config.pipeline_parallel_size > 1:
            from llmserve.engine.batch_queue import BatchQueue

            self.batch_queue = BatchQueue(config.parallel_config.pipeline_parallel_size)
        self._stalled_steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Resolve the model, load tokenizer and weights, size the KV cache.

        Raises:
            ValueError: for a bad option, an unknown model or an unsupported format.
        """
        t0 = time.perf_counter()
        source = resolve_model(args.model)
        model_config = load_model_config(source)
        config = args.create_engine_config(model_config, source.name)
        model_config = config.model_config  # with the served max_model_len
        executor = None
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 starts separate engine replicas: use "
                             "`llmserve serve --data-parallel-size N` (one engine here)")
        if config.parallel_config.world_size > 1:  # spawn the other ranks; they load too
            from llmserve.worker.pp_worker import check_pipeline_config
            from llmserve.worker.tp_worker import TPExecutor

            check_pipeline_config(config)
            executor = TPExecutor.start(config, source, args.quantization)
        try:
            tokenizer = load_tokenizer(source)
            model, quant = load_model(config, source, args.quantization,
                                      executor.groups.tp if executor else None)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise
        logger.info("loaded %s (%s, %s, weights %s) in %.1f s", source.name,
                    model_config.architecture, config.dtype, quant.name if quant else "dense",
                    time.perf_counter() - t0)
        draft_model = None
        if config.speculative_config is not None and \
                config.speculative_config.method == "draft_model":
            from llmserve.spec_decode.draft_model import load_draft_model

            draft_model = load_draft_model(config, tokenizer)
        return cls(config, tokenizer, model, draft_model, executor=executor)

    # ------------------------------------------------------------------ requests
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler_config.max_model_len

    @property
    def max_kv_tokens(self) -> int:
        """Tokens the whole KV cache holds: no one sequence can grow past this (a sequence
        capped by a sliding window or an engine-wide KV budget: ``max_model_len``)."""
        limits = self.scheduler.kv_limits
        if limits is not None and limits.max_blocks(
                limits.make_state(None), self.config.scheduler_config.max_num_batched_tokens) \
                is not None:
            return self.max_model_len
        return (self.scheduler.kv_cache_manager.num_usable_blocks
                * self.config.cache_config.block_size)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A string, or ``{"prompt_token_ids": [...]}`` (or ``{"prompt": str}``).

        Raises:
            ValueError: naming ``prompt`` for empty or malformed prompts.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, encode_text(self.tokenizer, prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not ids:
                    raise ValueError("prompt_token_ids must be a non-empty list of token ids")
                vocab = self.config.model_config.vocab_size
                for t in ids:
                    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                        raise ValueError(
                            f"prompt_token_ids: {t!r} is not a token id in [0, {vocab})")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
        raise ValueError(
            f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, fork_from: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue one request; returns its id.

        ``max_tokens`` is capped at ``max_model_len - prompt length``. With
        ``params.n > 1`` the prompt is computed once and shared by n sequences
        (child i samples with ``seed + i`` when a seed is given, as vLLM).
        ``priority``: lower runs first under ``scheduling_policy="priority"``.
        ``cache_salt``: requests with different salts never share prefix cache.
        ``fork_from``: the id of a queued request with the same prompt whose prompt
        KV this one shares once computed (how the server runs an OpenAI ``n``).
        ``lora_request`` (or ``prompt["lora_request"]``): the LoRA adapter to run with
        (``enable_lora``); loaded here if it is not in memory.

        Raises:
            ValueError: naming the field (prompt, sampling parameters, length).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]  # vLLM accepts the salt in the prompt dict
        if isinstance(prompt, dict) and prompt.get("lora_request") is not None:
            lora_request = prompt["lora_request"]
        if lora_request is not None:
            self.add_lora(lora_request)  # ValueError: LoRA off, bad adapter
        check_params_for_engine(self.config, params, self.structured_output)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self._parents or request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        self.scheduler.check_request_fits(len(prompt_ids), params)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.time() if arrival_time is None else arrival_time
        n = params.n
        parent = None
        child_ids = [request_id]
        if n > 1:
            child_ids = [f"{request_id}#{i}" for i in range(n)]
            parent = ParentRequest(request_id, n, child_ids)
            self._parents[request_id] = child_ids
        for i, child_id in enumerate(child_ids):
            child_params = params
            if n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i
            req = Request(child_id, prompt_ids, child_params, max_tokens, self.eos_token_ids,
                          arrival_time=arrival, priority=priority, cache_salt=cache_salt,
                          lora_request=lora_request,
                          fork_from=child_ids[0] if i > 0 else self._fork_source(fork_from,
                                                                                  prompt_ids))
            self.scheduler.add_request(req)
            self.output_processor.add_request(child_id, prompt_text, prompt_ids, child_params,
                                              output_kind, arrival, parent=parent, index=i)
        return request_id

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into memory (vLLM's ``add_lora``); callable from any thread.

        Raises:
            ValueError: LoRA is off (no ``enable_lora``), not a ``LoRARequest``, or the
                adapter cannot be read or does not fit the model / ``max_lora_rank``.
        """
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True "
                             "(--enable-lora)")
        self.lora_manager.add_adapter(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from memory; True if it was loaded."""
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        """Ids of the adapters in memory."""
        return [] if self.lora_manager is None else self.lora_manager.list_adapters()

    def _fork_source(self, fork_from: str | None, prompt_ids: list[int]) -> str | None:
        if fork_from is None:
            return None
        leader = self.scheduler.requests.get(fork_from)
        if leader is None or leader.prompt_token_ids != prompt_ids:
            return None  # unknown, finished, or another prompt: compute our own
        return fork_from

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests; their blocks are freed at once. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [c for rid in ids for c in self._parents.pop(rid, [rid])]
        self.scheduler.abort_requests(ids)
        outs = []
        for rid in ids:
            self.runner.drop_request(rid)
            out = self.output_processor.abort(rid)
            if out is not None:
                outs.append(out)
        return outs

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (a no-op for one process)."""
        if self.executor is not None:
            self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(
            self.batch_queue is not None and self.batch_queue.queue)

    def prefix_cache_digest(self) -> tuple[int, int, list[bytes]]:
        """``(block_size, version, block hashes)`` of every block in the prefix cache
        (callable from another thread; see ``BlockPool.cached_block_hashes``)."""
        version, hashes = self.scheduler.kv_cache_manager.prefix_cache_digest()
        return self.config.cache_config.block_size, version, hashes

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, update, detokenize."""
        if self.batch_queue is not None:
            return self._step_with_batch_queue()
        sched_out = self.scheduler.schedule()
        ended = self._drain_finished_without_output()
        if sched_out.total_num_scheduled_tokens == 0:
            if sched_out.kv_cache_ops or sched_out.finished_req_ids:
                # swap-outs must still move the KV; finished requests drop their state
                self.runner.execute_model(sched_out)
            sched = self.scheduler
            if sched.waiting and not sched.running and not sched_out.kv_cache_ops:
                self._stalled_steps += 1
                if self._stalled_steps >= 3:
                    # nothing runs and the head cannot be admitted: never spin forever
                    head = sched.waiting.peek().request_id
                    logger.error("request %s can never be scheduled; aborting it", head)
                    return ended + self.abort_request([head])
            return ended
        self._stalled_steps = 0
        return ended + self._run_step(sched_out)

    def _step_with_batch_queue(self) -> list[RequestOutput]:
        """vLLM's ``step_with_batch_queue``: see :mod:`llmserve.engine.batch_queue`."""
        from llmserve.engine.batch_queue import step_with_batch_queue

        return step_with_batch_queue(self)

    def _drain_finished_without_output(self) -> list[RequestOutput]:
        """Final outputs of requests the scheduler ended on its own (e.g. one that
        outgrew the whole KV cache: finish_reason ``length`` with what it has)."""
        outs = []
        for req_id, reason in self.scheduler.finished_without_output:
            self.runner.drop_request(req_id)
            out = self.output_processor.abort(req_id, reason)
            if out is not None:
                outs.append(out)
                if out.finished:
                    self._parents.pop(out.request_id, None)
        self.scheduler.finished_without_output.clear()
        return outs

    def _run_step(self, sched_out) -> list[RequestOutput]:
        first_sched = self._first_scheduled(sched_out)
        try:
            runner_out = self.runner.execute_model(sched_out)
        except RankFailedError:  # a tensor-parallel rank is gone: the engine cannot go on
            raise
        except Exception:  # never let one bad batch kill the engine
            logger.exception("model step failed; aborting the %d requests in it",
                             len(sched_out.num_scheduled_tokens))
            return self.abort_request(list(sched_out.num_scheduled_tokens))
        return self._process_step(sched_out, runner_out, first_sched)

    def _first_scheduled(self, sched_out) -> dict[str, float | None]:
        return {r.req_id: self.scheduler.requests[r.req_id].first_scheduled_time
                for r in sched_out.scheduled_new_reqs}

    def _process_step(self, sched_out, runner_out, first_sched) -> list[RequestOutput]:
        """The scheduler's and the output processor's half of a step."""
        if self.spec_decoding_stats is not None:
            for req_id, drafts in sched_out.scheduled_spec_decode_tokens.items():
                emitted = runner_out.emitted_token_ids.get(req_id)
                if drafts and emitted:
                    self.spec_decoding_stats.observe(len(drafts), len(emitted) - 1)
            if time.monotonic() - self._spec_logged_at >= 10.0 and sched_out.scheduled_spec_decode_tokens:
                self._spec_logged_at = time.monotonic()
                logger.info("%s", self.spec_decoding_stats.log_line())
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        if self.kv_store is not None:  # blocks computed this step -> the store's writer
            write_new_blocks(self.scheduler.kv_cache_manager, self.kv_store,
                             self.runner.kv_caches)
        outputs, stopped = self.output_processor.process(core_outputs, first_sched)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.finished:
                self._parents.pop(out.request_id, None)
        return outputs
