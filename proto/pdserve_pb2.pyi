from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "messages", "cache_salt", "add_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    cache_salt: str
    add_special_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., cache_salt: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "ttft_ms", "queue_ms", "prefill_worker", "decode_worker", "prefill_ms", "kv_transfer_ms", "kv_transfer_bytes", "migrations", "cached_tokens", "kv_cached_blocks", "kv_wait_ms", "prefill_queue_ms", "prefill_compute_ms", "token_steps")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STEPS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    queue_ms: float
    prefill_worker: str
    decode_worker: str
    prefill_ms: float
    kv_transfer_ms: float
    kv_transfer_bytes: int
    migrations: int
    cached_tokens: int
    kv_cached_blocks: int
    kv_wait_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    token_steps: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., prefill_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., migrations: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., kv_cached_blocks: _Optional[int] = ..., kv_wait_ms: _Optional[float] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., token_steps: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("name", "pool", "state", "running", "waiting", "kv_blocks_used", "kv_blocks_free", "kv_blocks_total", "channels", "node_ip", "requests_served", "kv_blocks_cached", "prefix_query_tokens", "prefix_hit_tokens", "kernels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    pool: str
    state: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    channels: int
    node_ip: str
    requests_served: int
    kv_blocks_cached: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kernels: str
    def __init__(self, name: _Optional[str] = ..., pool: _Optional[str] = ..., state: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., channels: _Optional[int] = ..., node_ip: _Optional[str] = ..., requests_served: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., kernels: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("mode", "model", "workers", "router_queue", "router_in_flight", "requests_total", "pools", "autoscale")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_QUEUE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    model: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    router_queue: int
    router_in_flight: int
    requests_total: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    autoscale: AutoscaleStatus
    def __init__(self, mode: _Optional[str] = ..., model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., router_queue: _Optional[int] = ..., router_in_flight: _Optional[int] = ..., requests_total: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., autoscale: _Optional[_Union[AutoscaleStatus, _Mapping]] = ...) -> None: ...

class AutoscaleStatus(_message.Message):
    __slots__ = ("enabled", "last_decision_age_s", "reason", "next_evaluation_in_s", "pools", "scaling_actions")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_AGE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NEXT_EVALUATION_IN_S_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SCALING_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    last_decision_age_s: float
    reason: str
    next_evaluation_in_s: float
    pools: _containers.RepeatedCompositeFieldContainer[AutoscalePool]
    scaling_actions: int
    def __init__(self, enabled: _Optional[bool] = ..., last_decision_age_s: _Optional[float] = ..., reason: _Optional[str] = ..., next_evaluation_in_s: _Optional[float] = ..., pools: _Optional[_Iterable[_Union[AutoscalePool, _Mapping]]] = ..., scaling_actions: _Optional[int] = ...) -> None: ...

class AutoscalePool(_message.Message):
    __slots__ = ("pool", "desired", "actual", "cause")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    desired: int
    actual: int
    cause: str
    def __init__(self, pool: _Optional[str] = ..., desired: _Optional[int] = ..., actual: _Optional[int] = ..., cause: _Optional[str] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "target", "ready", "starting", "restarts", "last_failure", "last_failure_age_s")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    pool: str
    target: int
    ready: int
    starting: int
    restarts: int
    last_failure: str
    last_failure_age_s: float
    def __init__(self, pool: _Optional[str] = ..., target: _Optional[int] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ..., restarts: _Optional[int] = ..., last_failure: _Optional[str] = ..., last_failure_age_s: _Optional[float] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("pool", "replicas")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("pool", "replicas", "started", "stopped")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    started: _containers.RepeatedScalarFieldContainer[str]
    stopped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ..., started: _Optional[_Iterable[str]] = ..., stopped: _Optional[_Iterable[str]] = ...) -> None: ...

class ChangeRoleRequest(_message.Message):
    __slots__ = ("worker", "role", "if_idle")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IF_IDLE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    role: str
    if_idle: bool
    def __init__(self, worker: _Optional[str] = ..., role: _Optional[str] = ..., if_idle: _Optional[bool] = ...) -> None: ...

class ChangeRoleResponse(_message.Message):
    __slots__ = ("worker", "new_name", "role", "seconds")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NEW_NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    new_name: str
    role: str
    seconds: float
    def __init__(self, worker: _Optional[str] = ..., new_name: _Optional[str] = ..., role: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
