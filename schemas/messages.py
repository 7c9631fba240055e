"""Message models of wire contract v1 (docs/CONTRACT.md), with its v1.1 and v1.2 additions.

Validation here is only what a message can be judged by on its own: types, ranges, topic-name
syntax, prompt XOR messages. What depends on the deployment (context length, allowed reply
prefix, served model) is the worker's, and configurable size limits are `codec.Limits`.

Unknown fields are ignored so that a v1 reader accepts messages from a later, extended writer.
Models are frozen: a decoded message is a value, never a mutable scratchpad.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from schemas.contract import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_DEADLINE_MS,
    MAX_ID_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_MODEL_NAME_CHARS,
    MAX_N,
    MAX_NONCE_CHARS,
    MAX_REGEX_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_REPLY_PARTITION,
    MAX_ROLE_CHARS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    SCHEMA_VERSION,
    TOPIC_NAME_PATTERN,
)

FinishReason = Literal["stop", "length", "cancelled", "expired", "error"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


def _not_dot_or_dotdot(name: str) -> str:
    if name in (".", ".."):
        raise ValueError("a topic cannot be named '.' or '..'")
    return name


RequestId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
TopicName = Annotated[str, Field(pattern=TOPIC_NAME_PATTERN), AfterValidator(_not_dot_or_dotdot)]
NonNegativeMs = Annotated[float, Field(ge=0)]
Nonce = Annotated[str, Field(min_length=1, max_length=MAX_NONCE_CHARS)]
ReplyPartition = Annotated[int, Field(ge=0, le=MAX_REPLY_PARTITION)]


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class ChatMessage(WireModel):
    role: str = Field(min_length=1, max_length=MAX_ROLE_CHARS)
    content: str


class TextFormat(WireModel):
    """OpenAI's default `response_format`: no constraint."""

    type: Literal["text"]


class JsonObjectFormat(WireModel):
    """OpenAI's JSON mode: the output is one JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(WireModel):
    """OpenAI's `json_schema` object. The output always follows `schema` (as `strict: true`)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    # `schema` is a pydantic BaseModel attribute name; the wire name is kept by the alias.
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(
        extra="ignore", frozen=True, allow_inf_nan=False, populate_by_name=True
    )


class JsonSchemaFormat(WireModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(WireModel):
    """The output matches `regex` as a whole."""

    type: Literal["regex"]
    regex: str = Field(min_length=1, max_length=MAX_REGEX_CHARS)


class ChoiceFormat(WireModel):
    """The output is exactly one of `choice`."""

    type: Literal["choice"]
    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] = Field(
        min_length=1, max_length=MAX_CHOICES
    )


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat,
    Field(discriminator="type"),
]


def _int_key_as_text(value: object) -> object:
    return str(value) if type(value) is int else value


def _token_id_in_range(key: str) -> str:
    if int(key) > MAX_TOKEN_ID:
        raise ValueError(f"token id {key} is above {MAX_TOKEN_ID}")
    return key


TokenIdKey = Annotated[
    str,
    BeforeValidator(_int_key_as_text),
    Field(pattern=r"^(0|[1-9][0-9]{0,9})$"),
    AfterValidator(_token_id_in_range),
]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)]


