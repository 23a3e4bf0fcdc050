"""Provider adapters: one module per wire API, all behind ``gateway.canonical.ProviderAdapter``.

``ADAPTERS`` holds one default-configured adapter per provider name (the ``schemas.records.Provider``
values). Adapters are frozen dataclasses: build another with different options, e.g.
``AnthropicMessages(strip_billing_header=False)``, rather than mutating a shared one.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gateway.canonical import ProviderAdapter
from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.arguments import arguments_object, canonical_arguments, normalize_arguments, same_arguments
from gateway.providers.detection import Route, detect_provider, parse_route
from gateway.providers.google_generate_content import GoogleGenerateContent
from gateway.providers.openai_chat import OpenAIChat
from gateway.providers.openai_responses import OpenAIResponses
from gateway.providers.side_calls import DEFAULT_MARKERS, is_side_call

# Read-only: a shared registry that callers could mutate would be module-level mutable state.
ADAPTERS: Mapping[str, ProviderAdapter] = MappingProxyType(
    {a.name: a for a in (AnthropicMessages(), OpenAIChat(), OpenAIResponses(), GoogleGenerateContent())}
)

__all__ = [
    "ADAPTERS",
    "AnthropicMessages",
    "DEFAULT_MARKERS",
    "GoogleGenerateContent",
    "OpenAIChat",
    "OpenAIResponses",
    "Route",
    "arguments_object",
    "canonical_arguments",
    "detect_provider",
    "is_side_call",
    "normalize_arguments",
    "parse_route",
    "same_arguments",
]
