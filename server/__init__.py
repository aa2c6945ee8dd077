"""Sluice: a streaming token server with a deadline-aware scheduler in front of an LLM engine."""