class Request(WireModel):
    """One generation request. Sampling fields are flat, as in OpenAI/vLLM.

    `top_k` 0 or -1 means no top-k cut; `temperature` 0 means greedy; `seed` None lets the worker
    derive one from `id`, so a redelivered request generates the same tokens.
    """

    id: RequestId
    reply_to: TopicName
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOKEN_ID)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    # v1.2: one string is accepted too (as OpenAI), and read as a list of one.
    stop: list[StopString] = []
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = []
    ignore_eos: bool = False
    # v1.1: top-k log-probabilities per generated token (vLLM's `logprobs`); None = none.
    # v1.2: OpenAI's form too, `logprobs: true` with `top_logprobs` (0 when absent).
    logprobs: bool | Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # v1.2 sampling, as OpenAI (penalties over generated tokens; repetition as HF/vLLM, over
    # prompt and generated tokens; min_p as HF/vLLM). logit_bias: token id -> added to its logit.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # Keys are token ids written as strings, on the wire in both encodings (JSON object keys
    # are strings; OpenAI's form). A Python caller may build it with int keys.
    logit_bias: dict[
        TokenIdKey, Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]
    ] = Field(default={}, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # v1.2 structured output: OpenAI's `text` / `json_object` / `json_schema`, plus `regex`
    # and `choice`. A schema that does not compile is an `invalid_request` final.
    response_format: ResponseFormat | None = None
    # v1.2: OpenAI's `n`: that many samples (choices) of the prompt, sample i seeded seed + i.
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = True
    deadline_ms: int | None = Field(
        default=None, ge=0, le=MAX_DEADLINE_MS, description="absolute Unix epoch ms"
    )
    model: str | None = Field(default=None, min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1, le=MAX_TOKEN_ID)
    # v1.2: a secret the worker echoes in every reply; a client that sent one drops replies
    # without it (anyone who can produce requests could otherwise forge another's replies).
    nonce: Nonce | None = None
    # v1.2: the partition of `reply_to` every reply goes to (a shared reply topic, where each
    # client reads only its own partition); None: the worker's partitioner picks one by key.
    reply_partition: ReplyPartition | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> Request:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.top_logprobs is not None and self.logprobs is False:
            raise ValueError("top_logprobs needs logprobs (true, or left out)")
        if (
            self.top_logprobs is not None and type(self.logprobs) is int
            and self.logprobs != self.top_logprobs
        ):  # fmt: skip
            raise ValueError("logprobs (a count) and top_logprobs disagree; give one of them")
        return self

    @property
    def logit_bias_by_id(self) -> dict[int, float]:
        return {int(token): bias for token, bias in self.logit_bias.items()}

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per generated token the engine computes; None = no logprobs."""
        if self.top_logprobs is not None:
            return self.top_logprobs
        if self.logprobs is None or self.logprobs is False:
            return None
        return 0 if self.logprobs is True else self.logprobs

    @property
    def num_prompt_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.content) for m in self.messages or ())


class Usage(WireModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class Timing(WireModel):
    """Milliseconds from the worker's point of view. `ttft_ms` is None when no token was made."""

    queued_ms: NonNegativeMs
    ttft_ms: NonNegativeMs | None = None
    total_ms: NonNegativeMs
    # Where the time went (v1.1, optional: old readers ignore them). kafka_ms: the record's
    # producer timestamp to consumption (clocks of two machines: a hint); batcher_ms: held by
    # the urgency batcher; engine_queue_ms: handed to the engine until the step that made the
    # first token started; prefill_ms: that step; decode_ms: first token to the last.
    kafka_ms: NonNegativeMs | None = None
    batcher_ms: NonNegativeMs | None = None
    engine_queue_ms: NonNegativeMs | None = None
    prefill_ms: NonNegativeMs | None = None
    decode_ms: NonNegativeMs | None = None


class ErrorInfo(WireModel):
    code: str = Field(min_length=1)
    message: str


class _Reply(WireModel):
    """Common to every reply: `attempt` names one generation try, `seq` counts within it."""

    id: RequestId
    attempt: str = Field(min_length=1)
    seq: int = Field(ge=0)
    nonce: Nonce | None = None  # v1.2: the request's nonce, echoed


class TopLogprob(WireModel):
    token_id: int = Field(ge=0)
    logprob: float = Field(le=0.0)


class TokenLogprob(WireModel):
    """One generated token's log-probability and the request's top-k alternatives."""

    token_id: int = Field(ge=0)
    logprob: float = Field(le=0.0)
    top_logprobs: list[TopLogprob] = []


class TokenReply(_Reply):
    type: Literal["token"] = "token"
    text: str
    token_ids: list[int] = []
    # v1.1: one entry per token of `token_ids` when the request asked for `logprobs`.
    logprobs: list[TokenLogprob] | None = None
    # v1.2: the choice these tokens belong to; sent only for a request with n > 1 (absent: 0).
    index: int | None = Field(default=None, ge=0, lt=MAX_N)


class Choice(WireModel):
    """v1.2: one sample of a request with n > 1, in its final."""

    index: int = Field(ge=0, lt=MAX_N)
    text: str
    finish_reason: FinishReason
    completion_tokens: int = Field(default=0, ge=0)


class FinalReply(_Reply):
    """Last message of an attempt. `text` is the whole completion of that attempt."""

    type: Literal["final"] = "final"
    finish_reason: FinishReason
    text: str = ""
    usage: Usage
    timing: Timing
    error: ErrorInfo | None = None
    # v1.2: for a request with n > 1, every choice by index (`text` and `finish_reason` above
    # then repeat choice 0's, or say why the request ended early); absent when n is 1.
    choices: list[Choice] | None = Field(default=None, max_length=MAX_N)

    @model_validator(mode="after")
    def _error_iff_error_reason(self) -> FinalReply:
        if (self.finish_reason == "error") != (self.error is not None):
            raise ValueError("'error' is required exactly when finish_reason is 'error'")
        return self


Reply = Annotated[TokenReply | FinalReply, Field(discriminator="type")]


class Cancel(WireModel):
    """On the control topic: stop request `id` wherever it is."""

    type: Literal["cancel"] = "cancel"
    id: RequestId


class ErrorCode:
    """Error codes a final may carry. Open set: a client must accept codes it does not know."""

    INVALID_REQUEST = "invalid_request"
    LIMIT_EXCEEDED = "limit_exceeded"
    PROMPT_TOO_LONG = "prompt_too_long"
    MODEL_NOT_SERVED = "model_not_served"
    INTERNAL = "internal"
