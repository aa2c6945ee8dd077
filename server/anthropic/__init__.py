"""Anthropic's Messages API: its wire models, their translation into the chat request Sluice
runs, and the replies and stream events rendered back in Anthropic's shape (no Starlette)."""
