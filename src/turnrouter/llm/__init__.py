"""LLM clients behind the one `LLMService` protocol.

- `OpenAIChatClient`: any OpenAI-compatible chat-completions server, over the standard
  library's `http.client` in a worker thread (no extra dependency).
- `TemplateAcknowledger`: route-aware acknowledgments without a model (the embedded
  default of the demo); `spoken_topic` is how it names a route ("your calendar").
"""

from .._llm import LLMService
from ._errors import LLMError
from ._openai import OpenAIChatClient
from ._template import DEFAULT_PHRASES, GENERIC_PHRASES, TemplateAcknowledger, spoken_topic

__all__ = [
    "DEFAULT_PHRASES",
    "GENERIC_PHRASES",
    "LLMError",
    "LLMService",
    "OpenAIChatClient",
    "TemplateAcknowledger",
    "spoken_topic",
]
