"""OpenAI request schemas and their translation into engine requests.

Unknown fields are accepted and ignored, as OpenAI clients expect; known fields are checked
and a bad one becomes a 400 naming it (`param`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.sampling_params import SamplingParams


class APIError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with this HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 16:
            raise APIError(400, "stop: at most 16 stop strings", param="stop")
        return stops

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        choice: int = 0) -> SamplingParams:
        """Engine parameters for choice `choice` of `n`: choice i samples with seed + i."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=None if self.seed is None else self.seed + choice,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
            logprobs=logprobs,
            priority=self.priority,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError(400, "response_format other than text is not supported",
                           param="response_format")
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def template_messages(self) -> list[dict]:
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: only text parts are "
                                       "supported", param=f"messages.{i}.content")
                    parts.append(p["text"])
                content = "".join(parts)
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": content or ""})
        return out
