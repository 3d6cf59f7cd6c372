"""Plain request/response structs shared by the server, the Engine and the Scheduler.

Every struct is a dataclass of JSON-able fields, so one codec (``encode`` /
``decode``: orjson with a type tag, no pickle) carries them over ZMQ.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Collection, Literal

import orjson

from radixlang.runtime.errors import RequestError
from radixlang.runtime.sampling.sampling_params import SamplingParams

FinishKind = Literal["stop", "length", "abort"]
# a FinishReason as it travels (BatchTokenIDOut, BatchStrOut) and as meta_info["finish_reason"] shows it
FinishReasonDict = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class FinishReason:
    """Why a request ended; ``to_dict`` is SGLang's wire shape, the only form that leaves the scheduler.

    stop: ``matched`` is the token id or stop string that ended it (None when a grammar completed);
    length: ``length`` is the max_new_tokens reached; abort: ``message``, and for a request refused
    as the caller's error ``status_code`` (400) and the offending field ``param``.
    """
    kind: FinishKind
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    param: str | None = None

    @classmethod
    def stop(cls, matched: int | str | None) -> FinishReason:
        return cls(kind="stop", matched=matched)

    @classmethod
    def max_tokens(cls, length: int) -> FinishReason:
        return cls(kind="length", length=length)

    @classmethod
    def abort(cls, message: str, *, status_code: int | None = None, param: str | None = None) -> FinishReason:
        return cls(kind="abort", message=message, status_code=status_code, param=param)

    @property
    def is_abort(self) -> bool:
        return self.kind == "abort"

    def to_dict(self) -> FinishReasonDict:
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        out: FinishReasonDict = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        if self.param is not None:
            out["param"] = self.param
        return out

    @classmethod
    def from_dict(cls, data: FinishReasonDict) -> FinishReason:
        kind = data.get("type")
        if kind != "stop" and kind != "length" and kind != "abort":
            raise ValueError(f"finish reason type must be stop, length or abort, got {kind!r}")
        return cls(kind=kind, matched=data.get("matched"), length=data.get("length"), message=data.get("message"),
                   status_code=data.get("status_code"), param=data.get("param"))


@dataclass(kw_only=True)
class TokenizedGenerateReq:
    """One generation request, tokenized, as the scheduler receives it (n already expanded)."""
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # built and validated once, by the request front
    input_text: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs; k: logprobs of input tokens k.. (k>=1 scored)
    top_logprobs_num: int = 0
    stream: bool = False
    # an embedding request (--is-embedding): a prefill that returns the pooled hidden state, no tokens;
    # ``embedding_dimensions`` cuts it (a Matryoshka model's ``dimensions``)
    embedding: bool = False
    embedding_dimensions: int | None = None
    lora_name: str | None = None  # the LoRA adapter to run under (runtime/lora); None: the base model


def check_embedding_match(*, embedding: bool, is_embedding: bool, model: str | None) -> None:
    """Refuse (RequestError naming ``model``) an embedding request to a generation server and a generation
    request to an embedding server (--is-embedding)."""
    if embedding and not is_embedding:
        raise RequestError(f"model {model} is not an embedding model: start the server with --is-embedding on "
                           "one to serve embeddings", "model")
    if is_embedding and not embedding:
        raise RequestError(f"model {model} is an embedding model (--is-embedding): it serves /v1/embeddings "
                           "and /v1/rerank, not generation", "model")


def check_lora_name(name: str | None, *, enabled: bool, served: Collection[str]) -> None:
    """Refuse (RequestError naming ``lora_path``) an adapter name on a server without LoRA, or one not served.
    The request front checks at submit; the scheduler again, since an unload may come between."""
    if name is None:
        return
    if not enabled:
        raise RequestError(f"LoRA adapters are not enabled on this server (the request names {name!r}): start "
                           "it with --enable-lora or --lora-paths", "lora_path")
    if name not in served:
        listed = ", ".join(sorted(served)) or "none"
        raise RequestError(f"no LoRA adapter named {name!r} is loaded (loaded: {listed})", "lora_path")


@dataclass(kw_only=True)
class AbortReq:
    rid: str


# Control messages: ``rid`` is the id of the control call (not of a generation request); the
# scheduler process copies it into the reply so the tokenizer manager can match the two.
@dataclass(kw_only=True)
class FlushCacheReq:
    rid: str = ""


@dataclass(kw_only=True)
class FlushCacheOut:
    success: bool
    message: str = ""
    rid: str = ""


@dataclass(kw_only=True)
class GetInternalStateReq:
    rid: str = ""


@dataclass(kw_only=True)
class GetInternalStateOut:
    state: dict[str, Any]
    rid: str = ""


@dataclass(kw_only=True)
class CheckMemoryLeakReq:
    rid: str = ""


@dataclass(kw_only=True)
class CheckMemoryLeakOut:
    ok: bool
    message: str = ""
    rid: str = ""


@dataclass(kw_only=True)
class LoRAUpdateReq:
    """Load (``path`` given) or unload a LoRA adapter by name on a replica."""
    name: str
    path: str | None = None
    rid: str = ""


@dataclass(kw_only=True)
class LoRAUpdateOut:
    success: bool
    message: str = ""
    adapters: dict[str, str] = field(default_factory=dict)  # the replica's adapters after the update: name -> path
    rid: str = ""


@dataclass(kw_only=True)
class SchedulerReady:
    """A scheduler process -> the launcher, once its model is loaded (or it failed to load: ``error``)."""
    replica: int
    pid: int
    error: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)  # resolved ServerArgs.to_dict()
    model_path: str = ""
    tokenizer_path: str = ""
    kv_pool_size: int = 0  # KV slots in the replica's pool: the request front sizes its router tree from it
    model_dir: str = ""  # the folder of the model's config: the front reads its sampling defaults there
    lora_adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters served at start: name -> path


@dataclass(kw_only=True)
class OutputRow:
    """One request's piece of a step, new since its previous row: what the front adds to its output.

    ``finished_reason`` is None while the request runs, else ``FinishReason.to_dict()`` (SGLang's shape
    ``{"type": "length"|"stop"|"abort", "matched": int|str|None, ...}``). Logprobs (None unless asked
    for) follow the same "new since the last row" rule: ``[(logprob, token_id), ...]`` and top-k lists.
    """
    rid: str
    output_ids: list[int]
    finished_reason: FinishReasonDict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[list[float | int]] | None = None
    output_top_logprobs: list[list[list[float | int]]] | None = None
    input_token_logprobs: list[list[float | int | None]] | None = None
    input_top_logprobs: list[list[list[float | int]] | None] | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)  # e.g. jump_forward_tokens
    embedding: list[float] | None = None  # an embedding request's, when finished


@dataclass(kw_only=True)
class TokenRow(OutputRow):
    """A row as the scheduler sends it: with the options the detokenizer needs (sent on every row; small)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_strs: list[str] = field(default_factory=list)
    stop_regexes: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class TextRow(OutputRow):
    """A row as the detokenizer passes it on: with its text delta."""
    text_delta: str = ""


