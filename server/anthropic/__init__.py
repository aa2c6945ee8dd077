"""Anthropic's Messages API: its wire models and their translation into the chat request Sluice
runs (`messages`), the replies and stream events rendered back in Anthropic's shape
(`replies`), and its routes (`routes`, the only module here that speaks HTTP)."""
