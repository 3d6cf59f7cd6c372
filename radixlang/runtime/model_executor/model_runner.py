"""ModelRunner: owns the model, the KV pools and the attention backend; runs one forward per step.

With ``tp_size > 1`` the runner built by the scheduler is rank 0: it starts the follower ranks
(model_executor/tp_leader.py), holds its own slice of the model, and broadcasts every step's inputs before
running the forward itself. Followers build the same runner with their ``tp`` group and run the
steps they receive.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.kernels.cuda_graph import CudaGraphRunner, DecodeGraphInputs, GraphAttnBackend
from radixlang.runtime.lora.manager import LoRAManager
from radixlang.runtime.server_args import ServerArgs, split_lora_path
from radixlang.runtime.model_executor.decode_stack import DecodeStack
from radixlang.runtime.model_executor.distributed import DistComm, init_group, recv_step, send_step, send_stop
from radixlang.runtime.model_executor.forward_batch import ForwardBatch, StepInputs
from radixlang.runtime.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.swa_memory_pool import SWATokenToKVPool
from radixlang.runtime.models.layers.attention_config import check_backend_features, layer_sliding_window
from radixlang.runtime.models.layers.rotary import rope_context_length, rope_length_key
from radixlang.runtime.models.llama import check_tensor_parallel
from radixlang.runtime.models.loader.model_loader import Checkpoint, load_checkpoint, open_checkpoint, read_config
from radixlang.runtime.models.gguf_quant import serves_tied_logits
from radixlang.runtime.models.layers.linear import process_weights_after_loading
from radixlang.runtime.models.layers.weight_methods import WeightMethods
from radixlang.runtime.model_executor.kv_sizing import (CPU_MAX_TOKENS, CUDA_MEM_FRACTION, KVPoolSize,
                                                         cpu_default_fraction, host_memory, size_kv_pool)
from radixlang.runtime.model_executor.tp_leader import TPLeader, cuda_device_index, exit_with_parent, ranks_per_node
from radixlang.runtime.sampling.step_io import StepOutput, StepPlan
from radixlang.runtime.sampling.step_sampler import run_plan

logger = logging.getLogger(__name__)

# a quantized GGUF's float32 prefill copies (gguf_quant.GGUFBlocksMethod.finish_model) may take at most this
# share of the host memory available once the model is loaded; the rest is left to the KV pool and the process
PREFILL_COPY_SHARE = 0.4

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _create_attn_backend(name: str, *, flashinfer_backend: str = "auto", **kw):
    if name == "torch":
        return TorchNativeAttnBackend(**kw)
    if name == "flashinfer":
        kw["flashinfer_backend"] = flashinfer_backend
    try:
        from radixlang.kernels.attention import create_attention_backend
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available: {e}") from e
    return create_attention_backend(name, **kw)


class ModelRunner:
    def __init__(self, args: ServerArgs, *, tp: DistComm | None = None) -> None:
        """``tp``: a follower's group; rank 0 (``tp`` None, ``args.tp_size > 1``) starts the followers itself."""
        self.args = args
        self.device = args.device
        self.dtype = _DTYPES[args.dtype]
        # the CPU keeps KV and attention in float32 whatever the weights: torch's CPU attention in
        # bfloat16 ran ~6x slower than in float32 here (no AMX), and the KV gather is not the bottleneck
        self.kv_dtype = torch.float32 if self.device == "cpu" else self.dtype
        self.tp_leader = None
        if self.device == "cuda" and tp is None and torch.cuda.is_available():
            # rank 0 of its replica: the replica's first GPU (followers set theirs before joining the group);
            # the current device is per thread, and this thread builds and runs the replica
            torch.cuda.set_device(cuda_device_index(args, 0, torch.cuda.device_count()))
        # the checkpoint's one open of this start (a GGUF's header parsed once); not kept past the build, so
        # that the file's memory map goes once its tensors are copied
        checkpoint = open_checkpoint(args.model_path, args.load_format)
        if args.tp_size > 1 and tp is None:  # rank 0: refuse a bad split before starting any process
            check_tensor_parallel(read_config(checkpoint.folder), args.tp_size)
            self.tp_leader = TPLeader.start(args, follower_main)
        self.tp = tp if self.tp_leader is None else self.tp_leader.comm
        self._tp_lock = threading.Lock()  # one broadcast at a time: a step, or the stop at shutdown
        self.graph_runner: CudaGraphRunner | None = None
        self.generator = torch.Generator().manual_seed(args.random_seed)  # unseeded requests' draws (execute)
        try:
            self._build(args, checkpoint)
            self.graph_runner = self._init_cuda_graphs(args)
        except BaseException:
            if self.tp_leader is not None:
                self.tp_leader.abort()
            raise

    def _build(self, args: ServerArgs, checkpoint: Checkpoint) -> None:
        gguf = checkpoint.gguf
        if args.quantization == "gguf" and gguf is None:
            raise ValueError("quantization 'gguf' needs a .gguf model file, got a checkpoint of another format")

        def prefill_budget() -> int:  # asked once the model is loaded
            return int(PREFILL_COPY_SHARE * host_memory()[1])

        # every linear's weight method, chosen before any tensor is read (models/layers/weight_methods.py;
        # a quantized GGUF's block linears from its header: models/gguf_quant.py)
        methods = WeightMethods.choose(
            quantization=args.quantization, device=self.device, dtype=self.dtype,
            weight_packing=not args.disable_weight_packing, cpu_kernels=not args.disable_cpu_kernels,
            native_logits=gguf is not None and args.quantization == "gguf" and serves_tied_logits(gguf),
            prefill_budget=None if args.disable_weight_packing else prefill_budget)
        loaded = load_checkpoint(checkpoint, model_path=args.model_path, load_format=args.load_format,
                                 dtype=self.dtype, device=self.device, seed=args.random_seed,
                                 tokenizer_path=args.tokenizer_path, tp=self.tp, methods=methods,
                                 embedding=args.is_embedding)
        self.model, self.hf_config, self.tokenizer = loaded.model, loaded.hf_config, loaded.tokenizer
        processed = process_weights_after_loading(self.model)
        logger.info("linear weight methods: %s", ", ".join(f"{n} {name}" for name, n in sorted(processed.items())))
        # the fused CPU decode step: every step is offered to it first (run_step), where the model's layers
        # declare it (DecoderLayer.fused_decode)
        self.decode_stack: DecodeStack | None = None
        if self.device == "cpu" and not args.disable_cpu_kernels and self.model.use_cpu_kernels():
            logger.info("norms, rotary and SwiGLU run on radixlang's CPU kernels")
            self.decode_stack = DecodeStack.build(self.model)
        self.lora = self._init_lora(args)
        self.model_path, self.tokenizer_path = loaded.model_path, loaded.tokenizer_path
        self.model_dir = loaded.model_dir  # where generation_config.json is read (runtime/generation_config.py)
        self.vocab_size = int(self.hf_config.vocab_size)
        model_ctx = rope_context_length(self.hf_config)
        self.context_len = min(args.context_length or model_ctx, model_ctx)
        self.layer_windows = self._swa_layer_windows(args)
        kv_size = self._size_kv_pool(args)
        if kv_size.warning:
            logger.warning("KV pool: %s", kv_size.warning)
        self.max_total_tokens = kv_size.tokens
        self.max_running = min(args.max_running_requests, self.max_total_tokens)
        if self.tp is not None:  # every rank sizes its pools like rank 0: same slots, its own heads
            self.max_total_tokens, self.max_running, self.context_len = self.tp.broadcast_ints(
                [self.max_total_tokens, self.max_running, self.context_len])
        self.req_to_token_pool = ReqToTokenPool(self.max_running + 8, self.context_len + 8, self.device)
        # rank 0's copy of the followers' req_to_token (all zeros, as theirs start): each step sends the changes
        self._tp_sent = torch.zeros_like(self.req_to_token_pool.req_to_token) if self.tp_leader else None
        self.kv_pool = self._make_kv_pool(self.max_total_tokens)
        self.attn_backend = _create_attn_backend(args.attention_backend, num_heads=self.model.num_heads,
                                                 num_kv_heads=self.model.num_kv_heads,
                                                 head_dim=self.model.head_dim, device=self.device, dtype=self.dtype,
                                                 flashinfer_backend=args.flashinfer_backend)
        check_backend_features(self.model, self.attn_backend, args.attention_backend)
        swa = f", window layers' KV in {self.kv_pool.swa_size} swa slots" \
            if isinstance(self.kv_pool, SWATokenToKVPool) else ""
        logger.info("model %s: %d layers, kv pool %d tokens%s (%.1f MiB, %d bytes per token; %s), context %d, "
                    "attention %s%s", self.model_path, self.hf_config.num_hidden_layers, self.max_total_tokens,
                    swa, self.kv_pool.total_bytes / 2**20, self.kv_pool.per_token_bytes, kv_size.how,
                    self.context_len, args.attention_backend,
                    f", tp rank {self.tp.rank}/{self.tp.size}" if self.tp else "")

    def _init_lora(self, args: ServerArgs) -> LoRAManager | None:
        """The adapters' manager with --lora-paths registered (None without --enable-lora). A batch with an
        adapter runs the layer-by-layer forward, eagerly (no fused CPU decode step, no CUDA graph); batches
        of the base model alone keep both."""
        if not args.enable_lora:
            return None
        if not hasattr(self.model, "lora_target"):
            raise ValueError(f"LoRA adapters are not supported for {type(self.model).__name__}")
        manager = LoRAManager(self.model, dtype=self.dtype, device=self.device, max_loaded=args.max_loaded_loras)
        for entry in args.lora_paths:
            manager.register(*split_lora_path(entry))
        return manager

    def _swa_layer_windows(self, args: ServerArgs) -> list[int | None] | None:
        """Each layer's window where window layers get a slot space of their own (some window is shorter
        than the context), else None: one slot space for every layer."""
        if args.disable_hybrid_swa_memory or getattr(self.model, "mla_latent", None) is not None:
            return None
        windows = [layer_sliding_window(self.hf_config, i) for i in range(self.hf_config.num_hidden_layers)]
        windows = [w if w and w < self.context_len else None for w in windows]
        if not any(windows):
            return None
        if self.tp is not None or args.tp_size > 1 or args.attention_backend not in ("torch", "cpu"):
            # the followers and the triton / flashinfer kernels read window layers by token slot
            logger.info("sliding-window layers keep KV for every token (an swa slot space needs tp_size 1 and "
                        "the torch or cpu attention backend, got tp_size %d, %s)", args.tp_size,
                        args.attention_backend)
            return None
        return windows

    def _swa_size(self, size: int) -> int:
        """Window layers' slots: ``swa_full_tokens_ratio`` of the full slots, but at least what one request
        needs alone (a prefill chunk, its last window of tokens and its cached prefix's last window)."""
        if self.layer_windows is None:
            raise RuntimeError("_swa_size without window layers")
        window = max(w for w in self.layer_windows if w)
        chunk = self.args.max_prefill_tokens
        if self.args.chunked_prefill_size > 0:
            chunk = min(chunk, self.args.chunked_prefill_size)
        return min(size, max(int(self.args.swa_full_tokens_ratio * size), chunk + 2 * window))

    def _make_kv_pool(self, size: int) -> TokenToKVPool:
        """Per-head k and v per layer, or (MLA: the model's ``mla_latent`` = (latent_dim, value_dim)) one
        compressed latent per token and layer; window layers in a slot space of their own (``SWATokenToKVPool``)
        where ``_swa_layer_windows`` allows."""
        mla = getattr(self.model, "mla_latent", None)
        if mla is not None:
            return MLATokenToKVPool(size, num_layers=self.hf_config.num_hidden_layers, latent_dim=mla[0],
                                    value_dim=mla[1], dtype=self.kv_dtype, device=self.device)
        if self.layer_windows is not None:
            return SWATokenToKVPool(size, self._swa_size(size), layer_windows=self.layer_windows,
                                    layer_shapes=self.model.kv_layer_shapes(), dtype=self.kv_dtype,
                                    device=self.device)
        return TokenToKVPool(size, num_layers=self.hf_config.num_hidden_layers,
                             num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
                             dtype=self.kv_dtype, device=self.device, layer_shapes=self.model.kv_layer_shapes())

    def _per_token_bytes(self) -> float:
        """KV bytes one full slot costs, its share of the swa slots included (ratio x window layers' bytes)."""
        mla = getattr(self.model, "mla_latent", None)
        if mla is not None:
            return MLATokenToKVPool.latent_bytes_per_token(num_layers=self.hf_config.num_hidden_layers,
                                                           latent_dim=mla[0], dtype=self.kv_dtype)
        shapes = self.model.kv_layer_shapes()
        if self.layer_windows is None:
            return TokenToKVPool.layers_bytes_per_token(shapes, self.kv_dtype)
        full = [s for s, w in zip(shapes, self.layer_windows) if not w]
        swa = [s for s, w in zip(shapes, self.layer_windows) if w]
        return (TokenToKVPool.layers_bytes_per_token(full, self.kv_dtype)
                + self.args.swa_full_tokens_ratio * TokenToKVPool.layers_bytes_per_token(swa, self.kv_dtype))

    def _size_kv_pool(self, args: ServerArgs) -> KVPoolSize:
        """The pool's tokens from the device's total memory and the model (kv_sizing.py), or as asked."""
        # the model's real per-token KV bytes (layers may differ in kv heads and head size; MLA caches a latent;
        # window layers hold a share of the tokens)
        per_token = self._per_token_bytes()
        if self.device == "cuda":
            if args.max_total_tokens is not None and not torch.cuda.is_available():  # a test's emulated device
                return KVPoolSize(args.max_total_tokens, "max_total_tokens", None)
            available, total = torch.cuda.mem_get_info()
            model_bytes = torch.cuda.memory_allocated()  # the weights and whatever else this process holds
            fraction = args.mem_fraction_static or CUDA_MEM_FRACTION
            max_tokens = None
        else:
            # every process of the node (dp replicas x local tp ranks) shares the host: each sizes its own share
            procs = args.dp_size * ranks_per_node(args)
            total, available = (n // procs for n in host_memory())
            model_bytes = _module_bytes(self.model)
            fraction = args.mem_fraction_static or cpu_default_fraction(total, model_bytes)
            max_tokens = CPU_MAX_TOKENS
        return size_kv_pool(total_bytes=total, available_bytes=available, model_bytes=model_bytes,
                            per_token_bytes=per_token, fraction=fraction, asked_tokens=args.max_total_tokens,
                            max_tokens=max_tokens)

    # ---- CUDA graphs (decode) ----
    def _init_cuda_graphs(self, args: ServerArgs) -> CudaGraphRunner | None:
        """Capture decode at batch sizes 1, 2, 4, 8, 16, 24, ... up to ``cuda_graph_max_bs``; None when decode
        runs eagerly (the CPU, --disable-cuda-graph, a backend without graph support).

        Under tensor parallelism every rank captures the same sizes at the same point of its start (the
        graphs hold the nccl all-reduces and all-gathers of the layers), and replays the same graph for a
        step: the batch size decides, and every rank runs the same batch."""
        if self.device != "cuda" or args.disable_cuda_graph or args.is_embedding:  # an embedding server never decodes
            return None
        if not isinstance(self.attn_backend, GraphAttnBackend):
            logger.info("attention backend %s has no CUDA-graph support: decode runs eagerly", args.attention_backend)
            return None
        max_bs = min(args.cuda_graph_max_bs, self.max_running)
        # one logits buffer for every captured size: [max_bs, vocab] float32 on the device
        self._graph_logits = torch.empty((max_bs, self.vocab_size), dtype=torch.float32, device=self.device)
        runner = CudaGraphRunner(self._graph_model_forward, self._graph_forward_batch, self.attn_backend,
                                 max_bs=max_bs, max_context_len=self.req_to_token_pool.max_context_len,
                                 device=self.device, pad_slot=0, pad_req_index=self.req_to_token_pool.pad_index)
        start = time.perf_counter()
        runner.capture()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(runner.capture_sizes),
                    runner.capture_sizes, time.perf_counter() - start)
        return runner

    def _graph_model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                             fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(input_ids, positions, fb, None)
        out = self._graph_logits[:fb.batch_size]  # [bs, vocab] float32, a view of the shared buffer
        out.copy_(self.model.compute_logits(hidden))
        return out

    def _graph_forward_batch(self, inputs: DecodeGraphInputs) -> ForwardBatch:
        bs = len(inputs.seq_lens_cpu)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=inputs.input_ids, positions=inputs.positions,
            req_pool_indices=inputs.req_pool_indices, seq_lens=inputs.seq_lens, seq_lens_cpu=inputs.seq_lens_cpu,
            extend_prefix_lens_cpu=[n - 1 for n in inputs.seq_lens_cpu], extend_seq_lens_cpu=[1] * bs,
            out_cache_loc=inputs.out_cache_loc, req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool=self.kv_pool, attn_backend=self.attn_backend)

    # ---- steps ----
    def execute(self, inputs: StepInputs, plan: StepPlan) -> StepOutput:
        """Run one step and choose its tokens as ``plan`` says (sampling/step_sampler.py): the token ids and
        logprobs come back as host lists. Under tensor parallelism every rank runs the forward; rank 0 (this
        runner) alone samples. With --is-embedding: the asked rows' final hidden states, nothing chosen."""
        out = self.forward(inputs)
        if self.args.is_embedding:
            return StepOutput(hidden=out)
        return run_plan(out, plan, self.generator)

    def rope_length_key(self, prompt_len: int) -> tuple | None:
        """The rotary rows a prompt of this length takes (models/layers/rotary.py), as the cache's namespace."""
        return rope_length_key(self.hf_config, prompt_len)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Run one forward pass; return logits [len(inputs.logit_rows), vocab] float32 on the runner's device
        (``execute`` samples there; only the chosen ids come back to the host)."""
        if self.tp_leader is None:
            return self.run_step(inputs)
        with self._tp_lock:
            send_step(self.tp, inputs, self.req_to_token_pool.req_to_token, self._tp_sent)
            return self.run_step(inputs)

    def run_step(self, inputs: StepInputs) -> torch.Tensor:
        """The forward itself (every rank runs it); logits [len(logit_rows), vocab] float32 on the device,
        or with --is-embedding those rows' final hidden states [len(logit_rows), hidden] (pooled by the
        scheduler: scheduler/pooled_step.py).

        A decode batch of at most ``cuda_graph_max_bs`` requests replays a captured graph; its logits are
        a view of the shared graph buffer, valid until the next step.
        """
        dev = self.device
        fb = ForwardBatch(
            forward_mode=inputs.mode, batch_size=len(inputs.seq_lens), input_ids=inputs.input_ids.to(dev),
            positions=inputs.positions.to(dev), req_pool_indices=inputs.req_pool_indices.to(dev),
            seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int64).to(dev), seq_lens_cpu=inputs.seq_lens,
            extend_prefix_lens_cpu=inputs.prefix_lens, extend_seq_lens_cpu=inputs.extend_lens,
            out_cache_loc=inputs.out_cache_loc.to(dev), req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool=self.kv_pool, attn_backend=self.attn_backend, prompt_lens_cpu=inputs.prompt_lens)
        rows = inputs.logit_rows
        # a decode step (or a prompt with every token's logprobs) wants every row: no gather then
        every = len(rows) == len(inputs.input_ids) and torch.equal(rows, torch.arange(len(rows)))
        # a step with adapter rows runs the model's own layers, whose linears add the deltas
        adapters = (self.lora is not None and inputs.lora_ids is not None
                    and self.lora.begin_step(inputs.lora_ids, inputs.extend_lens, None if every else rows))
        fb.whole_rows = adapters
        try:
            with torch.inference_mode():
                if (every and not adapters and self.graph_runner is not None and inputs.mode is ForwardMode.DECODE
                        and self.graph_runner.can_run(fb.batch_size)):
                    return self.graph_runner.replay(fb.input_ids, fb.positions, fb)
                self.attn_backend.init_forward_metadata(fb)
                hidden = (self.decode_stack.forward(fb.input_ids, fb.positions, fb)
                          if every and not adapters and self.decode_stack is not None else None)  # None: not taken
                if hidden is None:
                    hidden = self.model(fb.input_ids, fb.positions, fb, None if every else rows.to(dev))
                if self.args.is_embedding:
                    return hidden  # [len(rows), hidden] in the model's dtype
                return self.model.compute_logits(hidden)  # [len(rows), vocab] float32
        finally:
            if adapters and self.lora is not None:
                self.lora.end_step()

    def shutdown(self) -> None:
        """Rank 0: stop the follower ranks and leave the group. Idempotent; a no-op without TP."""
        leader, self.tp_leader = self.tp_leader, None
        if leader is None:
            return
        if self._tp_lock.acquire(timeout=5.0):  # a step in flight would interleave with the stop message
            try:
                send_stop(self.tp)
            finally:
                self._tp_lock.release()
        leader.stop()


def follower_main(args: ServerArgs, rank: int, init_addr: str, parent_pid: int) -> None:
    """A follower rank's process: join the group, build the runner, run steps until the stop message."""
    logging.basicConfig(level=args.log_level.upper(), format=f"[%(asctime)s tp{rank} %(name)s] %(message)s")
    exit_with_parent(parent_pid)
    local_rank = rank % ranks_per_node(args)
    if args.device == "cuda":
        torch.cuda.set_device(cuda_device_index(args, local_rank, torch.cuda.device_count()))
    elif args.num_threads:
        torch.set_num_threads(args.num_threads)
    comm = init_group(rank=rank, size=args.tp_size, init_addr=init_addr, device=args.device)
    runner = ModelRunner(args, tp=comm)
    pool = runner.req_to_token_pool.req_to_token
    steps = 0
    while (msg := recv_step(comm)) is not None:
        inputs, (rows, cols, slots) = msg
        # the entries of rank 0's req_to_token this batch reads that changed since the last step
        pool[rows.to(pool.device), cols.to(pool.device)] = slots.to(device=pool.device, dtype=pool.dtype)
        runner.run_step(inputs)
        steps += 1
    logger.info("tp rank %d stopping after %d steps", rank, steps)
    comm.close()


def _module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