@dataclass(kw_only=True)
class BatchTokenIDOut:
    """Scheduler -> detokenizer: one row for each request that produced something this step."""
    rows: list[TokenRow]


@dataclass(kw_only=True)
class BatchStrOut:
    """Detokenizer -> request front: the same rows with their text deltas."""
    rows: list[TextRow]


_MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (TokenizedGenerateReq, AbortReq, FlushCacheReq, FlushCacheOut, LoRAUpdateReq, LoRAUpdateOut,
                GetInternalStateReq,
                GetInternalStateOut, CheckMemoryLeakReq, CheckMemoryLeakOut, SchedulerReady, BatchTokenIDOut,
                BatchStrOut)
}


_ROW_TYPES: dict[type, type] = {BatchTokenIDOut: TokenRow, BatchStrOut: TextRow}


def encode(msg: Any) -> bytes:
    """Serialize one struct with its type tag (orjson; never pickle)."""
    name = type(msg).__name__
    if name not in _MESSAGE_TYPES:
        raise TypeError(f"not a message type: {name}")
    return orjson.dumps({"t": name, "d": dataclasses.asdict(msg)})


def decode(data: bytes) -> Any:
    """Inverse of ``encode``; refuses unknown type tags."""
    obj = orjson.loads(data)
    cls = _MESSAGE_TYPES.get(str(obj.get("t"))) if isinstance(obj, dict) else None
    if cls is None:
        raise ValueError("unknown message type on the wire")
    fields = obj["d"]
    if cls is TokenizedGenerateReq:
        fields["sampling_params"] = SamplingParams.from_wire(fields["sampling_params"])
    elif cls in _ROW_TYPES:
        fields["rows"] = [_ROW_TYPES[cls](**row) for row in fields["rows"]]
    return cls(**fields)
