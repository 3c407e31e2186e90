from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_CLASS_UNSPECIFIED: _ClassVar[RequestClass]
    REQUEST_CLASS_REALTIME: _ClassVar[RequestClass]
    REQUEST_CLASS_INTERACTIVE: _ClassVar[RequestClass]
    REQUEST_CLASS_BATCH: _ClassVar[RequestClass]
REQUEST_CLASS_UNSPECIFIED: RequestClass
REQUEST_CLASS_REALTIME: RequestClass
REQUEST_CLASS_INTERACTIVE: RequestClass
REQUEST_CLASS_BATCH: RequestClass

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "stop", "seed")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class CompletionRequest(_message.Message):
    __slots__ = ("model", "prompt", "sampling", "request_class", "service_tier", "user", "openai_fields")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_TIER_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    OPENAI_FIELDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    sampling: SamplingParams
    request_class: RequestClass
    service_tier: str
    user: str
    openai_fields: _struct_pb2.Struct
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_class: _Optional[_Union[RequestClass, str]] = ..., service_tier: _Optional[str] = ..., user: _Optional[str] = ..., openai_fields: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatCompletionRequest(_message.Message):
    __slots__ = ("model", "messages", "sampling", "request_class", "service_tier", "user", "openai_fields")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_TIER_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    OPENAI_FIELDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    request_class: RequestClass
    service_tier: str
    user: str
    openai_fields: _struct_pb2.Struct
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_class: _Optional[_Union[RequestClass, str]] = ..., service_tier: _Optional[str] = ..., user: _Optional[str] = ..., openai_fields: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class ServingInfo(_message.Message):
    __slots__ = ("lane", "request_class", "degraded_reasons")
    LANE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASONS_FIELD_NUMBER: _ClassVar[int]
    lane: str
    request_class: RequestClass
    degraded_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lane: _Optional[str] = ..., request_class: _Optional[_Union[RequestClass, str]] = ..., degraded_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class CompletionResponse(_message.Message):
    __slots__ = ("id", "model", "created", "text", "finish_reason", "usage", "serving", "openai")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    OPENAI_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    text: str
    finish_reason: str
    usage: Usage
    serving: ServingInfo
    openai: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., serving: _Optional[_Union[ServingInfo, _Mapping]] = ..., openai: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CompletionChunk(_message.Message):
    __slots__ = ("id", "model", "created", "text", "num_tokens", "finish_reason", "usage", "serving", "openai")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    OPENAI_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    text: str
    num_tokens: int
    finish_reason: str
    usage: Usage
    serving: ServingInfo
    openai: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., text: _Optional[str] = ..., num_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., serving: _Optional[_Union[ServingInfo, _Mapping]] = ..., openai: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ChatCompletionResponse(_message.Message):
    __slots__ = ("id", "model", "created", "message", "finish_reason", "usage", "serving", "openai")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    OPENAI_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    message: ChatMessage
    finish_reason: str
    usage: Usage
    serving: ServingInfo
    openai: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., message: _Optional[_Union[ChatMessage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., serving: _Optional[_Union[ServingInfo, _Mapping]] = ..., openai: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ChatCompletionChunk(_message.Message):
    __slots__ = ("id", "model", "created", "role", "content", "num_tokens", "finish_reason", "usage", "serving", "openai")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    OPENAI_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    role: str
    content: str
    num_tokens: int
    finish_reason: str
    usage: Usage
    serving: ServingInfo
    openai: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., role: _Optional[str] = ..., content: _Optional[str] = ..., num_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., serving: _Optional[_Union[ServingInfo, _Mapping]] = ..., openai: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _struct_pb2.Struct
    def __init__(self, stats: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("input_content", "endpoint", "completion_window", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUT_CONTENT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    input_content: bytes
    endpoint: str
    completion_window: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, input_content: _Optional[bytes] = ..., endpoint: _Optional[str] = ..., completion_window: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class BatchRequestCounts(_message.Message):
    __slots__ = ("total", "completed", "failed")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    total: int
    completed: int
    failed: int
    def __init__(self, total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "status", "endpoint", "completion_window", "created_at", "completed_at", "request_counts", "input_file_id", "output_file_id", "error_file_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: str
    endpoint: str
    completion_window: str
    created_at: int
    completed_at: int
    request_counts: BatchRequestCounts
    input_file_id: str
    output_file_id: str
    error_file_id: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., status: _Optional[str] = ..., endpoint: _Optional[str] = ..., completion_window: _Optional[str] = ..., created_at: _Optional[int] = ..., completed_at: _Optional[int] = ..., request_counts: _Optional[_Union[BatchRequestCounts, _Mapping]] = ..., input_file_id: _Optional[str] = ..., output_file_id: _Optional[str] = ..., error_file_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("batch_id", "include_output")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    include_output: bool
    def __init__(self, batch_id: _Optional[str] = ..., include_output: _Optional[bool] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("batch", "output_content", "error_content")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CONTENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_CONTENT_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    output_content: bytes
    error_content: bytes
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., output_content: _Optional[bytes] = ..., error_content: _Optional[bytes] = ...) -> None: ...
