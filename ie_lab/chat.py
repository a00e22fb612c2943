"""The old import path of ie_lab/core/chat.py (chat templates moved into the core, beside the input checks that read
them: issue 29's chat <-> core cycle). The package __init__ names it for ie_lab.apply_chat_template and
ie_lab.message_spans, ie_lab.to_chat and ie_lab.split_channels; nothing inside ie_lab imports it."""

from __future__ import annotations

from .core.chat import Chat, Span, apply_chat_template, is_messages, message_spans, render, split_channels, to_chat

__all__ = ["Chat", "Span", "apply_chat_template", "is_messages", "message_spans", "render", "split_channels", "to_chat"]
