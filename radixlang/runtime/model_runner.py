"""ModelRunner: owns the model, the KV pools and the attention backend; runs one forward per step."""
from __future__ import annotations

import logging

import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.runtime.batch import ScheduleBatch
from radixlang.runtime.config import ServerArgs
from radixlang.runtime.forward_batch import ForwardBatch
from radixlang.runtime.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.models.loader import load_model
from radixlang.runtime.models.quant import quantize_model_

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _create_attn_backend(name: str, **kw):
    if name == "torch":
        return TorchNativeAttnBackend(**kw)
    try:
        from radixlang.kernels.attention import create_attention_backend
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available: {e}") from e
    return create_attention_backend(name, **kw)


class ModelRunner:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.device = args.device
        self.dtype = _DTYPES[args.dtype]
        loaded = load_model(args.model_path, load_format=args.load_format, dtype=self.dtype, device=self.device,
                            seed=args.random_seed, tokenizer_path=args.tokenizer_path)
        self.model, self.hf_config, self.tokenizer = loaded.model, loaded.hf_config, loaded.tokenizer
        if args.quantization:
            quantize_model_(self.model, args.quantization, self.device)
        self.model_path, self.tokenizer_path = loaded.model_path, loaded.tokenizer_path
        self.vocab_size = int(self.hf_config.vocab_size)
        model_ctx = int(getattr(self.hf_config, "max_position_embeddings", 4096) or 4096)
        self.context_len = min(args.context_length or model_ctx, model_ctx)
        self.max_total_tokens = args.max_total_tokens or self._auto_kv_tokens()
        self.max_running = min(args.max_running_requests, self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(self.max_running + 8, self.context_len + 8, self.device)
        self.kv_pool = TokenToKVPool(self.max_total_tokens, num_layers=self.hf_config.num_hidden_layers,
                                     num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
                                     dtype=self.dtype, device=self.device)
        self.attn_backend = _create_attn_backend(args.attention_backend, num_heads=self.model.num_heads,
                                                 num_kv_heads=self.model.num_kv_heads,
                                                 head_dim=self.model.head_dim, device=self.device, dtype=self.dtype)
        logger.info("model %s: %d layers, kv pool %d tokens, context %d, attention %s",
                    self.model_path, self.hf_config.num_hidden_layers, self.max_total_tokens, self.context_len,
                    args.attention_backend)

    def _auto_kv_tokens(self) -> int:
        per_token = TokenToKVPool.bytes_per_token(num_layers=self.hf_config.num_hidden_layers,
                                                  num_kv_heads=self.model.num_kv_heads,
                                                  head_dim=self.model.head_dim, dtype=self.dtype)
        if self.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
        else:
            free = _host_available_bytes()
        tokens = int(free * self.args.mem_fraction_static) // per_token
        return max(256, min(tokens, 1 << 20))

    def forward(self, batch: ScheduleBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run one forward pass; return logits [len(logit_rows), vocab] float32 of the given token rows."""
        reqs = batch.reqs
        if batch.mode is ForwardMode.DECODE:
            input_ids = [r.last_token for r in reqs]
            positions = [r.seq_len - 1 for r in reqs]
            seq_lens = [r.seq_len for r in reqs]
        else:
            input_ids, positions, seq_lens = [], [], []
            for r, pre, ext in zip(reqs, batch.prefix_lens, batch.extend_lens):
                input_ids.extend(r.tokens(pre, pre + ext))
                positions.extend(range(pre, pre + ext))
                seq_lens.append(pre + ext)
        fb = ForwardBatch(
            forward_mode=batch.mode, batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device), seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(batch.prefix_lens), extend_seq_lens_cpu=list(batch.extend_lens),
            out_cache_loc=batch.out_cache_loc.to(self.device), req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool=self.kv_pool, attn_backend=self.attn_backend)
        self.attn_backend.init_forward_metadata(fb)
        with torch.inference_mode():
            hidden = self.model(fb.input_ids, fb.positions, fb)  # [num_tokens, hidden]
            return self.model.compute_logits(hidden[logit_rows.to(self.device)]).cpu()


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
