"""Anthropic's Messages API on kvstore serve: `POST /v1/messages`.

request: the body as the chat-completions body mlx-lm serves (one rendering
path, one cache for both doors); reply: the answer's content blocks, events
and usage; wire: mlx-lm's writes rewritten in Anthropic's shapes.
"""

from kvstore.serve.anthropic.request import BadRequest, origins_of, to_chat
from kvstore.serve.anthropic.reply import Reply, usage_of
from kvstore.serve.anthropic.wire import Wire, error_body

# The paths Anthropic's clients post to (Claude Code adds ?beta=true).
PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"

__all__ = ["PATH", "COUNT_PATH", "BadRequest", "Reply", "Wire", "error_body", "origins_of", "to_chat", "usage_of"]
