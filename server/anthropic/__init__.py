"""Anthropic's Messages API: its wire models and their translation into the chat request Sluice
runs (`messages`), the replies and stream events rendered back in Anthropic's shape
(`replies`), its routes (`routes`, the only module here that speaks HTTP), and its endpoints
(`endpoints`: method, path, handler, OpenAPI operation)."""
